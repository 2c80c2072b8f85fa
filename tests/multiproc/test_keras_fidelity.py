"""hvdlike.keras against Horovod's semantics on 2 real ranks, per Keras backend.

One launch per backend checks: ``allreduce``'s Horovod signature (the third
positional argument is ``average``), float64 numpy scalars keeping their
dtype, ``broadcast_variables`` refusing different variables on every rank
(rather than leaving one rank waiting), mixed precision where only one
rank's batch overflows (both ranks must skip that step together), and
``backward_passes_per_step`` against a one-process oracle."""

import numpy as np
import pytest

from tests.multiproc.harness import run_ranks
from tests.multiproc.test_keras_frontend import _keras_major

if _keras_major() < 3:
    pytest.skip("hvdlike.keras tests need Keras 3 (pip install 'hvdlike[keras]')",
                allow_module_level=True)

NP = 2
OVERFLOW_BATCH = 1  # the batch in which rank 1's inputs overflow float16


def _fidelity_job():
    import keras
    import hvdlike.keras as hvd

    hvd.init()
    out = {"rank": hvd.rank()}
    out["allreduce"] = _allreduce_forms(hvd, keras)
    out["mismatch"] = _broadcast_mismatch(hvd, keras)
    out["mixed"] = _mixed_precision(hvd, keras)
    out["passes"] = _accumulation(hvd, keras)
    hvd.shutdown()
    return out


def _allreduce_forms(hvd, keras):
    r = hvd.rank()
    x = np.array([r + 1.0, 2.0 * (r + 1)], "float32")

    def value(t):
        return np.asarray(keras.ops.convert_to_numpy(t)).tolist()

    nearly_one = np.float32(1 + 2.0 ** -12)  # float16 rounds it to 1
    f64 = hvd.allreduce(np.float64(r + 0.25))
    return {
        "positional_true": value(hvd.allreduce(x, "fid.b", True)),
        "positional_false": value(hvd.allreduce(x, "fid.c", False)),
        "average_kw": value(hvd.allreduce(x, average=False, prescale_factor=2.0,
                                          postscale_factor=0.5)),
        "fp16": value(hvd.allreduce(np.array([nearly_one]), op=hvd.Sum,
                                    compression=hvd.Compression.fp16)),
        "none": value(hvd.allreduce(np.array([nearly_one]), op=hvd.Sum)),
        "variable": value(hvd.allreduce(keras.Variable(x), op=hvd.Sum)),
        "float64": (float(f64), str(np.asarray(f64).dtype)),
        "reducescatter": value(hvd.reducescatter(np.arange(4.0, dtype="float32") * (r + 1),
                                                 op=hvd.Sum)),
    }


def _broadcast_mismatch(hvd, keras):
    """Rank 1 passes one more variable: both ranks must raise, neither may wait."""
    variables = [keras.Variable(np.zeros(2, "float32")) for _ in range(1 + hvd.rank())]
    try:
        hvd.broadcast_variables(variables, root_rank=0)
        return ("no error", "")
    except Exception as exc:
        return (type(exc).__name__, str(exc))


