"""Lazily created groups wait for every member through the store, and can give up."""

import datetime
import threading
import time

import pytest
import torch

from hvdlike.core.errors import HvdlikeInternalError
from hvdlike.core.transport import Groups, _arrive
from tests.local_store import client, host_store


def test_a_lone_member_gives_up_when_the_job_fails():
    # Rank 1 agreed on its set's first CPU collective just as the job failed; rank 0 never
    # comes to create the data group. Without the arrival step Gloo's own rendezvous would
    # hold rank 1 for the whole (here 60 s) timeout.
    store = host_store()
    fatal = []
    groups = Groups(store, rank=1, size=2, timeout_seconds=60, gloo_control=False,
                    abandon=lambda: fatal[0] if fatal else None)
    threading.Timer(0.5, lambda: fatal.append(RuntimeError("stalled for 4s"))).start()
    started = time.monotonic()
    with pytest.raises(HvdlikeInternalError) as err:
        groups.torch_group("cpu")
    assert time.monotonic() - started < 30  # gave up on the failure, not on the timeout
    assert str(err.value) == ("gave up creating the cpu data group, the job has failed: "
                              "stalled for 4s")
    assert groups._data == {}  # nothing half-made is kept


def test_a_member_that_never_comes_is_named_at_the_timeout():
    store = host_store()
    with pytest.raises(HvdlikeInternalError) as err:
        _arrive(store, 0, 3, datetime.timedelta(seconds=0.3), lambda: None, "cpu data")
    assert str(err.value) == ("the cpu data group was not created within 0.3s: "
                              "rank(s) [1, 2] of its 3 member(s) never came to create it")


def test_members_that_all_come_get_a_working_group():
    host = host_store()
    results = [None, None]

    def member(rank):  # each member on its own connection, as in separate processes
        groups = Groups(client(host), rank, 2, timeout_seconds=30, local_addr="127.0.0.1",
                        gloo_control=False)
        t = torch.tensor([float(rank + 1)])
        groups.torch_group("cpu").allreduce([t]).wait()
        results[rank] = t.item()
        groups.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [3.0, 3.0]


def test_a_member_that_came_and_gave_up_is_not_waited_for():
    # Rank 0 reached the group first and gave up (its job had failed); rank 1 comes
    # later. Rank 1 must not enter Gloo's rendezvous, where rank 0 will never be.
    host = host_store()
    failed = RuntimeError("stalled for 4s")
    with pytest.raises(HvdlikeInternalError) as first:
        Groups(client(host), 0, 2, timeout_seconds=60, local_addr="127.0.0.1",
               gloo_control=False, abandon=lambda: failed).torch_group("cpu")
    assert str(first.value).endswith("the job has failed: stalled for 4s")
    started = time.monotonic()
    with pytest.raises(HvdlikeInternalError) as second:
        Groups(client(host), 1, 2, timeout_seconds=60, local_addr="127.0.0.1",
               gloo_control=False).torch_group("cpu")
    assert time.monotonic() - started < 30
    assert str(second.value) == ("gave up creating the cpu data group: another member gave up "
                                 "(gave up creating the cpu data group, the job has failed: "
                                 "stalled for 4s)")


def test_a_failing_member_still_enters_once_everyone_has_come():
    # Once all members have arrived the others are entering the group: a member whose
    # job failed meanwhile enters too, rather than leave them in the rendezvous.
    host = host_store()
    failed = RuntimeError("stalled")
    results = [None, None]

    def member(rank, abandon):
        groups = Groups(client(host), rank, 2, timeout_seconds=30, local_addr="127.0.0.1",
                        gloo_control=False, abandon=abandon)
        t = torch.tensor([1.0])
        groups.torch_group("cpu").allreduce([t]).wait()
        results[rank] = t.item()
        groups.close()

    first = threading.Thread(target=member, args=(0, lambda: None))
    first.start()
    time.sleep(0.3)  # rank 0 is waiting at the gate when rank 1, already failed, comes
    second = threading.Thread(target=member, args=(1, lambda: failed))
    second.start()
    first.join(60)
    second.join(60)
    assert results == [2.0, 2.0]


def test_a_decider_that_never_writes_is_not_waited_for_once_the_job_failed():
    # Rank 1 arrived, claimed the go/stop decision (the atomic counter) and died before
    # writing it. Rank 0 finds everyone arrived and the decision taken: it waits for the
    # verdict, and once its job has failed it gives up instead of waiting 2 x the timeout.
    store = host_store()
    store.set("arrived/1", "1")
    assert store.add("decider", 1) == 1
    failed = RuntimeError("rank 1 on vm (pid 7) died")
    started = time.monotonic()
    with pytest.raises(HvdlikeInternalError) as err:
        _arrive(store, 0, 2, datetime.timedelta(seconds=60), lambda: failed, "cpu data")
    assert time.monotonic() - started < 30
    assert str(err.value) == ("no decision on creating the cpu data group: the member that "
                              "took it never wrote it, and the job has failed: rank 1 on vm "
                              "(pid 7) died")
    assert not store.check(["verdict"])  # nobody was told "go"


def test_a_decider_that_never_writes_is_named_at_twice_the_timeout():
    store = host_store()
    store.set("arrived/1", "1")
    store.add("decider", 1)
    with pytest.raises(HvdlikeInternalError) as err:
        _arrive(store, 0, 2, datetime.timedelta(seconds=0.2), lambda: None, "control")
    assert str(err.value) == ("no decision on creating the control group: the member that "
                              "took it never wrote it")


def test_closed_groups_refuse_to_make_a_group_again():
    # The teardown closed the set's groups while a user thread still ran a cycle: that
    # thread must fail at once, not rendezvous afresh under the first group's keys.
    groups = Groups(host_store(), 0, 2, timeout_seconds=60, gloo_control=False)
    groups.close()
    for make in (lambda: groups.torch_group("cpu"), lambda: groups.subgroup("x/", 0, [0, 1])):
        with pytest.raises(HvdlikeInternalError) as err:
            make()
        assert "cannot be created: this process set's groups are closed" in str(err.value)
