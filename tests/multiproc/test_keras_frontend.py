"""hvdlike.keras on 2 real ranks, for each Keras backend (torch, JAX):
``model.fit`` through the example against a single-process oracle, the
callbacks' semantics, and bad input."""

import os

import numpy as np
import pytest

from tests.multiproc.harness import ROOT, run_ranks


def _keras_major() -> int:
    # Not imported here: importing keras fixes its backend for this process.
    from importlib import metadata

    try:
        return int(metadata.version("keras").split(".")[0])
    except metadata.PackageNotFoundError:
        return 0


if _keras_major() < 3:
    pytest.skip("hvdlike.keras tests need Keras 3 (pip install 'hvdlike[keras]')",
                allow_module_level=True)

NP = 2
EPOCHS = 2
BATCH = 64


def _keras_job():
    import runpy

    import keras
    import hvdlike.keras as hvd

    example = runpy.run_path(os.path.join(ROOT, "examples", "keras_fit.py"))
    out = example["train"](epochs=EPOCHS, batch=BATCH)
    rank = out["rank"]
    if rank == 0:
        # Oracle: one process, a plain optimizer, whole global batches, rank 0's start.
        (x_train, y_train), (x_test, y_test) = example["load_digits"]()
        steps = len(x_train) // BATCH
        model = example["build_model"](0)
        example["compile_model"](model, keras.optimizers.SGD(0.1, momentum=0.9))
        history = model.fit(x_train[:steps * BATCH], y_train[:steps * BATCH], batch_size=BATCH,
                            epochs=EPOCHS, shuffle=False, verbose=0)
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        out["oracle"] = {"weights": model.get_weights(), "history": history.history,
                         "accuracy": float(accuracy)}
    out["collectives"] = _collectives(hvd, keras)
    out["warmup"] = _warmup(hvd, keras)
    out["errors"] = _errors(hvd, keras)
    out["elastic"] = _elastic_state(hvd, keras)
    hvd.shutdown()
    return out


def _collectives(hvd, keras):
    """The module-level collectives on backend tensors, numpy arrays and variables."""
    r = hvd.rank()
    x = keras.ops.convert_to_tensor(np.full((2,), r + 1.0, "float32"))
    total = hvd.allreduce(x, op=hvd.Sum)
    variable = keras.Variable(np.full((3,), float(r), "float32"))
    hvd.broadcast_variables([variable], root_rank=1)
    return {
        "sum": keras.ops.convert_to_numpy(total),
        "kind": type(total).__module__.split(".")[0],
        "numpy": hvd.allreduce(np.array([r], "float64")),
        "gather": keras.ops.convert_to_numpy(hvd.allgather(x)),
        "bcast": keras.ops.convert_to_numpy(hvd.broadcast(x, root_rank=1)),
        "variable": keras.ops.convert_to_numpy(variable.value),
        "objects": hvd.allgather_object(r),
    }


def _warmup(hvd, keras):
    """Record the learning rate and momentum each batch sees under warmup."""
    seen = []

    class Recorder(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            opt = self.model.optimizer
            seen.append([float(keras.ops.convert_to_numpy(opt.learning_rate)), opt.momentum])

        def on_train_batch_end(self, batch, logs=None):
            seen[-1].append(self.model.optimizer.momentum)

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)),
                  loss="mse")
    x = np.random.default_rng(hvd.rank()).standard_normal((8, 3)).astype("float32")
    model.fit(x, x[:, :2], batch_size=2, epochs=3, shuffle=False, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.LearningRateWarmupCallback(0.2, warmup_epochs=2), Recorder()])
    final_lr = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    return {"seen": seen, "final_lr": final_lr}


def _elastic_state(hvd, keras):
    """KerasState: sync gives every rank rank 0's weights, optimizer variables and
    attributes (a rank that never stepped builds its slots); restore() goes back."""
    r = hvd.rank()
    keras.utils.set_random_seed(r)  # different models on purpose
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(optimizer=optimizer, loss="mse")
    if r == 0:  # only rank 0 has stepped: momentum slots and an iteration count
        model.train_on_batch(np.ones((4, 3)), np.zeros((4, 2)))
    state = hvd.elastic.KerasState(model, optimizer, epoch=10 + r)

    def now():
        return ([w.tolist() for w in model.get_weights()],
                [keras.ops.convert_to_numpy(v).tolist() for v in optimizer.variables],
                state.epoch)

    synced = hvd.elastic.run(lambda state: now())(state)  # not elastic: syncs once, runs
    state.commit()
    model.set_weights([w + 1.0 for w in model.get_weights()])
    model.train_on_batch(np.ones((4, 3)), np.zeros((4, 2)))  # moves slots and iterations too
    state.epoch = 99
    state.restore()
    return synced, now()


