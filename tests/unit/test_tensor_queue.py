"""The submission queue: name clashes, releases, the stall inspector's snapshot."""

import pytest

from hvdlike.core import collectives
from hvdlike.core.errors import DuplicateNameError
from hvdlike.core.messages import OpType, Request, new_request
from hvdlike.core.tensor_queue import TensorQueue


def _entry(name, origin="", at=1.0):
    entry = collectives.barrier_entry(name)
    entry.origin, entry.enqueued_at = origin, at
    return entry


def test_name_in_flight_is_refused_naming_the_holder():
    queue = TensorQueue()
    queue.put([_entry("a", "hvdlike.numpy")])
    with pytest.raises(DuplicateNameError, match="'a' is already in flight") as info:
        queue.put([_entry("a", "hvdlike.torch")])
    assert info.value.holder.origin == "hvdlike.numpy"
    with pytest.raises(DuplicateNameError) as info:
        queue.put([_entry("b"), _entry("a")])
    assert info.value.holder.request.name == "a"
    with pytest.raises(DuplicateNameError, match="'c'") as info:
        queue.put([_entry("c"), _entry("c")])
    assert info.value.holder is None
    assert [e.request.name for e in queue.drain()] == ["a"]  # refused groups left nothing


def test_release_many_frees_names_and_the_snapshot_follows():
    queue = TensorQueue()
    queue.put([_entry("a", at=1.0)])
    queue.put([_entry("b", at=2.0), _entry("c", at=2.0)])
    assert queue.waiting_since() == {"a": 1.0, "b": 2.0, "c": 2.0}
    queue.release_many(["a", "c", "unknown"])
    assert queue.waiting_since() == {"b": 2.0} and queue.inflight() == 1
    queue.put([_entry("a")])  # free again
    assert queue.wakeup.is_set()
    queue.drain()
    assert not queue.wakeup.is_set()


def test_new_request_equals_the_dataclass_built_one():
    import pickle

    fast = new_request("n", OpType.ALLREDUCE, "float32", (2, 3), "cpu", prescale=2.0, group="g",
                       group_size=2)
    slow = Request(name="n", op=OpType.ALLREDUCE, dtype="float32", shape=(2, 3), prescale=2.0,
                   group="g", group_size=2)
    assert fast == slow and hash(fast) == hash(slow)
    assert pickle.loads(pickle.dumps(fast)) == slow
    assert fast.signature() == slow.signature()
    assert fast.with_rank(1).rank == 1 and fast.rank == 0
    with pytest.raises(AttributeError):
        fast.name = "other"  # still frozen


def test_concurrent_submitters_lose_nothing_and_clash_once_per_name():
    import threading

    queue = TensorQueue()
    clashes = []
    drained = []

    def submit(tag):
        for i in range(300):
            try:
                queue.put([_entry(f"n{i}", tag)])
            except DuplicateNameError:
                clashes.append(i)
            if i % 50 == 0:
                queue.put([_entry(f"{tag}.g{i}.0"), _entry(f"{tag}.g{i}.1")])

    threads = [threading.Thread(target=submit, args=(t,)) for t in ("x", "y")]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        drained += queue.drain()
    for t in threads:
        t.join(10)
    drained += queue.drain()
    names = [e.request.name for e in drained]
    assert sorted(clashes) == list(range(300))  # each name went in exactly once
    assert len(names) == len(set(names)) == 300 + 2 * 6 * 2  # names, plus 6 pairs per thread
    for tag in ("x", "y"):  # a group stays in one piece, in order
        for i in range(0, 300, 50):
            k = names.index(f"{tag}.g{i}.0")
            assert names[k + 1] == f"{tag}.g{i}.1"
    assert set(queue.waiting_since()) == set(names)
