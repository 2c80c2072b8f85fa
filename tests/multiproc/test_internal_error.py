"""HorovodInternalError where Horovod raises it: work cut short by shutdown."""

from tests.multiproc.harness import run_ranks


def _shutdown_cuts_pending():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    # Rank 0 asks for a collective rank 1 never submits; shutdown ends it.
    orphan = hvd.allreduce_async(torch.ones(1), name="orphan") if r == 0 else None
    hvd.barrier()
    hvd.shutdown()
    if orphan is not None:
        try:
            hvd.synchronize(orphan)
        except hvd.HorovodInternalError as exc:
            out["pending"] = (type(exc).__name__, str(exc))
    try:
        hvd.allreduce(torch.ones(1))
    except ValueError as exc:  # as in Horovod: not initialized
        out["after"] = str(exc)
    return out


def test_pending_collective_fails_with_horovod_internal_error_at_shutdown():
    results = run_ranks(_shutdown_cuts_pending, np=2, timeout=90)
    kind, message = results[0]["pending"]
    assert kind == "HvdlikeInternalError" and "shut down" in message
    for out in results:
        assert "not been initialized" in out["after"]
