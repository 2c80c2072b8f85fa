"""hvdlike's exceptions out of ``jax.jit`` on 2 real ranks, and an elastic jax job
that re-forms after a peer is lost during a jitted step.

One launch runs every phase (starting jax costs more than the phases). Rank 0
plays the launcher's part for the elastic generations, as in
``test_elastic_reform.py``: it publishes them in the job's store.
"""

import secrets

import pytest

from tests.multiproc.harness import run_ranks

pytest.importorskip("jax", reason="hvdlike.jax tests need jax (pip install 'hvdlike[jax]')")
pytest.importorskip("optax", reason="hvdlike.jax tests need optax (pip install 'hvdlike[jax]')")

SECRETS = {f"w{r}": secrets.token_hex(16) for r in range(2)}
STEPS = 4
LOST_AT = 2  # the step of generation 1 during which rank 1's runtime goes away
# Gloo, not shared memory: a peer whose runtime aborts is noticed on its closed
# sockets at once, not at the shared-memory timeout.
ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
       "HVDLIKE_ELASTIC_GENERATION": "1", "HVDLIKE_ELASTIC_TIMEOUT": "60", "HVDLIKE_SHM": "0"}


def _worker_env(rank):
    return {"HVDLIKE_ELASTIC_WORKER": f"w{rank}",
            "HVDLIKE_ELASTIC_WORKER_SECRET": SECRETS[f"w{rank}"]}


def _catch(fn):
    try:
        fn()
        return ("no error", "")
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        return (type(exc).__name__, str(exc))


def _mismatches(hvd, alone):
    """Ranks disagreeing on a jitted allreduce's shape, caught three ways."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((2,) if hvd.rank() == 0 else (3,))
    out = {}
    try:
        jax.jit(lambda v: hvd.allreduce(v, name="plain"))(x)
        out["plain"] = "no error"
    except jax.errors.JaxRuntimeError as exc:
        found = hvd.original_error(exc)
        out["plain"] = (type(found).__name__, hvd.original_error(exc) is None)
    out["hvd_jit"] = _catch(lambda: hvd.jit(lambda v: hvd.allreduce(v, name="hvd_jit"))(x))

    def within():
        with hvd.original_errors():
            jax.block_until_ready(jax.jit(lambda v: hvd.allreduce(v, name="with"))(x))

    out["with"] = _catch(within)
    # rank 1 is outside the set: refused when tracing or from the callback
    out["outside"] = _catch(lambda: hvd.jit(
        lambda v: hvd.allreduce(v, name="outside", process_set=alone))(jnp.ones(2)))
    return out


def _float0_and_keys(hvd):
    """float0 gradient leaves pass the optax transformation; keys are refused clearly."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    r = hvd.rank()
    params = {"w": jnp.zeros(2), "n": jnp.arange(2)}
    tx = hvd.allreduce_gradients()

    @jax.jit
    def step(params):
        grads = jax.grad(lambda p: (p["w"] * (p["n"] + r)).sum(), allow_int=True)(params)
        return tx.update(grads, tx.init(params))[0]

    updates = step(params)
    key = jax.random.key(0)
    return {"w": np.asarray(updates["w"]).tolist(), "n": str(updates["n"].dtype),
            "key_eager": _catch(lambda: hvd.broadcast(key, root_rank=0)),
            "key_jit": _catch(lambda: jax.jit(lambda k: hvd.allreduce_pytree({"k": k}))(key))}


