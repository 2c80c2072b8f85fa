"""The JAX and Keras front ends against Horovod's semantics, on real ranks.

One JAX launch (3 ranks, a process set of ranks 0 and 2) checks that the
reducing pytree calls refuse trees of different structures on every rank --
eagerly, inside ``jax.jit`` and through the optax transformation -- while
comparing a given structure only once; and that jitted collectives refuse a
rank outside their process set, and a bad name, at trace with the eager
message. One Keras launch per backend (2 ranks) checks the optimizer's edge
cases (empty ``apply``, float8 scale variables, local variables), mixed
``grouped_allreduce`` lists, the elastic callbacks, ``load_model``'s
``legacy_opts`` and hvdlike's errors out of ``model.fit``.
"""

import numpy as np
import pytest

from tests.multiproc.harness import run_ranks
from tests.multiproc.test_keras_frontend import _keras_major

JAX_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}


def _catch(fn):
    try:
        fn()
        return ["no error", ""]
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        return [type(exc).__name__, str(exc)]


# -- JAX ------------------------------------------------------------------------------


def _jax_job():
    import torch

    torch.set_num_threads(1)
    import jax
    import jax.numpy as jnp
    import optax
    import hvdlike.jax as hvd
    import hvdlike.numpy as hnp
    from hvdlike.jax import pytree

    pair = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[pair])
    r = hvd.rank()
    out = {"rank": r}

    compared = []
    real_compare = getattr(pytree, "_compare", None)

    def counting(mine, name, process_set, what):
        compared.append(what)
        return real_compare(mine, name, process_set, what)

    if real_compare is not None:
        pytree._compare = counting

    # Same leaf shapes, other keys on ranks 1 and 2: paired by position, it would "work".
    odd = ({"a": jnp.ones(2), "b": jnp.ones(2)} if r == 0
           else {"x": jnp.ones(2), "y": jnp.ones(2)})
    out["eager_mismatch"] = _catch(lambda: hvd.allreduce_pytree(odd, op=hvd.Sum))
    out["jit_mismatch"] = _catch(lambda: jax.block_until_ready(
        hvd.jit(lambda t: hvd.allreduce_pytree(t, name="jit_tree"))(odd)))
    tx = hvd.DistributedOptimizer(optax.sgd(1.0))
    out["optax_mismatch"] = _catch(lambda: jax.block_until_ready(
        hvd.jit(lambda t: tx.update(t, tx.init(t))[0])(odd)))
    nested = ({"layer": [jnp.ones(2), jnp.ones(2)]} if r == 0
              else {"layer": (jnp.ones(2), jnp.ones(2))})
    out["list_vs_tuple"] = _catch(lambda: hvd.allreduce_pytree(nested))

    # The same structure everywhere: reduced, and compared once however often it runs.
    compared.clear()
    tree = {"w": jnp.full(2, float(r)), "b": jnp.asarray(float(r))}
    sums = [hvd.allreduce_pytree(tree, op=hvd.Sum) for _ in range(3)]
    step = jax.jit(lambda t: hvd.allreduce_pytree(t, name="steady", op=hvd.Sum))
    sums += [step(tree) for _ in range(3)]
    sgd = hvd.DistributedOptimizer(optax.sgd(1.0))
    update = jax.jit(lambda g: sgd.update(g, sgd.init(g))[0])
    updates = [update(tree) for _ in range(3)]
    out["sums"] = [float(s["w"][0]) for s in sums] + [float(s["b"]) for s in sums]
    out["updates"] = [float(u["w"][0]) for u in updates]
    out["compared"] = list(compared)

    # Argument errors at trace, with the eager message.
    out["leaf_str"] = _catch(lambda: hvd.allreduce_pytree({"s": "str", "w": jnp.ones(2)}))
    out["jit_name"] = _catch(lambda: jax.jit(lambda x: hvd.allreduce(x, name=3))(jnp.ones(2)))
    out["bcast_object_root"] = _catch(lambda: hnp.broadcast_object(1, root_rank=5))
    out["jax_bcast_object_root"] = _catch(lambda: hvd.broadcast_object(1, root_rank=5))
    if r == 1:  # not in `pair`: every jitted collective on it is refused while tracing
        calls = {
            "allreduce": lambda x: hvd.allreduce(x, process_set=pair),
            "broadcast": lambda x: hvd.broadcast(x, 0, process_set=pair),
            "allgather": lambda x: hvd.allgather(x, process_set=pair),
            "reducescatter": lambda x: hvd.reducescatter(x, process_set=pair),
        }
        out["outside"] = {what: _catch(lambda: jax.jit(f).lower(jnp.ones(2)))
                          for what, f in calls.items()}
    hvd.barrier()
    hvd.shutdown()
    return out


