"""Device steps sent as changes (specdec/drafting/device_schedule.py): what the drafter decodes is what the verifier
believes it holds, equal to the verifier's schedule but for start positions at most START_POS_SLACK ahead (exact
at 0), and a steady batch sends nothing."""
import numpy as np
import pytest

from specdec.drafting import DeviceSchedule, ScheduleChanges, apply_changes, changes_between
from specdec.drafting.device_schedule import START_POS_SLACK

K = 3


class VerifierModel:
    """Sequences as the overlapped verifier schedules them: a decode chunk is [last token] + d drafts; the host
    learns a step's accepted drafts one step late, so a start moves by the committed rows it knows."""

    def __init__(self, rng: np.random.Generator, accept):
        self.rng, self.accept = rng, accept
        self.start: dict[int, int] = {}      # host-known start of the next chunk
        self.unread: dict[int, int] = {}     # accepted drafts of the last step (not read yet)
        self.shift: dict[int, int] = {}      # drafts of the last step: how far the device may move the start
        self.drafts: dict[int, int] = {}     # drafts in the next chunk
        self.order: list[int] = []
        self.next_id = 0

    def join(self) -> None:
        self.order.append(self.next_id)
        self.restart(self.next_id)
        self.next_id += 1

    def restart(self, i: int) -> None:
        self.start[i], self.unread[i], self.shift[i], self.drafts[i] = 0, 0, 0, 0

    def step(self) -> DeviceSchedule:
        ids = list(self.order)
        chunk = [1 + self.drafts[i] if self.start[i] else 1 + int(self.rng.integers(0, 9)) for i in ids]
        schedule = DeviceSchedule.of(ids, [self.start[i] for i in ids], [self.shift[i] for i in ids], chunk,
                                     [K] * len(ids))
        for i, n in zip(ids, chunk):
            drafts = n - 1 if self.start[i] else 0
            self.start[i] += n - drafts + self.unread[i]          # this step's base, the last step's accepts
            self.unread[i], self.shift[i] = min(drafts, self.accept(self.rng)), drafts
            self.drafts[i] = K
        return schedule


def full_acceptance(rng):
    return K


def mean_acceptance_of_3_39(rng):
    return int(rng.choice(4, p=[0.1, 0.15, 0.2, 0.55]))   # 2.2 drafts accepted on average


def round_trip(held_by_verifier, held_by_drafter, current):
    """One step over the wire (the verifier's message, serialized, read by the drafter); returns what both ends
    hold after it (asserted equal)."""
    from drafter_service.device_step import read_schedule
    from specdec.rpc.v1 import drafter_pb2 as pb
    from verifier_service.device_step_link import device_message
    changes, holds = changes_between(held_by_verifier, current)
    wire = device_message(holds if changes is None else changes).SerializeToString()
    decoded = read_schedule(pb.DeviceStep.FromString(wire), held_by_drafter)
    for name in ("seq_ids", "max_shift", "chunk_lens", "num_drafts"):
        assert np.array_equal(getattr(decoded, name), getattr(current, name)), name
        assert np.array_equal(getattr(holds, name), getattr(current, name)), name
    assert np.array_equal(decoded.start_pos, holds.start_pos)
    ahead = decoded.start_pos - current.start_pos
    assert (ahead >= 0).all() and (ahead <= START_POS_SLACK).all()
    assert (decoded.start_pos[current.start_pos == 0] == 0).all()
    return holds, decoded, changes


def test_a_steady_batch_sends_nothing_but_its_step():
    rng = np.random.default_rng(0)
    model = VerifierModel(rng, full_acceptance)
    for _ in range(16):
        model.join()
    verifier = drafter = None
    sent = []
    for _ in range(60):
        verifier, drafter, changes = round_trip(verifier, drafter, model.step())
        sent.append(None if changes is None else len(changes.given) + len(changes.removed))
    # whole; then the prompts' first decode chunks, and the first whose start the device may move (max_shift)
    assert sent[0] is None and sent[1] == sent[2] == 16
    assert sent[3:] == [0] * 57


def test_with_rejected_drafts_a_start_is_sent_when_the_prediction_runs_more_than_the_slack_ahead():
    """Each step runs the prediction ahead by the drafts rejected (0.8 here): a sequence's start is given about
    every START_POS_SLACK / 0.8 steps, and only then."""
    rng = np.random.default_rng(1)
    model = VerifierModel(rng, mean_acceptance_of_3_39)
    for _ in range(16):
        model.join()
    verifier = drafter = None
    given, steps = 0, 800
    for n in range(steps):
        verifier, drafter, changes = round_trip(verifier, drafter, model.step())
        given += len(changes.given) if n >= 3 else 0
    expected = 16 * steps * 0.8 / START_POS_SLACK
    assert 0.7 * expected < given < 1.3 * expected, (given, expected)


