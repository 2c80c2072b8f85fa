"""A rank that lies in negotiation is named at once, never answered with garbage.

Requests are checked by the coordinator against what an hvdlike rank could
have built (its own rank, a known operation and dtype, a shape and splits that
exist); the threads here stand for ranks over an in-memory control plane.
"""

import pickle

import pytest
import torch

from hvdlike.core import collectives
from hvdlike.core.controller import Controller
from hvdlike.core.coordinator import Coordinator, build_response
from hvdlike.core.errors import HvdlikeInternalError
from hvdlike.core.handles import Handle
from hvdlike.core.messages import OpType, ReduceOp, Request, malformed
from hvdlike.core.tensor_queue import Entry
from tests.unit.fake_ranks import Exchange, FakeControl, run_in_threads


def _honest_requests():
    t = torch.ones(4, 3)
    return [
        collectives.allreduce_entry(t, "a").request,
        collectives.allgather_entry(t, "g").request,
        collectives.broadcast_entry(t, 1, 2, "b").request,
        collectives.alltoall_entry(t, [1, 3], 2, "t").request,
        collectives.alltoall_entry(torch.ones(0, 2), [0, 0], 2, "t0").request,
        collectives.barrier_entry("bar").request,
        collectives.join_entry("j", "cpu").request,
        collectives.reducescatter_entry(t, "rs").request,
    ]


def test_every_request_an_honest_rank_builds_passes():
    for request in _honest_requests():
        assert malformed(request, 0, 2) == "", request


def _lie(**fields):
    request = collectives.allreduce_entry(torch.ones(4), "x").request
    clone = object.__new__(Request)
    clone.__dict__.update(request.__dict__)
    clone.__dict__.update(fields)
    return clone


@pytest.mark.parametrize("fields, said", [
    ({"rank": 0}, "in the name of rank 0 of the set (it is rank 1)"),
    ({"op": 99}, "with operation 99"),
    ({"reduce_op": "sum"}, "with reduction op 'sum'"),
    ({"dtype": "float33"}, "with dtype 'float33'"),
    ({"dtype": "Tensor"}, "with dtype 'Tensor'"),
    ({"shape": (-5, 4)}, "with shape (-5, 4)"),
    ({"shape": [4]}, "with shape [4]"),
    ({"shape": (True,)}, "with shape (True,)"),
    ({"op": OpType.ALLTOALL, "splits": (-3, 7)}, "with splits (-3, 7) for shape (4,)"),
    ({"op": OpType.ALLTOALL, "splits": (3, 10 ** 10)}, "with splits (3, 10000000000)"),
    ({"op": OpType.BROADCAST, "root": 7}, "with root rank 7 (the set has 2 ranks)"),
    ({"op": OpType.BROADCAST, "root": -1}, "with root rank -1"),
    ({"prescale": "2"}, "with scale factors '2', 1.0"),
    ({"group_size": -1}, "with group '' of -1"),
    ({"name": 5}, "a request whose name is 5"),
    ({"layout": 7}, "with a layout that is not a text of at most 1048576 characters"),
    ({"layout": "4," * (1 << 19) + "4"}, "with a layout that is not a text of at most"),
])
def test_each_impossible_field_is_named(fields, said):
    assert said in malformed(_lie(**{"rank": 1, **fields}), 1, 2)


def test_a_non_request_is_named():
    assert "a dict where a request belongs" in malformed({"name": "x"}, 0, 2)


def _entry(request):
    return Entry(request, None, None, Handle(request.name))


def _run_with_liar(lie, size=3):
    """Every rank submits ``x``; rank ``size - 1`` sends ``lie(request)`` (bytes
    or a request) in its place. Returns each rank's exception."""
    ex = Exchange(size)
    errors = [None] * size

    class LyingControl(FakeControl):
        def gather(self, payload):
            if self.rank == size - 1:
                sent = pickle.loads(payload)
                told = lie(sent[0])
                payload = told if isinstance(told, bytes) else pickle.dumps([told])
            return super().gather(payload)

    def body(rank):
        ctl = Controller(LyingControl(ex, rank), 16, ranks=[3, 5, 7][:size])
        request = collectives.allreduce_entry(torch.ones(4), "x").request.with_rank(rank)
        try:
            ctl.cycle([_entry(request)])
        except HvdlikeInternalError as exc:
            errors[rank] = exc
            # Others still in the exchange's rendezvous would wait for ever: the
            # real job's failure reaches them through the store; here, break it.
            ex.barrier.abort()
        except Exception as exc:  # noqa: BLE001 - the rendezvous broken above
            errors[rank] = exc

    run_in_threads(size, body, timeout=20)
    return errors


@pytest.mark.parametrize("lie, said", [
    (lambda r: r.with_rank(0), "in the name of rank 0 of the set (it is rank 2)"),
    (lambda r: _lie(rank=2, shape=(-1,)), "with shape (-1,)"),
    (lambda r: b"\x80\x05garbage", "its requests do not decode"),
    (lambda r: pickle.dumps({"x": r}), "a dict where a list of requests belongs"),
])
def test_the_coordinator_names_the_lying_rank_by_its_global_rank(lie, said):
    errors = _run_with_liar(lie)
    coordinator = errors[0]
    assert isinstance(coordinator, HvdlikeInternalError), errors
    assert "rank 7 sent a malformed negotiation message" in str(coordinator)
    assert said in str(coordinator)


def _req(rank, n):
    return Request(name="m", op=OpType.ALLREDUCE, dtype="float32", shape=(n,),
                   reduce_op=ReduceOp.AVERAGE, rank=rank)


def test_mismatch_errors_of_a_process_set_name_its_members_global_ranks():
    error = build_response([_req(0, 3), _req(1, 3), _req(2, 4)], 3, ranks=[1, 2, 3]).error
    assert "  rank 1: allreduce" in error and "  rank 3: allreduce float32 4" in error
    assert "rank 0" not in error
    # through the coordinator too
    c = Coordinator(3, ranks=[1, 2, 3])
    c.add([_req(0, 3), _req(1, 3), _req(2, 4)])
    (resp,) = c.ready()
    assert "  rank 3: allreduce float32 4" in resp.error
    # the global set: unchanged
    assert "  rank 2: allreduce float32 4" in build_response(
        [_req(0, 3), _req(1, 3), _req(2, 4)], 3).error
