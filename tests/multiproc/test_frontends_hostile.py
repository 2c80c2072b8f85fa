"""Careless callers and ranks that disagree, on hvdlike.jax and hvdlike.keras, on 2 ranks.

Every case ends on every rank with an error naming what was wrong (or with
the right value); none hangs, and the ranks still communicate afterwards.
"""

import pytest

from tests.multiproc.harness import run_ranks

NP = 2
JAX_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
           "HVDLIKE_DEADLOCK_TIME_SECONDS": "20"}


def _catch(out, key, fn):
    try:
        out[key] = ("ok", fn())
    except Exception as exc:  # the test inspects the type and the message
        out[key] = (type(exc).__name__, str(exc))


def _jax_body():
    import torch

    torch.set_num_threads(1)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import hvdlike.jax as hvd

    hvd.init()
    r = hvd.rank()
    out = {}

    def plain(tree):
        return jax.tree.map(lambda v: np.asarray(v).tolist() if hasattr(v, "shape") else v, tree)

    # Bad arguments inside jit fail while tracing, with the eager call's own message.
    _catch(out, "jit_op", lambda: jax.jit(lambda x: hvd.allreduce(x, op=3.5))(jnp.ones(2)))
    _catch(out, "jit_dtype", lambda: jax.jit(hvd.allreduce)(jnp.ones(2, jnp.complex64)))
    _catch(out, "jit_root", lambda: jax.jit(lambda x: hvd.broadcast(x, 7))(jnp.ones(2)))
    _catch(out, "jit_rs0d", lambda: jax.jit(lambda x: hvd.reducescatter(x))(jnp.float32(2)))
    _catch(out, "jit_a2a", lambda: jax.jit(lambda x: hvd.alltoall(x))(jnp.ones(3)))
    # Constants next to traced values in a grouped allreduce.
    _catch(out, "jit_constants", lambda: plain(jax.jit(lambda x: hvd.grouped_allreduce(
        [x, 1.5, np.ones(2)], op=hvd.Sum))(jnp.ones(2) * (r + 1))))
    # Trees of different structures: an error on every rank, not a silent mix.
    extra = [jnp.ones(2) * r, 5 + r] + ([9] if r == 1 else [])
    _catch(out, "tree_leaves", lambda: hvd.broadcast_pytree(extra, root_rank=0))
    keys = {"a": jnp.ones(2) * r, "b": r} if r == 0 else {"x": jnp.ones(2) * r, "y": r}
    _catch(out, "tree_keys", lambda: hvd.broadcast_pytree(keys, root_rank=0))
    _catch(out, "tree_ok", lambda: plain(hvd.broadcast_pytree(
        {"a": jnp.ones(2) * r, "b": r, "c": None}, root_rank=1)))
    _catch(out, "after", lambda: plain(hvd.allreduce(jnp.ones(2), op=hvd.Sum)))
    hvd.shutdown()
    return out


def test_jax_bad_arguments_under_jit_and_mismatched_pytrees_fail_clearly():
    pytest.importorskip("jax", reason="hvdlike.jax needs jax (pip install 'hvdlike[jax]')")
    pytest.importorskip("optax", reason="hvdlike.jax needs optax (pip install 'hvdlike[jax]')")
    res = run_ranks(_jax_body, np=NP, timeout=180, env=JAX_ENV)
    for out in res:
        assert out["jit_op"] == ("ValueError", "hvdlike.jax.allreduce: unknown reduction op 3.5")
        kind, msg = out["jit_dtype"]
        assert kind == "TypeError" and msg.startswith("hvdlike.jax.allreduce: cannot handle")
        assert "complex64" in msg
        assert out["jit_root"] == ("ValueError", "hvdlike.jax.broadcast: root_rank 7 is out "
                                                 "of range for 2 rank(s)")
        assert out["jit_rs0d"] == ("ValueError", "hvdlike.jax.reducescatter needs a tensor "
                                                 "with at least one dimension")
        kind, msg = out["jit_a2a"]
        assert kind == "ValueError" and msg.startswith("hvdlike.jax.alltoall: first dimension 3")
        assert out["jit_constants"] == ("ok", [[3.0, 3.0], 3.0, [2.0, 2.0]])
        kind, msg = out["tree_leaves"]
        assert kind == "ValueError" and "pytrees of different structures" in msg
        assert "ranks [0]: PyTreeDef([*, *])" in msg and "ranks [1]: PyTreeDef([*, *, *])" in msg
        kind, msg = out["tree_keys"]
        assert kind == "ValueError" and "'a'" in msg and "'x'" in msg
        assert out["tree_ok"] == ("ok", {"a": [1.0, 1.0], "b": 1, "c": None})
        assert out["after"] == ("ok", [2.0, 2.0])