@pytest.mark.timeout(200)
def test_jax_structures_and_trace_time_errors():
    pytest.importorskip("jax", reason="hvdlike.jax tests need jax (pip install 'hvdlike[jax]')")
    pytest.importorskip("optax", reason="hvdlike.jax tests need optax")
    results = run_ranks(_jax_job, np=3, timeout=180, env=JAX_ENV)
    _all_hold(_JAX_CHECKS, results)


def _check_structure_mismatches(res, results):
    for key, what in (("eager_mismatch", "allreduce_pytree"),
                      ("jit_mismatch", "allreduce_pytree"),
                      ("optax_mismatch", "allreduce_gradients"),
                      ("list_vs_tuple", "allreduce_pytree")):
        kind, message = res[key]
        assert kind == "ValueError", (key, res[key])
        assert message.startswith(f"hvdlike.jax.{what}: ranks hold pytrees of different "
                                  f"structures"), (key, message)
    message = res["eager_mismatch"][1]
    assert "'a'" in message and "'x'" in message and "ranks [1, 2]" in message, message


def _check_agreed_once(res, results):
    # Sum of ranks 0 + 1 + 2, six times; the average of the same, three times.
    assert res["sums"] == [3.0] * 12, res["sums"]
    assert res["updates"] == [-1.0] * 3, res["updates"]
    # One comparison per structure: the tree once for all 9 calls, eager, jitted and
    # through the optax transformation.
    assert res["compared"] == ["allreduce_pytree"], res["compared"]


def _check_jax_messages(res, results):
    assert res["leaf_str"][0] == "TypeError", res["leaf_str"]
    assert res["leaf_str"][1].startswith("hvdlike.jax.allreduce_pytree: leaf ['s'] is a "
                                         "builtins.str"), res["leaf_str"]
    assert res["jit_name"] == ["TypeError", "hvdlike.jax.allreduce: name must be a str, "
                                            "got int"], res["jit_name"]
    assert res["bcast_object_root"] == [
        "ValueError", "hvdlike.numpy.broadcast_object: root_rank 5 is out of range for 3 "
                      "rank(s)"], res["bcast_object_root"]
    assert res["jax_bcast_object_root"][1].startswith("hvdlike.jax.broadcast_object: "), \
        res["jax_bcast_object_root"]


def _check_outside_at_trace(res, results):
    if res["rank"] != 1:
        return
    for what, (kind, message) in res["outside"].items():
        assert kind == "ValueError", (what, kind, message[:200])
        assert message.startswith(f"hvdlike.jax.{what}: rank 1 is not a member of process "
                                  f"set"), (what, message[:200])


_JAX_CHECKS = {
    "structure_mismatches": _check_structure_mismatches,
    "agreed_once": _check_agreed_once,
    "jax_messages": _check_jax_messages,
    "outside_at_trace": _check_outside_at_trace,
}


# -- Keras ----------------------------------------------------------------------------


