"""Process sets misused on real ranks: a set invalid on one rank only, objects kept
across shutdown()/init(), and what removal and the queries answer.

An invalid set on one rank must not leave the others waiting in the exchange
that registration is: every rank raises at once, naming the rank and the
problem, and the job goes on. Each run bounds the time a refusal may take, so a
rank that waits out a deadlock or start timeout fails the test.
"""

from tests.multiproc.harness import run_ranks

# A refusal is one exchange among three ranks; waiting out a timeout takes 30 s.
_QUICK = 10.0


def _attempt(call):
    """``(exception type name or None, message, seconds)`` of ``call()``."""
    import time

    started = time.monotonic()
    try:
        call()
        return None, "", time.monotonic() - started
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - started


def _dynamic_one_rank_invalid():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init(process_sets="dynamic")
    r = hvd.rank()
    s12 = hvd.add_process_set([1, 2])
    cases = {
        "out_of_range": [0, 7] if r == 0 else [0, 2],
        "empty": [] if r == 1 else [0, 2],
        "registered": s12 if r == 2 else [0, 2],
        "repeated": [0, 0] if r == 1 else [0, 1],
        "not_a_list": 5 if r == 0 else [0, 1],
    }
    out = {name: _attempt(lambda arg=arg: hvd.add_process_set(arg))
           for name, arg in cases.items()}
    # The job is still usable: global and set collectives, and a valid add.
    out["global"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
    s02 = hvd.add_process_set([0, 2])
    out["s02_id"] = s02.process_set_id
    if s02.included():
        out["s02"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=s02).item()
    hvd.barrier()
    hvd.shutdown()
    return out


def test_add_process_set_invalid_on_one_rank_raises_on_every_rank_and_job_goes_on():
    results = run_ranks(_dynamic_one_rank_invalid, np=3, timeout=90)
    faulty = {"out_of_range": (0, "ranks [7] of ProcessSet(process_set_id=None, ranks=[0, 7]"
                                  ", mpi_comm=None) do not exist in a job of 3 rank(s)"),
              "empty": (1, "a process set needs at least one rank"),
              "registered": (2, "ProcessSet(process_set_id=1, ranks=[1, 2], mpi_comm=None) is "
                                "already registered (process set 1)"),
              "repeated": (1, "ProcessSet ranks must be unique, got [0, 0]"),
              "not_a_list": (0, "ProcessSet expects a list of global ranks, got int")}
    for r, out in enumerate(results):
        for case, (bad, reason) in faulty.items():
            kind, message, seconds = out[case]
            expected = "TypeError" if (case, r) == ("not_a_list", 0) else "ValueError"
            assert kind == expected, (r, case, kind, message)
            assert seconds < _QUICK, (r, case, seconds, message)
            assert message.startswith(f"add_process_set() was refused on every rank: rank(s) "
                                      f"{bad} passed an invalid process set"), (r, case, message)
            assert f"  rank {bad}: " in message and f"  <- {reason}" in message, message
            good = next(x for x in range(3) if x != bad)
            assert f"  rank {good}: ('add', [" in message, message
        assert "rank 0: ('add', 5)  <- " in out["not_a_list"][1]
        assert out["global"] == 3.0
        assert out["s02_id"] == 2  # the refused calls took no id
    assert results[0]["s02"] == results[2]["s02"] == 2.0


def _static_one_rank_invalid():
    import os

    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    r = int(os.environ["HVDLIKE_RANK"])
    out = {}
    bad = hvd.ProcessSet([0, 9]) if r == 0 else hvd.ProcessSet([0, 1])
    out["out_of_range"] = _attempt(lambda: hvd.init(process_sets=[bad]))
    out["initialized"] = hvd.is_initialized()
    sets = [hvd.ProcessSet([0, 1]), 5] if r == 1 else [hvd.ProcessSet([0, 1])]
    out["not_a_set"] = _attempt(lambda: hvd.init(process_sets=sets))
    # Nothing is left over: the next init() works, with the valid set.
    s01 = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[s01])
    out["s01_id"] = s01.process_set_id
    if s01.included():
        out["s01"] = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum,
                                   process_set=s01).item()
    out["global"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    hvd.barrier()
    hvd.shutdown()
    return out


def test_init_with_a_set_invalid_on_one_rank_raises_on_every_rank():
    results = run_ranks(_static_one_rank_invalid, np=3, timeout=90)
    for r, out in enumerate(results):
        kind, message, seconds = out["out_of_range"]
        assert kind == "ValueError" and seconds < _QUICK, (r, out["out_of_range"])
        assert message.startswith("init() was refused on every rank: rank(s) 0 passed an "
                                  "invalid process set"), message
        assert ("  rank 0: [[0, 9]]  <- process_sets[0]: ranks [9] of ProcessSet("
                "process_set_id=None, ranks=[0, 9], mpi_comm=None) do not exist in a job of "
                "3 rank(s)") in message, message
        assert "  rank 1: [[0, 1]]\n" in message and message.endswith("  rank 2: [[0, 1]]")
        assert out["initialized"] is False
        kind, message, seconds = out["not_a_set"]
        assert kind == ("TypeError" if r == 1 else "ValueError"), (r, out["not_a_set"])
        assert seconds < _QUICK, (r, out["not_a_set"])
        assert ("  rank 1: [[0, 1], '5']  <- process_sets[1] must be a ProcessSet, got int"
                in message), message
        assert out["s01_id"] == 1 and out["global"] == 3.0
    assert results[0]["s01"] == results[1]["s01"] == 3.0


def _kept_across_reinit():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)

    def allreduce_over(pset, name):
        return _attempt(lambda: hvd.allreduce(torch.ones(1), op=hvd.Sum, name=name,
                                              process_set=pset))

    a, alias, a3 = hvd.ProcessSet([0, 1]), hvd.ProcessSet([0, 1]), hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[a, alias, a3])  # equal sets: one id, 1
    r = hvd.rank()
    out = {"first_ids": [p.process_set_id for p in (a, alias, a3)]}
    hvd.barrier()
    hvd.shutdown()

    # A new runtime: ids start again, and id 1 is now another set.
    b = hvd.ProcessSet([1, 2])
    hvd.init(process_sets=[b])
    out["b_id"] = b.process_set_id
    out["stale_allreduce"] = allreduce_over(a, "stale")  # every rank: b's members too
    out["stale_alias"] = allreduce_over(alias, "stale.alias")
    out["stale_size"] = _attempt(a.size)
    out["stale_rank"] = _attempt(a.rank)
    out["stale_included"] = a.included()
    out["stale_removed"] = hvd.remove_process_set(a)
    if b.included():
        out["b"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=b).item()
    hvd.add_process_set(a3)  # registered again: a fresh id, usable
    out["a3_id"] = a3.process_set_id
    if a3.included():
        out["a3"] = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum,
                                  process_set=a3).item()
    out["still_stale"] = allreduce_over(a, "stale.again")
    hvd.barrier()
    hvd.shutdown()

    # Passed to init() again, a set keeps its id, and so does every object sharing it.
    hvd.init(process_sets=[a])
    out["third_ids"] = [p.process_set_id for p in (a, alias)]
    if a.included():
        out["alias"] = _rank_sum(alias)
    out["b_stale"] = allreduce_over(b, "b.stale")
    out["a3_stale"] = _attempt(a3.size)
    return _closed(out)


