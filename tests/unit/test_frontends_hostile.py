"""Careless input to the front ends, process sets and hvdlike.run, without ranks.

Each case here once gave a raw internal error, a silently wrong value or a
setting that never reached the ranks; now it is refused up front, naming what
was wrong, or handled as a Horovod user expects.
"""

import threading

import numpy as np
import pytest

from hvdlike.core.process_sets import ProcessSet
from hvdlike.launcher import api, payload
from hvdlike.launcher.errors import LaunchError
from hvdlike.numpy.convert import NumpyAdapter


def test_numpy_masked_array_is_refused_instead_of_dropping_its_mask():
    masked = np.ma.masked_array([1.0, 2.0], mask=[False, True])
    with pytest.raises(TypeError, match=r"hvdlike.numpy.allreduce: got a numpy masked array"):
        NumpyAdapter().to_torch(masked, "allreduce")
    NumpyAdapter().to_torch(masked.filled(0.0), "allreduce")  # the way out it names


def test_process_set_takes_numpy_integer_ranks_as_horovod_does():
    pset = ProcessSet(np.arange(4, -1, -2))
    assert pset.ranks == [0, 2, 4] and all(type(r) is int for r in pset.ranks)
    assert ProcessSet(r for r in (3, 1)).ranks == [1, 3]  # any iterable, read once
    for bad, shown in (([0, 1.0], "1.0 (float)"), ([True], "True (bool)"), ([-1], "-1 (int)"),
                       ([0, "1"], "'1' (str)")):
        with pytest.raises(ValueError, match="non-negative ints") as info:
            ProcessSet(bad)
        assert shown in str(info.value)


class _Store:
    """The get/set surface of the job's store, in memory, refusing big messages as it does."""

    def __init__(self, limit=8 << 20):
        self.data, self.limit = {}, limit

    def set(self, key, value):
        if len(value) > self.limit:
            raise ConnectionResetError("message too big")
        self.data[key] = bytes(value)

    def get(self, key):
        return self.data[key]


@pytest.mark.parametrize("size", [0, 10, payload.CHUNK_BYTES, payload.CHUNK_BYTES + 1,
                                  3 * payload.CHUNK_BYTES + 5])
def test_run_blobs_bigger_than_one_store_message_travel_in_pieces(size):
    store = _Store()
    blob = bytes(range(256)) * (size // 256) + bytes(size % 256)
    payload.put(store, "k", blob)
    assert payload.get(store, "k") == blob
    assert all(len(v) <= payload.CHUNK_BYTES + 64 for v in store.data.values())


def test_run_blob_pieces_that_do_not_add_up_are_refused():
    store = _Store()
    payload.put(store, "k", b"z" * (payload.CHUNK_BYTES + 1))
    store.data["k/1"] = b""
    with pytest.raises(payload.PayloadError, match="not 4194305"):
        payload.get(store, "k")
    store.data["k"] = payload.CHUNKED + b"7 3"
    with pytest.raises(payload.PayloadError, match="not a valid blob"):
        payload.get(store, "k")


def test_run_knobs_are_checked_by_name_and_booleans_turn_knobs_off():
    assert api._knob_env({"shm": False, "hierarchical_allreduce": True}) == {
        "HVDLIKE_SHM": "0", "HVDLIKE_HIERARCHICAL_ALLREDUCE": "1"}
    # In the variable's own unit: bytes for fusion_threshold, as its field says.
    assert api._knob_env({"fusion_threshold": 1024, "cycle_time": 0.5}) == {
        "HVDLIKE_FUSION_THRESHOLD": "1024", "HVDLIKE_CYCLE_TIME": "0.5"}
    with pytest.raises(LaunchError, match=r"unknown knob 'cycle_tme'; knobs are: .*cycle_time"):
        api._knob_env({"cycle_tme": 1})
    with pytest.raises(LaunchError, match=r"knobs\['cache_capacity'\] = -3 is not valid"):
        api._knob_env({"cache_capacity": -3})


def test_run_refuses_bad_arguments_before_starting_any_rank(monkeypatch):
    def no_job(*args, **kwargs):
        raise AssertionError("a job was started")

    monkeypatch.setattr(api.Job, "__enter__", no_job)
    lock = threading.Lock()
    cases = [
        (dict(np="2"), LaunchError, r"np must be an int, got '2' \(str\)"),
        (dict(np=1.5), LaunchError, r"np must be an int, got 1.5"),
        (dict(fn=5), TypeError, "fn must be callable, got int"),
        (dict(args=5), TypeError, "args must be a tuple or list"),
        (dict(kwargs=[("a", 1)]), TypeError, "kwargs must be a mapping"),
        (dict(kwargs={1: 2}), TypeError, "kwargs keys must be str"),
        (dict(env={"X": 1}), TypeError, "env must map str to str; 'X' maps to int"),
        (dict(knobs={"nope": 1}), LaunchError, "unknown knob 'nope'"),
        (dict(fn=lambda: lock), TypeError, r"hvdlike.run: fn cannot be pickled"),
        (dict(args=(1, lock)), TypeError, r"hvdlike.run: args\[1\] cannot be pickled"),
        (dict(kwargs={"x": lock}), TypeError, r"hvdlike.run: kwargs\['x'\] cannot be pickled"),
    ]
    for given, kind, pattern in cases:
        call = dict(fn=lambda *a, **k: 0, np=1)
        call.update(given)
        with pytest.raises(kind, match=pattern):
            api.run(call.pop("fn"), **call)


def test_jax_optimizer_arguments_are_checked_when_built():
    pytest.importorskip("jax", reason="hvdlike.jax needs jax (pip install 'hvdlike[jax]')")
    optax = pytest.importorskip("optax", reason="hvdlike.jax needs optax")
    from hvdlike.jax import optimizer

    sgd = optax.sgd(0.1)
    cases = [
        (dict(gradient_predivide_factor=0.0), ValueError,
         "gradient_predivide_factor must be a positive finite number, got 0.0"),
        (dict(backward_passes_per_step="2"), ValueError,
         "backward_passes_per_step must be an int >= 1, got '2'"),
        (dict(backward_passes_per_step=2.5), ValueError,
         "backward_passes_per_step must be an int >= 1, got 2.5"),
        (dict(op=2), ValueError, "op Adasum is not available in hvdlike.jax"),
        (dict(op="sum"), ValueError, "unknown reduction op 'sum'"),
    ]
    for given, kind, fragment in cases:
        with pytest.raises(kind, match="hvdlike.jax") as info:
            optimizer.DistributedOptimizer(sgd, **given)
        assert fragment in str(info.value)
    with pytest.raises(TypeError, match="expects an optax GradientTransformation"):
        optimizer.DistributedOptimizer("sgd")
    optimizer.DistributedOptimizer(sgd, backward_passes_per_step=2, gradient_predivide_factor=2)