def _keras_job(save_dir):
    import os

    import torch

    torch.set_num_threads(1)
    import keras
    import hvdlike.keras as hvd

    hvd.init()
    out = {"rank": hvd.rank(), "backend": keras.backend.backend()}
    sections = {
        "empty_apply": lambda: _catch(lambda: hvd.DistributedOptimizer(
            keras.optimizers.SGD(0.1)).apply([], [])),
        "overwrite_only": lambda: _overwrite_only(hvd, keras),
        "float8": lambda: _float8(hvd, keras),
        "grouped_mixed": lambda: _grouped_mixed(hvd, keras),
        "local": lambda: _local_variables(hvd, keras),
        "callback_local": lambda: _callback_local(hvd, keras),
        "elastic": lambda: _elastic_callbacks(hvd, keras),
        "messages": lambda: {
            "reducescatter_max": _catch(lambda: hvd.reducescatter(keras.ops.ones(4),
                                                                  op=hvd.Max)),
            "allreduce_op7": _catch(lambda: hvd.allreduce(keras.ops.ones(4), op=7))},
        "legacy_opts": lambda: _legacy_opts(hvd, keras,
                                            os.path.join(save_dir, f"m{hvd.rank()}.keras")),
        "fit_error": lambda: _fit_error(hvd, keras),
    }
    for key, section in sections.items():
        out[key] = _section(section)
    hvd.shutdown()
    return out


