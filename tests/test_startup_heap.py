"""A served process freezes its start-up heap: the start-up's garbage is collected first (not kept for the life
of the process), and what is alive then is out of every later collection's traversal."""
import gc
import weakref

from specdec.startup_heap import freeze_startup_heap


class Node:
    pass


def test_the_start_up_heap_is_frozen_after_its_garbage_is_collected():
    alive = [Node() for _ in range(1000)]
    garbage = Node()
    garbage.cycle = garbage          # only a collection frees a cycle
    collected = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_startup_heap("test")
        assert collected() is None                                   # collected, not frozen
        assert frozen >= len(alive) and gc.get_freeze_count() >= len(alive)   # (frozen objects freed leave it)
        assert not any(o is alive[0] for o in gc.get_objects())      # no generation holds it any more
        later = Node()
        assert any(o is later for o in gc.get_objects())             # what serving creates is still collected
    finally:
        gc.unfreeze()
