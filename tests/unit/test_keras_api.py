"""hvdlike.keras's API against horovod.tensorflow.keras, in one process of one rank.

Keras fixes its backend on first import, so the checks run in one child
process (torch backend) that reports back as JSON; each test reads its part.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.multiproc.harness import ROOT
from tests.multiproc.test_keras_frontend import _keras_major

if _keras_major() < 3:
    pytest.skip("hvdlike.keras tests need Keras 3 (pip install 'hvdlike[keras]')",
                allow_module_level=True)

CHILD = textwrap.dedent(r'''
    import inspect, json, os, sys, tempfile
    import numpy as np
    import keras
    import hvdlike.keras as hvd

    hvd.init()
    out = {}

    def error(fn):
        try:
            fn()
            return ["no error", ""]
        except Exception as exc:
            return [type(exc).__name__, str(exc)]

    def params(fn):
        sig = inspect.signature(fn)
        return [[p.name, p.kind.name, repr(p.default)] for p in sig.parameters.values()]

    out["params"] = {
        "allreduce": params(hvd.allreduce),
        "reducescatter": params(hvd.reducescatter),
        "DistributedOptimizer": params(hvd.DistributedOptimizer),
        "load_model": params(hvd.load_model),
        "PartialDistributedOptimizer": params(hvd.PartialDistributedOptimizer),
        "MetricAverageCallback": params(hvd.callbacks.MetricAverageCallback),
        "BroadcastGlobalVariablesCallback": params(hvd.callbacks.BroadcastGlobalVariablesCallback),
        "LearningRateScheduleCallback": params(hvd.callbacks.LearningRateScheduleCallback),
        "BestModelCheckpoint": params(hvd.callbacks.BestModelCheckpoint),
    }
    out["names"] = {n: hasattr(hvd, n) for n in (
        "Compression", "Average", "Sum", "Adasum", "Min", "Max", "Product", "start_timeline",
        "stop_timeline", "add_process_set", "remove_process_set", "load_model", "reducescatter",
        "is_initialized", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
        "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
        "cross_rank", "cross_size", "ProcessSet", "global_process_set",
        "broadcast_global_variables")}
    out["ops"] = [int(hvd.Average), int(hvd.Sum), int(hvd.Adasum), int(hvd.Min), int(hvd.Max),
                  int(hvd.Product)]
    out["compression"] = [hvd.Compression.none.__name__, hvd.Compression.fp16.__name__]
    out["positional_callbacks"] = [
        type(hvd.callbacks.MetricAverageCallback("")).__name__,
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, "").root_rank]

    sgd = keras.optimizers.SGD
    out["errors"] = {
        "average_and_op": error(lambda: hvd.allreduce(1.0, average=True, op=hvd.Sum)),
        "dict": error(lambda: hvd.allreduce({"a": 1})),
        "numpy_object": error(lambda: hvd.allreduce(np.array([None], dtype=object))),
        "passes": error(lambda: hvd.DistributedOptimizer(sgd(), backward_passes_per_step=0)),
        "groups": error(lambda: hvd.DistributedOptimizer(sgd(), groups="x")),
        "passes_and_keras_accumulation": error(lambda: hvd.DistributedOptimizer(
            sgd(gradient_accumulation_steps=2), backward_passes_per_step=2)),
        "compression": error(lambda: hvd.DistributedOptimizer(sgd(), compression="fp16")),
        "global_variables": error(lambda: hvd.broadcast_global_variables(0)),
        "initial_lr": error(lambda: hvd.callbacks.LearningRateScheduleCallback(None, 0.5)),
    }
    # Horovod's positional order for DistributedOptimizer.
    opt = hvd.DistributedOptimizer(sgd(0.1), "opt", "", "", hvd.Compression.fp16, False, 1.0,
                                   hvd.Average, 3, True, 0, None, hvd.global_process_set)
    out["positional_optimizer"] = [opt.gradient_accumulation_steps,
                                   opt._hvd_settings["compression"].__name__,
                                   opt._hvd_settings["postscale"]]

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])

    # Mixed precision: wrapped here, so compile keeps it; wrapped by Keras after
    # the fact: refused, naming the remedy.
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    m = model()
    opt = hvd.DistributedOptimizer(sgd(0.1))
    m.compile(optimizer=opt, loss="mse")
    explicit = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
        sgd(0.1), initial_scale=64.0))
    out["mixed"] = [m.optimizer is opt,
                    isinstance(opt, keras.optimizers.LossScaleOptimizer),
                    isinstance(explicit, keras.optimizers.LossScaleOptimizer),
                    explicit.initial_scale]
    keras.mixed_precision.set_dtype_policy("float32")
    late = hvd.DistributedOptimizer(sgd(0.1))
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    out["errors"]["late_policy"] = error(lambda: model().compile(optimizer=late, loss="mse"))
    out["errors"]["outer_loss_scale"] = error(
        lambda: keras.optimizers.LossScaleOptimizer(hvd.DistributedOptimizer(sgd(0.1))))
    keras.mixed_precision.set_dtype_policy("float32")
    out["errors"]["wrap_twice"] = error(lambda: hvd.DistributedOptimizer(explicit))

    # LearningRateScheduleCallback: 3 epochs of 2 batches.
    def schedule(**kwargs):
        seen = []

        class Recorder(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                o = self.model.optimizer
                seen.append([float(keras.ops.convert_to_numpy(o.learning_rate)), o.momentum])

        m = model()
        m.compile(optimizer=hvd.DistributedOptimizer(sgd(0.1, momentum=0.5)), loss="mse")
        history = m.fit(np.ones((4, 3)), np.zeros((4, 2)), batch_size=2, epochs=3,
                        shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.LearningRateScheduleCallback(**kwargs),
                                   Recorder()])
        return {"seen": seen, "logged": history.history["learning_rate"],
                "momentum": m.optimizer.momentum}

    out["schedule"] = {
        "staircase": schedule(initial_lr=0.2, multiplier=0.5, start_epoch=1),
        "smooth": schedule(initial_lr=0.2, multiplier=lambda e: 1.0 + e, end_epoch=2,
                           staircase=False, momentum_correction=False),
    }

    tmp = tempfile.mkdtemp()
    # BestModelCheckpoint: no path -> error at fit; with one, saves the best.
    m = model()
    m.compile(optimizer=hvd.DistributedOptimizer(sgd(0.1)), loss="mse")
    fit = lambda cb: m.fit(np.ones((4, 3)), np.zeros((4, 2)), validation_split=0.5, epochs=2,
                           verbose=0, callbacks=[cb])
    out["errors"]["checkpoint_no_path"] = error(lambda: fit(hvd.callbacks.BestModelCheckpoint()))
    best = hvd.callbacks.BestModelCheckpoint(monitor="val_loss")
    best.filepath = os.path.join(tmp, "best.keras")
    fit(best)
    out["checkpoint"] = [best.save_best_only, os.path.exists(best.filepath)]

    # load_model: the optimizer comes back distributed, with its state.
    m = model()
    m.compile(optimizer=sgd(0.1, momentum=0.9), loss="mse")
    m.fit(np.ones((4, 3)), np.zeros((4, 2)), batch_size=2, verbose=0)
    path = os.path.join(tmp, "model.keras")
    m.save(path)
    loaded = hvd.load_model(path, compression=hvd.Compression.fp16)
    values = lambda o: [np.asarray(keras.ops.convert_to_numpy(v)).tolist() for v in o.variables]
    out["load_model"] = {
        "distributed": type(loaded.optimizer).__mro__[1].__name__,
        "compression": loaded.optimizer._hvd_settings["compression"].__name__,
        "same_state": values(loaded.optimizer) == values(m.optimizer),
        "iterations": int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)),
    }
    loaded.fit(np.ones((4, 3)), np.zeros((4, 2)), batch_size=2, verbose=0)
    out["load_model"]["after_fit"] = int(keras.ops.convert_to_numpy(
        loaded.optimizer.iterations))
    hvd.shutdown()
    print("RESULT" + json.dumps(out))
''')


@pytest.fixture(scope="module")
def child():
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key in [k for k in env if k.startswith(("HVDLIKE_", "HOROVOD_"))]:
        del env[key]
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=150)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT"):])


def _names(params):
    return [p[0] for p in params]


@pytest.mark.timeout(180)
def test_signatures_follow_horovod(child):
    params = child["params"]
    assert _names(params["allreduce"]) == [
        "value", "name", "average", "prescale_factor", "postscale_factor", "op", "compression",
        "process_set"]
    assert _names(params["reducescatter"])[:3] == ["value", "name", "op"]
    assert _names(params["DistributedOptimizer"])[:13] == [
        "optimizer", "name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
        "gradient_predivide_factor", "op", "backward_passes_per_step",
        "average_aggregated_gradients", "num_groups", "groups", "process_set"]
    assert _names(params["load_model"]) == [
        "filepath", "custom_optimizers", "custom_objects", "compression", "legacy_opts"]
    assert _names(params["PartialDistributedOptimizer"]) == [
        "optimizer", "name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
        "gradient_predivide_factor", "op", "backward_passes_per_step",
        "average_aggregated_gradients", "groups", "process_set", "scale_local_gradients",
        "local_layers"]
    assert params["MetricAverageCallback"][0][0] == "device"
    assert _names(params["BroadcastGlobalVariablesCallback"])[:3] == [
        "root_rank", "device", "local_variables"]
    for cb in ("MetricAverageCallback", "BroadcastGlobalVariablesCallback"):
        kinds = {p[0]: p[1] for p in params[cb]}
        assert kinds["process_set"] == "KEYWORD_ONLY"
    assert _names(params["LearningRateScheduleCallback"]) == [
        "initial_lr", "multiplier", "start_epoch", "end_epoch", "staircase",
        "momentum_correction", "steps_per_epoch"]
    assert _names(params["BestModelCheckpoint"])[:5] == [
        "monitor", "verbose", "save_weights_only", "mode", "save_freq"]
    assert child["positional_callbacks"] == ["MetricAverageCallback", 0]
    assert child["positional_optimizer"] == [3, "FP16Compressor", 1.0]


def test_horovod_names_exist(child):
    assert all(child["names"].values()), [n for n, ok in child["names"].items() if not ok]
    assert child["ops"] == [0, 1, 2, 3, 4, 5]
    assert child["compression"] == ["NoneCompressor", "FP16Compressor"]


def test_bad_input_is_named(child):
    errors = child["errors"]
    kind, msg = errors["average_and_op"]
    assert kind == "ValueError" and "hvdlike.keras.allreduce" in msg and "not both" in msg
    kind, msg = errors["dict"]
    assert kind == "TypeError" and "hvdlike.keras.allreduce" in msg and "dict" in msg
    kind, msg = errors["numpy_object"]
    assert kind == "TypeError" and msg.startswith("hvdlike.keras.allreduce: hvdlike.numpy")
    kind, msg = errors["passes"]
    assert kind == "ValueError" and "backward_passes_per_step" in msg
    kind, msg = errors["groups"]
    assert kind == "ValueError" and "groups" in msg
    kind, msg = errors["passes_and_keras_accumulation"]
    assert kind == "ValueError" and "gradient_accumulation_steps" in msg
    kind, msg = errors["compression"]
    assert kind == "TypeError" and "compression" in msg
    assert errors["global_variables"][0] == "RuntimeError"
    assert "broadcast_variables" in errors["global_variables"][1]
    assert errors["initial_lr"][0] == "ValueError"
    assert errors["checkpoint_no_path"][0] == "ValueError"
    assert "filepath" in errors["checkpoint_no_path"][1]
    assert errors["wrap_twice"][0] == "ValueError"


def test_mixed_precision_loss_scaling_is_distributed(child):
    assert child["mixed"] == [True, True, True, 64.0]
    for key in ("late_policy", "outer_loss_scale"):
        kind, msg = child["errors"][key]
        assert kind == "ValueError", (key, kind, msg)
        assert "LossScaleOptimizer" in msg and "set_dtype_policy('mixed_float16') before" in msg


def test_learning_rate_schedule_callback(child):
    stair = child["schedule"]["staircase"]
    # Epoch 0 is before start_epoch: the optimizer's own 0.1. From epoch 1 on,
    # 0.2 * 0.5 ** (epoch - 1), set at the first batch of each epoch.
    assert [round(s[0], 6) for s in stair["seen"]] == [0.1, 0.1, 0.2, 0.2, 0.1, 0.1]
    # Momentum corrected by new / old for the batch that sets the rate only.
    assert [round(s[1], 6) for s in stair["seen"]] == [0.5, 0.5, 1.0, 0.5, 0.25, 0.5]
    assert stair["momentum"] == 0.5
    assert [round(v, 6) for v in stair["logged"]] == [0.1, 0.2, 0.1]
    smooth = child["schedule"]["smooth"]
    # Every batch of epochs 0 and 1: 0.2 * (1 + epoch + batch / 2); then left alone.
    assert [round(s[0], 6) for s in smooth["seen"]] == [0.2, 0.3, 0.4, 0.5, 0.5, 0.5]
    assert [s[1] for s in smooth["seen"]] == [0.5] * 6


def test_best_model_checkpoint_and_load_model(child):
    assert child["checkpoint"] == [True, True]
    loaded = child["load_model"]
    assert loaded["distributed"] == "_DistributedMixin"
    assert loaded["compression"] == "FP16Compressor"
    assert loaded["same_state"] and loaded["iterations"] == 2
    assert loaded["after_fit"] == 4