def _rank_sum(pset):
    """The sum of ``rank + 1`` over ``pset``'s members, on a member."""
    import torch

    import hvdlike.torch as hvd

    return hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum,
                         process_set=pset).item()


def _closed(out):
    """``out``, once every rank got here and the job shut down."""
    import hvdlike.torch as hvd

    hvd.barrier()
    hvd.shutdown()
    return out


def test_a_set_kept_across_reinit_is_refused_until_registered_again():
    results = run_ranks(_kept_across_reinit, np=3, timeout=90,
                        env={"HVDLIKE_DYNAMIC_PROCESS_SETS": "1"})
    stale = ("ProcessSet(process_set_id=1, ranks=[0, 1], mpi_comm=None) was registered before "
             "the last init() (ids start again at every init(); process set 1 is now ranks "
             "[1, 2]): pass it to init(process_sets=[...]) or add_process_set() again")
    for r, out in enumerate(results):
        assert out["first_ids"] == [1, 1, 1] and out["b_id"] == 1
        for key in ("stale_allreduce", "stale_alias", "stale_size", "stale_rank",
                    "still_stale"):
            kind, message, _ = out[key]
            assert kind == "ValueError" and stale in message, (r, key, out[key])
        assert out["stale_included"] == (r in (0, 1))  # answers from its own ranks
        assert out["stale_removed"] is False  # id 1 is b's now: not removed
        assert out["a3_id"] == 2
        assert out["third_ids"] == [1, 1]
        kind, message, _ = out["b_stale"]
        assert kind == "ValueError" and "ranks=[1, 2]" in message, message
        assert "process set 1 is now ranks [0, 1]" in message, message
        kind, message, _ = out["a3_stale"]
        assert kind == "ValueError" and "process set 2 is not registered now" in message
    assert results[1]["b"] == results[2]["b"] == 3.0  # b survived the refused removal
    assert results[0]["a3"] == results[1]["a3"] == 3.0
    assert results[0]["alias"] == results[1]["alias"] == 3.0


def _queries_and_removal():
    import torch

    import hvdlike.torch as hvd
    from hvdlike.core.errors import NotInitializedError

    torch.set_num_threads(1)
    out = {}
    try:
        hvd.ProcessSet([0]).included()
    except NotInitializedError as exc:  # a ValueError, as Horovod's before init()
        out["before_init"] = isinstance(exc, ValueError)
    a1, a2 = hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 0])
    hvd.init(process_sets=[a1, a2])
    unregistered = hvd.ProcessSet([0, 1])
    out["unregistered"] = (unregistered.included(), unregistered.size(), unregistered.rank())
    out["ids"] = (a1.process_set_id, a2.process_set_id)
    out["removed"] = hvd.remove_process_set(a1)
    out["after"] = [(p.process_set_id, p.ranks, p.size(), p.rank(), p.included())
                    for p in (a1, a2)]
    out["use_alias"] = _attempt(lambda: hvd.allreduce(torch.ones(1), process_set=a2))
    out["remove_alias"] = hvd.remove_process_set(a2)
    hvd.add_process_set(a2)  # its ranks stayed: it can be added again
    out["readded"] = (a1.process_set_id, a2.process_set_id)
    if a2.included():
        out["a2"] = _rank_sum(a2)
    return _closed(out)


def test_removal_invalidates_every_object_sharing_the_id():
    results = run_ranks(_queries_and_removal, np=3, timeout=90,
                        env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    for r, out in enumerate(results):
        assert out["before_init"] is True
        assert out["unregistered"] == (r in (0, 1), None, None)
        assert out["ids"] == (1, 1)
        assert out["removed"] is True
        assert out["after"] == [(None, [0, 1], None, None, r in (0, 1))] * 2
        kind, message, _ = out["use_alias"]
        assert kind == "ValueError" and "is not registered" in message, out["use_alias"]
        assert out["remove_alias"] is False
        assert out["readded"] == (None, 2)
    assert results[0]["a2"] == results[1]["a2"] == 3.0