def _section(fn):
    """``fn()``, or the exception it raised: every part of a job reports on its own."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"raised": [type(exc).__name__, str(exc)[:300]]}


def _numpy(keras, value):
    return np.asarray(keras.ops.convert_to_numpy(value), np.float64).tolist()


def _overwrite_only(hvd, keras):
    """Only variables Keras overwrites with their "gradient": none left for the hook."""
    v = keras.Variable(np.zeros(2, "float32"))
    v.overwrite_with_gradient = True  # as float8 layers mark their scales
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    g = keras.ops.convert_to_tensor(np.array([hvd.rank() + 1.0, -hvd.rank()], "float32"))
    result = _catch(lambda: opt.apply([g], [v]))
    return {"result": result, "value": _numpy(keras, v.value)}


def _float8(hvd, keras):
    """Ranks see inputs of different magnitude: scales and histories must agree."""
    r = hvd.rank()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.layers[0].quantize("float8")
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x = np.ones((2, 4), np.float32) * (r + 1) * 3
    y = np.zeros((2, 2), np.float32)
    model.fit(x, y, batch_size=2, epochs=3, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return {v.path: _numpy(keras, v.value) for v in model.variables}


def _grouped_mixed(hvd, keras):
    def describe(values):
        return [["numpy" if isinstance(v, (np.ndarray, np.generic)) else
                 "backend" if keras.ops.is_tensor(v) else type(v).__name__, _numpy(keras, v)]
                for v in values]

    r = hvd.rank()
    out = {}
    for label, values in (
            ("numpy_then_tensor", [np.full(2, r + 1.0), keras.ops.ones(2) * (r + 1)]),
            ("tensor_then_numpy", [keras.ops.ones(2) * (r + 1), np.full(2, r + 1.0)]),
            ("scalar_and_float", [np.float32(r + 1), float(r + 1)])):
        try:
            out[label] = describe(hvd.grouped_allreduce(values, op=hvd.Sum))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[label] = [type(exc).__name__, str(exc)]
    out["alone"] = describe([hvd.allreduce(np.full(2, r + 1.0), op=hvd.Sum),
                             hvd.allreduce(keras.ops.ones(2) * (r + 1), op=hvd.Sum),
                             hvd.allreduce(np.float32(r + 1), op=hvd.Sum),
                             hvd.allreduce(float(r + 1), op=hvd.Sum)])
    return out


def _local_variables(hvd, keras):
    """SGD(1): a variable moves by minus its gradient, reduced or kept local."""
    r = hvd.rank()
    out = {}

    def grad(shape):
        return keras.ops.convert_to_tensor(np.full(shape, 2.0 * (r + 1), "float32"))

    for label, scale in (("scaled", True), ("unscaled", False)):
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, name="shared"),
                                  keras.layers.Dense(1, name="mine")])
        for v in model.trainable_variables:
            v.assign(np.zeros(v.shape, "float32"))
        opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0),
                                              local_layers=[model.layers[1]],
                                              scale_local_gradients=scale)
        opt.apply([grad(v.shape) for v in model.trainable_variables], model.trainable_variables)
        out[label] = {v.path: float(np.ravel(_numpy(keras, v.value))[0])
                      for v in model.trainable_variables}
    a = keras.Variable(np.zeros(1, "float32"))
    b = keras.Variable(np.zeros(1, "float32"))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    opt.register_local_var(b)
    opt.apply([grad(1), grad(1)], [a, b])
    out["registered"] = [_numpy(keras, a.value)[0], _numpy(keras, b.value)[0]]
    out["bad_layer"] = _catch(lambda: hvd.PartialDistributedOptimizer(
        keras.optimizers.SGD(1.0), local_layers=["dense"]))
    return out


def _callback_local(hvd, keras):
    r = hvd.rank()
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    kernel, bias = model.layers[0].kernel, model.layers[0].bias
    kernel.assign(np.full((1, 1), r + 1.0, "float32"))
    bias.assign(np.full(1, r + 1.0, "float32"))
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    callback.register_local_var(bias)
    model.fit(np.ones((2, 1), "float32"), np.ones((2, 1), "float32"), epochs=1, verbose=0,
              callbacks=[callback])
    return [_numpy(keras, kernel.value)[0][0], _numpy(keras, bias.value)[0]]


def _elastic_callbacks(hvd, keras):
    commits = []

    class Counting(hvd.elastic.KerasState):
        def commit(self):
            commits.append(int(self.batch))
            super().commit()

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    state = Counting(model, epoch=2, batch=0)
    batches = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append(int(state.batch))

    x = np.arange(24, dtype="float32").reshape(8, 3) / 24
    y = np.ones((8, 1), "float32")
    model.fit(x, y, batch_size=2, epochs=2, verbose=0, shuffle=False, callbacks=[
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=3),
        Seen()])
    trained = [_numpy(keras, w) for w in model.weights]
    for w in model.weights:  # scribble; restore() must bring back the last commit
        w.assign(np.zeros(w.shape, "float32"))
    state.restore()
    return {"commits": commits, "batches": batches, "epoch": int(state.epoch),
            "batch": int(state.batch),
            "restored_is_trained": [_numpy(keras, w) for w in model.weights] == trained,
            "bad_count": _catch(lambda: hvd.elastic.CommitStateCallback(state, 0))}


def _legacy_opts(hvd, keras, path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(np.ones((2, 2), "float32"), np.ones((2, 1), "float32"), verbose=0)
    model.save(path)
    loaded = hvd.load_model(path, legacy_opts=True)
    return [type(loaded.optimizer).__name__, loaded.optimizer.__class__.__mro__[1].__name__]


def _fit_error(hvd, keras):
    """Ranks build different models: fit's gradient allreduce fails with hvdlike's error,
    inside ``original_errors`` and, with one of hvdlike's callbacks, without it."""
    r = hvd.rank()

    def model():
        built = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1 + r)])
        built.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss="mse")
        return built

    x, y = np.ones((2, 3), "float32"), np.ones((2, 1 + r), "float32")
    within, with_callback = model(), model()

    def fit_within():
        with hvd.original_errors():
            within.fit(x, y, verbose=0)

    return [_catch(fit_within)[0], _catch(lambda: with_callback.fit(
        x, y, verbose=0, callbacks=[hvd.callbacks.MetricAverageCallback()]))[0]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_keras_optimizer_callbacks_and_errors(backend, tmp_path):
    if _keras_major() < 3:
        pytest.skip("hvdlike.keras tests need Keras 3 (pip install 'hvdlike[keras]')")
    if backend == "jax":
        pytest.importorskip("jax", reason="the Keras JAX backend needs jax")
    env = dict(JAX_ENV, KERAS_BACKEND=backend)
    results = run_ranks(_keras_job, np=2, args=(str(tmp_path),), timeout=280, env=env)
    assert [res["backend"] for res in results] == [backend, backend]
    _all_hold(_KERAS_CHECKS, results)


def _all_hold(checks, results):
    """Run every check on every rank's results; fail listing all that did not hold."""
    failed = {}
    for res in results:
        for name, check in checks.items():
            try:
                check(res, results)
            except AssertionError as exc:
                failed.setdefault(name, f"rank {res['rank']}: {exc}"[:600])
    assert not failed, "\n".join(f"{name}: {why}" for name, why in failed.items())


def _check_empty_apply(res, results):
    assert res["empty_apply"] == ["no error", ""], res["empty_apply"]


def _check_overwrite_only(res, results):
    # No gradient left for the hook (no false error); the value is the Max over ranks.
    assert res["overwrite_only"] == {"result": ["no error", ""], "value": [2.0, 0.0]}, \
        res["overwrite_only"]


def _check_float8(res, results):
    float8 = res["float8"]
    assert float8 == results[0]["float8"], (float8, results[0]["float8"])
    history = [v for k, v in float8.items() if k.endswith("/inputs_amax_history")][0]
    assert max(history) == 6.0, history  # the global batch's amax (rank 1's inputs)


def _check_grouped_mixed(res, results):
    mixed = res["grouped_mixed"]
    assert mixed["numpy_then_tensor"] == [["numpy", [3.0, 3.0]], ["backend", [3.0, 3.0]]], mixed
    assert mixed["tensor_then_numpy"] == [["backend", [3.0, 3.0]], ["numpy", [3.0, 3.0]]], mixed
    assert mixed["scalar_and_float"] == [["numpy", 3.0], ["backend", 3.0]], mixed
    # ... the types each value gets alone
    assert [kind for kind, _ in mixed["alone"]] == ["numpy", "backend", "numpy", "backend"]


def _check_local(res, results):
    own = 2.0 * (res["rank"] + 1)
    local = res["local"]
    assert "raised" not in local, local
    for label, factor in (("scaled", 0.5), ("unscaled", 1.0)):
        moved = local[label]
        shared = [v for k, v in moved.items() if "/shared/" in k]
        mine = [v for k, v in moved.items() if "/mine/" in k]
        assert shared == [-3.0, -3.0], (label, moved)  # minus the average of 2 and 4
        assert mine == [-own * factor] * 2, (label, moved)
    assert local["registered"] == [-3.0, -own * 0.5], local
    assert local["bad_layer"][0] == "TypeError", local
    assert "local_layers must be keras layers" in local["bad_layer"][1], local


def _check_callback_local(res, results):
    assert res["callback_local"] == [1.0, res["rank"] + 1.0], res["callback_local"]


def _check_elastic(res, results):
    elastic = res["elastic"]
    assert "raised" not in elastic, elastic
    # 4 batches per epoch, a commit after every 3rd batch and at each epoch's end
    # (UpdateBatchStateCallback, listed first, has set batch back to 0 at epoch end).
    assert elastic["commits"] == [2, 0, 1, 0], elastic
    assert elastic["batches"] == [0, 1, 2, 3, 0, 1, 2, 3], elastic
    assert elastic["epoch"] == 4 and elastic["batch"] == 0, elastic
    assert elastic["restored_is_trained"], elastic
    assert elastic["bad_count"][0] == "ValueError", elastic


def _check_messages(res, results):
    messages = res["messages"]
    assert messages["reducescatter_max"][0] == "UnsupportedOpError", messages
    assert messages["reducescatter_max"][1].startswith("hvdlike.keras.reducescatter: "), messages
    kind, message = messages["allreduce_op7"]
    assert kind == "ValueError", messages
    assert message.startswith("hvdlike.keras.allreduce: "), messages
    assert message.endswith("unknown reduction op 7"), messages
    assert "allreduce: allreduce:" not in message, messages


def _check_legacy_opts(res, results):
    assert res["legacy_opts"] == ["SGD", "_DistributedMixin"], res["legacy_opts"]


def _check_fit_error(res, results):
    assert res["fit_error"] == ["MismatchError", "MismatchError"], res["fit_error"]


_KERAS_CHECKS = {
    "empty_apply": _check_empty_apply, "overwrite_only": _check_overwrite_only,
    "float8": _check_float8, "grouped_mixed": _check_grouped_mixed, "local": _check_local,
    "callback_local": _check_callback_local, "elastic": _check_elastic,
    "messages": _check_messages, "legacy_opts": _check_legacy_opts,
    "fit_error": _check_fit_error,
}
