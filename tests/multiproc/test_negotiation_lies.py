"""A rank that lies in negotiation: every honest rank fails at once, naming it.

The liar is an hvdlike rank patched to write what no hvdlike rank writes (the
job's secret does not make a process honest). Before these checks an
impossible length in shared memory kept every rank spinning for ever, and a
request sent in another rank's name left the job waiting without a word.
"""

from tests.multiproc.harness import run_ranks


def _lying_length(length):
    import struct

    import torch

    import hvdlike.torch as hvd
    from hvdlike.core import shm_control

    torch.set_num_threads(1)
    hvd.init()
    real = shm_control._LENGTH

    class Lying:
        size = real.size
        unpack_from = staticmethod(real.unpack_from)

        @staticmethod
        def pack_into(mm, offset, value):
            real.pack_into(mm, offset, length if hvd.rank() == 1 else value)

    assert isinstance(real, struct.Struct)
    shm_control._LENGTH = Lying
    try:
        hvd.allreduce(torch.ones(8), name="x")  # a new name: the full negotiation
        return "no error"
    except hvd.HorovodInternalError as exc:
        return str(exc)


def test_an_impossible_message_length_in_shared_memory_is_named_not_spun_on():
    for length, said in ((2 ** 62, "a message length of 4611686018427387904 bytes"),
                         (-7, "a message length of -7 bytes")):
        codes, outputs = run_ranks(_lying_length, np=2, args=(length,), timeout=60,
                                   expect_failure=True)
        assert "rank 1 wrote a malformed negotiation message into shared memory" in \
            outputs[0], outputs[0][-2000:]
        assert said in outputs[0]


def _rank_1_lies(suffix, lie, collective):
    """Rank 1 sends ``lie(request)`` instead of its request for a name ending
    in ``suffix``; every rank then runs ``collective(hvd)`` and returns what it
    raised (its type and text)."""
    import torch

    import hvdlike.torch as hvd
    from hvdlike.core import controller

    torch.set_num_threads(1)
    hvd.init()
    miss = controller.Controller._miss

    def lying_miss(self, entry):
        miss(self, entry)
        if hvd.rank() == 1 and entry.request.name.endswith(suffix):
            self._to_send[-1] = lie(self._to_send[-1])

    controller.Controller._miss = lying_miss
    try:
        collective(hvd)
        return "no error"
    except hvd.HorovodInternalError as exc:
        return f"{type(exc).__name__}: {exc}"


def _replaced(**fields):
    return lambda sent: type(sent)(**{**sent.__dict__, **fields})


def _request_in_another_ranks_name():
    import torch
    return _rank_1_lies(".x", lambda sent: sent.with_rank(0), lambda hvd: hvd.allreduce(
        torch.ones(8) * (hvd.rank() + 1), op=hvd.Sum, name="x"))


def test_a_request_in_another_ranks_name_is_refused_on_every_plane():
    for env in ({}, {"HVDLIKE_SHM": "0"}):
        codes, outputs = run_ranks(_request_in_another_ranks_name, np=2, timeout=60,
                                   expect_failure=True, env=env)
        assert ("rank 1 sent a malformed negotiation message: request 'allreduce.x' in the "
                "name of rank 0 of the set (it is rank 1)") in outputs[0], outputs[0][-2000:]


def _renamed_requests():
    import torch
    return _rank_1_lies(".x", _replaced(name="allreduce.x-renamed"),
                        lambda hvd: hvd.allreduce(torch.ones(8), name="x"))


def test_requests_renamed_behind_the_ranks_own_record_are_reported_as_a_stall():
    # The liar's own record says it waits on 'allreduce.x' (so does rank 0's):
    # only what the coordinator received shows the name nobody else submitted.
    results = run_ranks(_renamed_requests, np=2, timeout=60,
                        env={"HVDLIKE_STALL_CHECK_TIME_SECONDS": "1",
                             "HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS": "2"})
    for said in results:
        assert said.startswith("StallError") and "shutting down every rank" in said, said
        assert "'allreduce.x-renamed': waited" in said, said
        assert "missing rank(s) 0 (" in said
        assert "requested by rank(s) 1, which report no wait on that name" in said


def _allgather_of_a_trillion_rows():
    import torch
    return _rank_1_lies(".g", _replaced(shape=(10 ** 12, 4)),
                        lambda hvd: hvd.allgather(torch.ones(2, 4), name="g"))


def test_an_allgather_too_large_to_hold_names_the_rank_that_claimed_it():
    for said in run_ranks(_allgather_of_a_trillion_rows, np=2, timeout=60):
        assert "allgather 'allgather.g': no room here for 2 x 1,000,000,000,000 rows of " \
               "shape [4] (torch.float32); rank 1 asked to send the most, " \
               "1,000,000,000,000 rows" in said, said