def _keras_body():
    import torch

    torch.set_num_threads(1)
    import keras
    import numpy as np

    import hvdlike.keras as hvd

    hvd.init()
    r = hvd.rank()
    out = {}

    class Custom(keras.optimizers.SGD):
        def __init__(self, special, **kwargs):  # not in get_config
            super().__init__(**kwargs)
            self.special = special

    once = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    _catch(out, "double", lambda: hvd.DistributedOptimizer(once))
    _catch(out, "custom", lambda: hvd.DistributedOptimizer(Custom(3, learning_rate=0.1)))
    _catch(out, "predivide", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                              gradient_predivide_factor=0))
    _catch(out, "op", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op="sum"))
    _catch(out, "warmup_epochs", lambda: hvd.LearningRateWarmupCallback(0.1, warmup_epochs="3"))
    _catch(out, "warmup_lr", lambda: hvd.LearningRateWarmupCallback(None))
    _catch(out, "root", lambda: hvd.BroadcastGlobalVariablesCallback("0"))
    # Horovod's Keras API reduces any tensor-compatible value: numbers and lists too.
    _catch(out, "number", lambda: float(hvd.allreduce(float(r + 1), op=hvd.Sum)))
    _catch(out, "list", lambda: keras.ops.convert_to_numpy(
        hvd.allgather([float(r)])).tolist())
    _catch(out, "grouped", lambda: [float(v) for v in hvd.grouped_allreduce([float(r), 2.0 * r])])
    # The optimizer wrapped once still trains with averaged gradients.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=once, loss="mse")
    model.fit(np.ones((4, 2), np.float32), np.full((4, 1), r + 1.0, np.float32), batch_size=4,
              epochs=1, verbose=0)
    out["weights"] = model.get_weights()[0].ravel().tolist()
    hvd.shutdown()
    return out


def test_keras_bad_optimizers_and_callback_arguments_fail_clearly():
    from importlib import metadata

    try:
        major = int(metadata.version("keras").split(".")[0])
    except metadata.PackageNotFoundError:
        major = 0
    if major < 3:
        pytest.skip("hvdlike.keras needs Keras 3 (pip install 'hvdlike[keras]')")
    res = run_ranks(_keras_body, np=NP, timeout=180, env={"KERAS_BACKEND": "torch"})
    for out in res:
        kind, msg = out["double"]
        assert kind == "ValueError" and "already averages its gradients" in msg
        kind, msg = out["custom"]
        assert kind == "TypeError" and "from_config(optimizer.get_config()) failed" in msg
        assert "special" in msg
        kind, msg = out["predivide"]
        assert kind == "ValueError" and "gradient_predivide_factor must be a positive" in msg
        kind, msg = out["op"]
        assert kind == "ValueError" and "unknown reduction op 'sum'" in msg
        kind, msg = out["warmup_epochs"]
        assert kind == "ValueError" and "warmup_epochs must be a finite number > 0" in msg
        kind, msg = out["warmup_lr"]
        assert kind == "ValueError" and "initial_lr must be a finite number" in msg
        assert out["root"] == ("TypeError", "BroadcastGlobalVariablesCallback: root_rank must "
                                            "be an int, got str")
        assert out["number"] == ("ok", 3.0)
        assert out["list"] == ("ok", [0.0, 1.0])
        assert out["grouped"] == ("ok", [0.5, 1.0])
        # Gradient of mean((w.x - y)^2) at w = 0 is -2 * y per weight; averaged over
        # y = 1 and y = 2 it is -3, so one SGD(0.1) step gives 0.3 on every rank.
        assert out["weights"] == pytest.approx([0.3, 0.3])