@pytest.mark.parametrize("seed", range(6))
def test_joins_leaves_restarts_and_reorders_decode_to_what_the_verifier_holds(seed):
    rng = np.random.default_rng(seed)
    model = VerifierModel(rng, mean_acceptance_of_3_39)
    verifier = drafter = None
    kinds = set()
    for n in range(300):
        event = rng.integers(0, 10)
        if event == 0 or not model.order:
            model.join()
        elif event == 5:
            model.join(), model.join()
        elif event == 1:
            model.order.remove(model.order[int(rng.integers(len(model.order)))])       # finished
        elif event == 2:
            i = model.order[int(rng.integers(len(model.order)))]                       # preempted: starts over
            model.restart(i)
        elif event == 3 and len(model.order) > 1:
            model.order.append(model.order.pop(0))                                     # reordered
        elif event == 6 and len(model.order) > 2:
            skipped = model.order.pop(1)                                               # skipped a step, then back
            verifier, drafter, _ = round_trip(verifier, drafter, model.step())
            model.order.insert(1, skipped)
        elif event == 4:
            verifier = drafter = None                                                  # a reconnect: both afresh
        elif event == 7:
            model.step()                                                               # a step of the other kind
        current = model.step()
        verifier, drafter, changes = round_trip(verifier, drafter, current)
        kinds.add("whole" if changes is None else "changes")
    assert kinds == {"whole", "changes"}


def test_a_sequence_skipped_for_a_step_comes_back_in_its_place_as_changes():
    held = DeviceSchedule.of([1, 2, 3], [10, 20, 30], [3, 3, 3], [4, 4, 4], [3, 3, 3])
    current = DeviceSchedule.of([1, 5, 3, 6], [14, 0, 34, 0], [3, 0, 3, 0], [4, 7, 4, 2], [3, 3, 3, 3])
    changes, holds = changes_between(held, current)
    assert changes.removed.tolist() == [1] and changes.placed.tolist() == [1, 3]
    assert changes.given.seq_ids.tolist() == [5, 6]
    assert apply_changes(held, changes).seq_ids.tolist() == holds.seq_ids.tolist() == [1, 5, 3, 6]


def test_a_sequence_that_starts_over_within_the_slack_is_sent_at_0():
    """Preempted right after its first chunk: the prediction (5) is within the slack of 0, yet a start of 0
    means "start afresh" to a drafter, so it is given."""
    held = DeviceSchedule.of([1, 2], [0, 40], [0, 3], [5, 4], [3, 3])
    current = DeviceSchedule.of([1, 2], [0, 43], [0, 3], [5, 4], [3, 3])
    changes, holds = changes_between(held, current)
    assert changes.given.seq_ids.tolist() == [1]
    assert apply_changes(held, changes).start_pos.tolist() == holds.start_pos.tolist() == [0, 44]


def test_changes_that_do_not_fit_the_schedule_held_are_refused():
    held = DeviceSchedule.of([4, 5, 6], [10, 20, 0], [3, 3, 0], [4, 4, 9], [3, 3, 3])
    nothing, none = DeviceSchedule.of([], [], [], [], []), np.zeros(0, np.int64)
    with pytest.raises(ValueError, match="no device step came before"):
        apply_changes(None, ScheduleChanges(none, nothing, none))
    for removed in ([3], [1, 1], [2, 0], [-1]):
        with pytest.raises(ValueError, match="removed"):
            apply_changes(held, ScheduleChanges(np.array(removed), nothing, none))
    twice = DeviceSchedule.of([8, 8], [0, 0], [0, 0], [1, 1], [0, 0])
    with pytest.raises(ValueError, match="given twice"):
        apply_changes(held, ScheduleChanges(none, twice, np.array([3, 4])))
    for placed in ([], [3], [-1]):
        with pytest.raises(ValueError, match="placed"):
            apply_changes(held, ScheduleChanges(np.array([0]), DeviceSchedule.of([4], [0], [0], [2], [0]),
                                                np.array(placed, np.int64)))
    readded = apply_changes(held, ScheduleChanges(np.array([0]), DeviceSchedule.of([4], [0], [0], [2], [0]),
                                                  np.array([1])))
    assert readded.seq_ids.tolist() == [5, 4, 6] and readded.start_pos.tolist() == [24, 0, 9]
