"""Small allreduces whose input travels with the fast cycle's vote (shared memory).

Once a name repeats, its cycles are agreed by the one-word vote of the learned
order; a small dense CPU allreduce then sends its input along with that vote
and is reduced from there (``Executor.offer``). These tests run the same
repeated allreduces with the vote carrying data and without, and require the
two results to be identical bit for bit, equal to a local oracle, and the
path under test to have actually run -- or, where ranks disagree, not to.
"""

import time

import pytest
import torch

from tests.multiproc.harness import run_ranks

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "bool"]
# int16 is reduced in int32 and bool as bytes: those never ride on the vote.
CARRIED = {"float16", "bfloat16", "float32", "float64", "int8", "int32", "int64", "uint8"}
OPS = ["Sum", "Average", "Min", "Max", "Product"]
SIZES = [1, 7, 1027]
ROUNDS = 5  # the same name this many times: the last ones run on fast cycles
SCALES = {"float32": (0.5, 3.0), "int64": (2.0, 0.25), "float64": (1.0, 1.0 / 3.0)}


def _value(rank, dtype, n, salt):
    gen = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    if dtype == "bool":
        return torch.rand(n, generator=gen) > 0.5
    if dtype.startswith("float") or dtype == "bfloat16":
        return torch.randn(n, generator=gen).to(getattr(torch, dtype))
    return torch.randint(1, 4, (n,), generator=gen, dtype=torch.int64).to(getattr(torch, dtype))


def _oracle(values, op, dtype, pre=1.0, post=1.0):
    if dtype == "bool":
        stack = torch.stack(values)
        return stack.any(0) if op in ("Sum", "Average", "Max") else stack.all(0)
    integer = not (dtype.startswith("float") or dtype == "bfloat16")
    parts = [v.to(torch.float64) * pre for v in values]
    if integer:
        parts = [torch.trunc(p) for p in parts]
    stack = torch.stack(parts)
    out = {"Sum": lambda: stack.sum(0), "Average": lambda: stack.sum(0) / len(values),
           "Min": lambda: stack.min(0).values, "Max": lambda: stack.max(0).values,
           "Product": lambda: stack.prod(0)}[op]() * post
    return torch.trunc(out) if integer else out


def _repeated_allreduces(lie_on=None):
    """Every op x dtype x size, each name ROUNDS times, voted and then not."""
    import hvdlike.torch as hvd
    from hvdlike.core import api

    hvd.init()
    r = hvd.rank()
    ctl = api.runtime().process_sets[0].controller
    out = {"control": type(ctl.control).__name__}
    offer = ctl.speculate
    if r == lie_on:
        # This rank offers one element more than it has: its peers must notice
        # (the offered sizes differ) and every rank takes the two-exchange path.
        def lying(response, entry, capacity):
            made = offer(response, entry, capacity)
            if made is None:
                return made
            dtype, count, write = made

            def padded(view):
                write(view[:count])
                view[count:].zero_()

            return dtype, count + 1, padded

        ctl.speculate = lying
    for voted in (True, False):
        if not voted:
            ctl.speculate = None  # on every rank alike
        before = ctl.voted_allreduces
        for dtype in DTYPES:
            for size in SIZES:
                for op in OPS:
                    pre, post = SCALES.get(dtype, (1.0, 1.0)) if op == "Sum" else (1.0, 1.0)
                    for k in range(ROUNDS):
                        out[(voted, dtype, size, op, k)] = hvd.allreduce(
                            _value(r, dtype, size, k), op=getattr(hvd, op),
                            name=f"v.{dtype}.{size}.{op}", prescale_factor=pre,
                            postscale_factor=post)
        out[("voted", voted)] = ctl.voted_allreduces - before
    hvd.shutdown()
    return out