def _tiny_model(keras, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def _mixed_precision(hvd, keras):
    """mixed_float16 with the default usage; rank 1's second batch overflows float16."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model = _tiny_model(keras)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                      loss="mse")
        x = np.full((8, 3), 0.01 * (1 + hvd.rank()), "float32")
        if hvd.rank() == 1:
            x[2 * OVERFLOW_BATCH:2 * OVERFLOW_BATCH + 2] = 6e4
        seen = []

        class Recorder(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if hasattr(self.model, "jax_state_sync"):
                    self.model.jax_state_sync()
                opt = self.model.optimizer
                seen.append((float(keras.ops.convert_to_numpy(opt.dynamic_scale)),
                             int(keras.ops.convert_to_numpy(opt.iterations))))

        model.fit(x, np.zeros((8, 2), "float32"), batch_size=2, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Recorder()])
        return {"seen": seen, "weights": [w.astype("float64").tolist()
                                          for w in model.get_weights()]}
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def _accumulation(hvd, keras):
    """backward_passes_per_step=2: local sums, one reduction per 2 steps."""
    import hvdlike.keras.optimizer as hopt

    calls = []
    reduce = hopt.grouped_allreduce

    def counting(values, **kwargs):
        calls.append(1)
        return reduce(values, **kwargs)

    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((8, 3)).astype("float32")
    y = rng.standard_normal((8, 2)).astype("float32")
    results = {}
    hopt.grouped_allreduce = counting
    try:
        for average in (False, True):
            model = _tiny_model(keras)
            model.compile(optimizer=hvd.DistributedOptimizer(
                keras.optimizers.SGD(0.05), backward_passes_per_step=2,
                average_aggregated_gradients=average), loss="mse")
            model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
            results[average] = [w.tolist() for w in model.get_weights()]
    finally:
        hopt.grouped_allreduce = reduce
    data = hvd.allgather_object((x, y))
    oracle = {}
    if hvd.rank() == 0:
        # Global batch i is both ranks' batch i; Keras's accumulation averages
        # its 2 micro-batches, so the summed form is lr * 2.
        gx = np.concatenate([np.concatenate([d[0][2 * i:2 * i + 2] for d in data])
                             for i in range(4)])
        gy = np.concatenate([np.concatenate([d[1][2 * i:2 * i + 2] for d in data])
                             for i in range(4)])
        for average, lr in ((False, 0.1), (True, 0.05)):
            model = _tiny_model(keras)
            model.compile(optimizer=keras.optimizers.SGD(lr, gradient_accumulation_steps=2),
                          loss="mse")
            model.fit(gx, gy, batch_size=4, shuffle=False, verbose=0)
            oracle[average] = [w.tolist() for w in model.get_weights()]
    return {"weights": results, "oracle": oracle, "calls": len(calls)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_keras_fidelity_two_ranks(backend):
    if backend == "jax":
        pytest.importorskip("jax", reason="the Keras JAX backend needs jax")
    env = {"KERAS_BACKEND": backend, "JAX_PLATFORMS": "cpu"}
    res = run_ranks(_fidelity_job, np=NP, timeout=180, env=env)
    _check_allreduce([out["allreduce"] for out in res])
    for out in res:
        kind, msg = out["mismatch"]
        assert kind == "ValueError", out["mismatch"]
        assert "hvdlike.keras.broadcast_variables" in msg and "rank 1: 2 variables" in msg
    _check_mixed([out["mixed"] for out in res])
    _check_accumulation([out["passes"] for out in res], backend)


def _check_allreduce(per_rank):
    for rank, got in enumerate(per_rank):
        assert got["positional_true"] == [1.5, 3.0]  # average=True: mean of 1,2 and 2,4
        assert got["positional_false"] == [3.0, 6.0]  # average=False: sum
        assert got["average_kw"] == [3.0, 6.0]  # sum of (x * 2), times 0.5
        assert got["fp16"] == [2.0] and got["none"] == [2 + 2.0 ** -11]
        assert got["variable"] == [3.0, 6.0]
        assert got["float64"] == (0.75, "float64")
        assert got["reducescatter"] == ([0.0, 3.0] if rank == 0 else [6.0, 9.0])


def _check_mixed(per_rank):
    first, second = per_rank
    # The overflow on rank 1 makes both ranks skip that step (the iteration
    # count stands still, the scale halves) and then go on together.
    assert first["seen"] == second["seen"]
    scales = [s for s, _ in first["seen"]]
    steps = [i for _, i in first["seen"]]
    assert steps == [1, 1, 2, 3]
    assert scales[OVERFLOW_BATCH] == scales[0] / 2
    assert first["weights"] == second["weights"]
    assert np.isfinite(np.concatenate([np.ravel(w) for w in first["weights"]])).all()


def _check_accumulation(per_rank, backend):
    oracle = per_rank[0]["oracle"]
    for got in per_rank:
        for average in (False, True):
            for w, want in zip(got["weights"][average], oracle[average]):
                np.testing.assert_allclose(w, want, atol=1e-6, rtol=0)
        if backend == "torch":  # eager: one reduction per update, 2 updates per fit
            assert got["calls"] == 4
    assert per_rank[0]["weights"] == per_rank[1]["weights"]