def _errors(hvd, keras):
    errors = {}

    def catch(key, fn):
        try:
            fn()
            errors[key] = ("no error", "")
        except Exception as exc:
            errors[key] = (type(exc).__name__, str(exc))

    catch("not_optimizer", lambda: hvd.DistributedOptimizer("sgd"))
    catch("op", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.ReduceOp.MAX))
    catch("object", lambda: hvd.allreduce(np.array([None], dtype=object)))
    return errors


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_keras_fit_two_ranks_matches_single_process(backend):
    if backend == "jax":
        pytest.importorskip("jax", reason="the Keras JAX backend needs jax")
    env = {"KERAS_BACKEND": backend, "JAX_PLATFORMS": "cpu"}
    res = run_ranks(_keras_job, np=NP, timeout=240, env=env)
    oracle = res[0]["oracle"]
    for out in res:
        # Tolerance: float32 gradients summed per rank then averaged, over
        # 2 epochs x 21 momentum steps, stay within 1e-4 of the one-process
        # weights; epoch losses (averaged over ranks by MetricAverageCallback)
        # within 1e-4 relative; test accuracy within one of the 397 digits.
        for got, want in zip(out["weights"], oracle["weights"]):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(out["history"]["loss"], oracle["history"]["loss"], rtol=1e-4)
        np.testing.assert_allclose(out["history"]["accuracy"], oracle["history"]["accuracy"],
                                   atol=1.0 / 1344 + 1e-7)
        assert abs(out["accuracy"] - oracle["accuracy"]) <= 1.0 / 397 + 1e-7
    assert oracle["accuracy"] > 0.85
    _check_warmup([out["warmup"] for out in res])
    first, second = (out["elastic"] for out in res)
    assert first[0] == second[0]  # rank 0's weights, optimizer variables and epoch everywhere
    assert first[0][2] == 10 and len(first[0][1]) > 1
    assert first[1] == first[0] and second[1] == second[0]  # restore() went back to the commit
    for out in res:
        got = out["collectives"]
        np.testing.assert_array_equal(got["sum"], [3.0, 3.0])
        assert got["kind"] == ("torch" if backend == "torch" else "jaxlib")
        np.testing.assert_array_equal(got["numpy"], [0.5])
        assert got["numpy"].dtype == np.float64
        np.testing.assert_array_equal(got["gather"], [1.0, 1.0, 2.0, 2.0])
        np.testing.assert_array_equal(got["bcast"], [2.0, 2.0])
        np.testing.assert_array_equal(got["variable"], [1.0, 1.0, 1.0])
        assert got["objects"] == [0, 1]
    for out in res:
        errors = out["errors"]
        kind, msg = errors["not_optimizer"]
        assert kind == "TypeError" and "hvdlike.keras.DistributedOptimizer" in msg
        assert "builtins.str" in msg
        kind, msg = errors["op"]
        assert kind == "ValueError" and "Average or Sum" in msg
        kind, msg = errors["object"]
        assert kind == "TypeError" and "hvdlike.numpy" in msg and "object" in msg


def _check_warmup(per_rank):
    # Horovod's schedule with size 2, 4 batches per epoch, 2 warmup epochs:
    # lr = 0.2 / 2 * (e * (2 - 1) / 2 + 1) with e = epoch + (batch + 1) / 4.
    expected = []
    for epoch in range(3):
        for batch in range(4):
            e = epoch + (batch + 1) / 4
            expected.append(0.1 * (e / 2 + 1) if epoch < 2 else 0.2)
    for warm in per_rank:
        seen = warm["seen"]
        assert len(seen) == 12
        np.testing.assert_allclose([s[0] for s in seen], expected, rtol=1e-6)
        previous = 0.05  # the optimizer's own rate before warmup
        for (lr, momentum, after), want in zip(seen, expected):
            if abs(want - previous) > 1e-12:
                # Momentum corrected by new_lr / old_lr for that batch only.
                assert momentum == pytest.approx(0.9 * want / previous, rel=1e-5)
            else:
                assert momentum == pytest.approx(0.9)
            assert after == pytest.approx(0.9)
            previous = want
        # The rate set by the callback is the one the trainer ended with.
        assert warm["final_lr"] == pytest.approx(0.2, rel=1e-6)