def _check(results, n):
    for res in results:
        assert res["control"] == "ShmControlPlane", res["control"]
    for dtype in DTYPES:
        tol = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-5}.get(dtype, 1e-12)
        for size in SIZES:
            for op in OPS:
                pre, post = SCALES.get(dtype, (1.0, 1.0)) if op == "Sum" else (1.0, 1.0)
                for k in range(ROUNDS):
                    want = _oracle([_value(r, dtype, size, k) for r in range(n)], op, dtype,
                                   pre, post)
                    first = results[0][(True, dtype, size, op, k)]
                    for res in results:
                        got = res[(True, dtype, size, op, k)]
                        plain = res[(False, dtype, size, op, k)]
                        assert got.dtype == getattr(torch, dtype) and got.shape == (size,)
                        # Same operations on the same values: identical, on every rank.
                        assert torch.equal(got, plain), (dtype, size, op, k)
                        assert torch.equal(got, first), (dtype, size, op, k)
                        assert torch.allclose(got.to(torch.float64), want.to(torch.float64),
                                              rtol=tol, atol=tol), (dtype, size, op, k, got, want)


@pytest.mark.parametrize("np", [2, 3])
def test_voted_allreduces_equal_the_two_exchange_path_and_the_oracle(np):
    results = run_ranks(_repeated_allreduces, np=np, timeout=240)
    _check(results, np)
    cases = len(CARRIED) * len(SIZES) * len(OPS)
    for res in results:
        # A name's first round is negotiated, its second and third run from the
        # cache while the order is learned; from the fourth on the vote carries it.
        assert res[("voted", True)] >= cases * (ROUNDS - 3), res[("voted", True)]
        assert res[("voted", False)] == 0


def test_a_rank_offering_a_different_size_gets_the_two_exchange_path_everywhere():
    results = run_ranks(_repeated_allreduces, np=2, args=(1,), timeout=240)
    _check(results, 2)
    for res in results:
        assert res[("voted", True)] == 0 and res[("voted", False)] == 0


def _out_of_step():
    """Rank 1 submits late: rank 0's offers meet a vote of 0 and are dropped."""
    import hvdlike.torch as hvd
    from hvdlike.core import api

    hvd.init()
    r = hvd.rank()
    ctl = api.runtime().process_sets[0].controller
    got = []
    for k in range(8):
        if r == 1 and k % 2:
            time.sleep(0.05)
        got.append(hvd.allreduce(torch.full((5,), float(k + r)), op=hvd.Sum, name="late"))
    fast = ctl.fast_cycles
    voted = ctl.voted_allreduces
    hvd.shutdown()
    return got, fast, voted


def test_offers_a_peer_is_not_ready_for_are_dropped_and_results_stay_right():
    results = run_ranks(_out_of_step, np=2, timeout=120)
    for got, fast, voted in results:
        assert [g.tolist() for g in got] == [[float(2 * k + 1)] * 5 for k in range(8)]
        assert fast > 0
    assert len({voted for _, _, voted in results}) == 1  # every rank decides alike


def _in_a_process_set():
    """A subset's own cycles carry its small allreduces, beside the global set's."""
    import hvdlike.torch as hvd
    from hvdlike.core import api

    evens = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[evens])
    r = hvd.rank()
    got, voted = [], {}
    for k in range(8):
        if r in (0, 2):
            got.append(hvd.allreduce(torch.full((9,), float(r + k)), op=hvd.Average,
                                     name="ev", process_set=evens))
        got.append(hvd.allreduce(torch.full((3,), float(r * k)), op=hvd.Sum, name="all"))
    for set_id, state in api.runtime().process_sets.items():
        voted[set_id] = state.controller.voted_allreduces
    hvd.shutdown()
    return got, voted, evens.process_set_id


def test_a_process_set_votes_with_its_own_data():
    results = run_ranks(_in_a_process_set, np=3, timeout=120)
    for r, (got, voted, evens) in enumerate(results):
        want = []
        for k in range(8):
            if r in (0, 2):
                want.append([float(1 + k)] * 9)  # (k + (2 + k)) / 2
            want.append([float(3 * k)] * 3)  # 0 + k + 2k
        assert [g.tolist() for g in got] == want, r
        assert voted[0] > 0, voted
        if r in (0, 2):
            assert voted[evens] > 0, voted
