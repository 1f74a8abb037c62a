"""A Sequence is one request's state: equal only to itself. The scheduler finds, removes and preempts sequences in
lists (`seq in running`, `running.remove(seq)`); with the dataclass's value equality every lookup built and
compared tuples of all the fields of each sequence before it, O(batch^2) per step (at batch 64 most of a decode
step's host time), and a lookup could find another sequence holding the same values."""
from verifier_service.sequence import Sequence


def test_sequences_with_the_same_values_are_different_sequences():
    first, second = Sequence(7, [5, 6, 7], 3), Sequence(7, [5, 6, 7], 3)
    assert first == first and first != second
    assert len({first, second}) == 2          # hashable by identity: usable as set members and dict keys
    running = [first, second]
    running.remove(second)                    # removes that sequence, not the first one holding the same values
    assert len(running) == 1 and running[0] is first
    assert second not in running