def _elastic(hvd, ctx, publish):
    """A jitted training step inside hvd.elastic.run; rank 1 is lost in generation 1."""
    import jax
    import jax.numpy as jnp

    from hvdlike.core import api

    history = []

    @jax.jit  # plain jax.jit: the elastic loop itself must see through JaxRuntimeError
    def step(w):
        return w + hvd.allreduce(jnp.ones(2), op=hvd.Sum, name="step")

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS:
            history.append((ctx.generation, state.step))
            if ctx.generation == 1 and state.step == LOST_AT:
                if hvd.rank() == 0:
                    publish(2)  # the launcher would, after the loss
                hvd.barrier()
                if hvd.rank() == 1:
                    api.runtime().abort("lost on purpose")
            state.w = step(state.w)
            state.step += 1
            state.commit()

    state = hvd.elastic.ObjectState(w=jnp.zeros(2), step=0)
    train(state)
    return {"history": history, "w": [float(v) for v in state.w]}


def _after_peer_shutdown(hvd):
    """A jitted step while the peer shuts down: HorovodInternalError, not JAX's error."""
    import jax.numpy as jnp

    if hvd.rank() == 1:
        hvd.shutdown()
        return ("shut down", "")
    step = hvd.jit(lambda v: hvd.allreduce(v, name="alone"))
    got = _catch(lambda: step(jnp.ones(2)))
    hvd.shutdown()
    return got


def _job(worker_secrets):
    import logging

    import hvdlike.jax as hvd
    from hvdlike.core.elastic import protocol, worker

    ctx = worker.context()

    def publish(number):
        table = {w: {"rank": r, "size": 2, "local_rank": r, "local_size": 2, "cross_rank": 0,
                     "cross_size": 1, "hostname": "localhost"} for r, w in enumerate(["w0", "w1"])}
        protocol.publish(ctx.store, protocol.Generation(number, table, removed_only=True),
                         worker_secrets)
        ctx.store.set(protocol.LATEST_KEY, str(number))

    if ctx.worker == "w0":
        publish(1)
    else:  # the launcher publishes a generation before it starts its ranks
        ctx.store.wait([protocol.LATEST_KEY])
    logged = []

    class Seen(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    logging.getLogger("jax._src.callback").addHandler(Seen())
    alone = hvd.ProcessSet([0])
    hvd.init(process_sets=[alone])
    out = {"mismatch": _mismatches(hvd, alone), "float0": _float0_and_keys(hvd)}
    out["elastic"] = _elastic(hvd, ctx, publish)
    out["logged"] = list(logged)
    out["shutdown"] = _after_peer_shutdown(hvd)
    return out


@pytest.mark.timeout(150)
def test_jit_errors_are_hvdlike_errors_and_elastic_jax_job_reforms():
    results = run_ranks(_job, np=2, args=(SECRETS,), timeout=120, env=ENV,
                        per_rank_env=_worker_env)
    for r, out in enumerate(results):
        mismatch = out["mismatch"]
        assert mismatch["plain"] == ("MismatchError", True), mismatch  # handed back once
        for way in ("hvd_jit", "with"):
            kind, message = mismatch[way]
            assert kind == "MismatchError" and "CpuCallback" not in message, mismatch
        kind, message = mismatch["outside"]
        assert (kind, r) == ("no error", 0) or (r == 1 and "CpuCallback" not in message
                                                 and kind != "JaxRuntimeError"), mismatch
        # JAX's own log of each failing callback is dropped: the caller gets the error
        assert out["logged"] == [], out["logged"]
        f0 = out["float0"]
        assert f0["w"] == [0.5, 1.5] and f0["n"] == "[('float0', 'V')]", f0
        for way in ("key_eager", "key_jit"):
            kind, message = f0[way]
            assert kind == "TypeError" and "jax.random.key_data" in message, f0
            assert "wrap_key_data" in message and "hvdlike.jax." in message, f0
        elastic = out["elastic"]
        # generation 1 loses its step LOST_AT (restored), generation 2 redoes it
        assert elastic["history"] == [(1, s) for s in range(LOST_AT + 1)] + [
            (2, s) for s in range(LOST_AT, STEPS)], elastic
        assert elastic["w"] == [2.0 * STEPS] * 2, elastic
    kind, message = results[0]["shutdown"]
    assert kind == "HvdlikeInternalError" and "shut down" in message, results[0]["shutdown"]
