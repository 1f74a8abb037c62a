"""The drafter link's device steps (drafter.proto DeviceStep): what makes RemoteDrafter a DraftsOnDevice drafter when
the drafter it reaches takes them (same host, shm or CUDA IPC buffers: device_exchange.py). A component of the
link (drafter_link.py has the connection, drafter_client.py the synchronous steps), sharing its StepBook."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from specdec.drafting import DeviceDrafts, DeviceDraftStep, DeviceSchedule, ScheduleChanges, changes_between
from specdec.rpc.v1 import drafter_pb2 as pb

from .link_messages import link_message, prefix_messages

if TYPE_CHECKING:
    from .drafter_client import RemoteDrafter
    from .drafter_link import LinkConnection


class DeviceSteps:
    """A RemoteDrafter's device steps (DraftsOnDevice): the link's connection, lock, answer reader and step book
    through its public members."""

    def __init__(self, link: RemoteDrafter):
        self.link = link
        self.held = None        # (connection, the schedule its drafter holds after the last device step sent on it)
        self.sent = [0, 0]      # device steps sent [whole, as changes]

    @property
    def available(self) -> bool:
        """Connected to a drafter that takes device steps (same host, shm or CUDA IPC)."""
        connection = self.link.current
        return connection is not None and connection.exchange is not None

    def draft_later(self, step: DeviceDraftStep) -> Callable[[], DeviceDrafts]:
        """Write the step's rows into the exchange buffers and send its schedule now; the returned call waits for
        the answer, which the drafter sends once it has queued its work (device_exchange.py): the drafts are then
        on the device, and the current stream waits for them. A failure of any kind is no drafts for this step
        (and a reconnect)."""
        link, b = self.link, len(step.seq_ids)
        connection = link.current

        def failed(why: str) -> Callable[[], DeviceDrafts]:
            out = DeviceDrafts(None, [0] * b, failure=why)
            return lambda: out
        if connection is None or connection.exchange is None:
            return failed("the drafter does not take device steps (not connected)")
        too_large = connection.exchange.fits(step)
        if too_large:
            return failed(too_large)
        resumed = {p.seq_id for p in step.prefixes if p.resumed}
        for seq_id, start in zip(step.seq_ids, step.start_pos):
            if start == 0 or seq_id in resumed:   # (a resumed one: the drafter says if it lacks it)
                link.book.known.add(seq_id)
        number, release = link.book.next_step()
        held = self.held[1] if self.held is not None and self.held[0] is connection else None
        changes, holds = changes_between(held, step.schedule) if connection.changes_only else (None, step.schedule)
        message = pb.StepInput(step=number, release_seq_ids=release,
                               device=device_message(holds if changes is None else changes),
                               prefixes=prefix_messages(step.prefixes))
        link.trace.mark("link.message", number)
        with link.lock:   # a reconnect closes the replaced connection's buffers under this lock
            if connection is not link.current:
                return failed("the drafter connection was replaced")
            connection.exchange.write(step)
            ref = connection.sender.send(step.hidden[:step.num_tokens])
            if changes is None:   # (a step sent as changes points at the same rows of the same buffer)
                message.hidden.CopyFrom(link_message(pb.TensorRef, ref))
        start = time.perf_counter()
        link.trace.mark("link.sent", number)
        try:
            connection.stream.send(pb.DraftStepRequest(step=message))
        except OSError as e:   # the local lane's drafter is gone
            link.stream_ended(connection, f"the local lane: {e}")
            return failed("the drafter is not connected")
        self.held = (connection, holds)   # what the drafter holds once it read this step
        self.sent[changes is not None] += 1
        return lambda: self._answer(connection, number, start, step)

    def _answer(self, connection: LinkConnection, number: int, start: float, step: DeviceDraftStep) -> DeviceDrafts:
        b, link = len(step.seq_ids), self.link
        response = link.response(connection, number, start)
        if response is None or len(response.draft_counts) != b:
            link.disconnect(connection)
            return DeviceDrafts(None, [0] * b, failure=f"drafter step {number} got no valid answer")
        lost = link.book.lost(response.missing_seq_ids)
        missing = dict.fromkeys([i for i in step.seq_ids if i not in link.book.known] + lost)   # (in order, once)
        return DeviceDrafts(connection.exchange.drafts(b), list(response.draft_counts), list(missing))


def device_message(schedule: DeviceSchedule | ScheduleChanges) -> pb.DeviceStep:
    """A device step's schedule, whole or as the changes from the last one (drafter.proto, DeviceStep)."""
    changes = schedule if isinstance(schedule, ScheduleChanges) else None
    given = schedule if changes is None else changes.given     # (host numpy arrays: no device read)
    return pb.DeviceStep(seq_ids=given.seq_ids.tolist(), start_pos=given.start_pos.tolist(),
                         max_shift=given.max_shift.tolist(), chunk_lens=given.chunk_lens.tolist(),
                         num_drafts=given.num_drafts.tolist(), changes_only=changes is not None,
                         removed=[] if changes is None else changes.removed.tolist(),
                         placed=[] if changes is None else changes.placed.tolist())
