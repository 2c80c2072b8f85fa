"""hvdlike's exceptions through JAX's wrapping, in one process.

The elastic loop's translator registry is tested without jax (a stand-in
wrapper exception); the jax side with a real host callback that raises, as a
failing collective's does (no runtime needed).
"""

import numpy as np
import pytest

from hvdlike.core.elastic import loop
from hvdlike.core.errors import HorovodInternalError, HostsUpdatedInterrupt, MismatchError


class Wrapped(RuntimeError):
    """Stands in for a framework's error type carrying an hvdlike exception."""

    def __init__(self, inner):
        super().__init__(f"wrapped: {inner}")
        self.inner = inner


def _unwrap(exc):
    return exc.inner if isinstance(exc, Wrapped) else None


@pytest.fixture
def translator():
    loop.register_translator(_unwrap)
    loop.register_translator(_unwrap)  # twice: registered once
    yield
    loop._TRANSLATORS.remove(_unwrap)
    assert _unwrap not in loop._TRANSLATORS


class FakeState:
    def __init__(self):
        self.calls = []

    def sync(self):
        self.calls.append("sync")

    def restore(self):
        self.calls.append("restore")

    def on_reset(self):
        self.calls.append("on_reset")


def _run(raises):
    """Run the loop on a function raising ``raises`` (in turn) then returning "done"."""
    state, resets, pending = FakeState(), [], list(raises)

    def train(state):
        if pending:
            raise pending.pop(0)
        return "done"

    wrapper = loop.run_fn(train, lambda: resets.append(1), is_elastic=lambda: True)
    return wrapper(state), state.calls, len(resets)


def test_a_wrapped_internal_error_restores_and_re_forms(translator):
    result, calls, resets = _run([Wrapped(HorovodInternalError("peer lost"))])
    assert (result, resets) == ("done", 1)
    assert calls == ["sync", "restore", "on_reset", "sync"]


def test_a_wrapped_hosts_update_re_forms_without_restoring(translator):
    result, calls, resets = _run([Wrapped(HostsUpdatedInterrupt(skip_sync=True))])
    assert (result, resets) == ("done", 1)
    assert calls == ["sync", "on_reset"]


def test_a_wrapped_mismatch_propagates_as_the_mismatch(translator):
    inner = MismatchError("shapes differ")
    with pytest.raises(MismatchError) as info:
        _run([Wrapped(inner)])
    assert info.value is inner and info.value.__suppress_context__


def test_other_exceptions_and_failing_translators_leave_the_error_alone(translator):
    def broken(exc):
        raise KeyError("translator bug")

    loop.register_translator(broken)
    try:
        error = ValueError("user's own")
        with pytest.raises(ValueError) as info:
            _run([error])
        assert info.value is error
        wrapped = Wrapped(ValueError("not hvdlike's"))  # carries a non-hvdlike error
        with pytest.raises(ValueError, match="not hvdlike's"):
            _run([wrapped])
    finally:
        loop._TRANSLATORS.remove(broken)


def test_without_a_translator_the_wrapper_is_not_retried():
    with pytest.raises(Wrapped):
        _run([Wrapped(HorovodInternalError("peer lost"))])


# --- the jax side ---------------------------------------------------------


@pytest.fixture(scope="module")
def jhvd():
    pytest.importorskip("jax", reason="hvdlike.jax needs jax (pip install 'hvdlike[jax]')")
    pytest.importorskip("optax", reason="hvdlike.jax needs optax (pip install 'hvdlike[jax]')")
    import hvdlike.jax as hvd

    return hvd


def _failing_step(message, kind=HorovodInternalError):
    """A jitted function whose staged 'collective' raises like a failing one."""
    import jax
    import jax.numpy as jnp

    from hvdlike.jax import ops

    def eager(xs):
        raise kind(message)

    def fn(x):
        return ops._staged(eager, [x], [jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]

    return fn, jnp.ones(2)


def test_a_jitted_collective_error_is_handed_back_once(jhvd):
    import jax

    fn, x = _failing_step("peer lost once")
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.jit(fn)(x)
    found = jhvd.original_error(info.value)
    assert isinstance(found, HorovodInternalError) and str(found) == "peer lost once"
    assert jhvd.original_error(info.value) is None  # consumed
    assert jhvd.original_error(ValueError("peer lost once")) is None


def test_hvd_jit_and_original_errors_raise_the_hvdlike_error(jhvd):
    import jax

    fn, x = _failing_step("names differ", MismatchError)
    with pytest.raises(MismatchError, match="names differ") as info:
        jhvd.jit(fn)(x)
    assert info.value.__suppress_context__
    with pytest.raises(HorovodInternalError, match="inside with"):
        with jhvd.original_errors():
            jax.jit(_failing_step("inside with")[0])(x)

    @jhvd.original_errors()
    def decorated():
        return jax.jit(_failing_step("decorated")[0])(x)

    with pytest.raises(HorovodInternalError, match="decorated"):
        decorated()


def test_hvd_jit_keeps_jax_jit_arguments_and_methods(jhvd):
    import functools

    import jax.numpy as jnp

    @functools.partial(jhvd.jit, static_argnums=1)
    def scale(x, k):
        return x * k

    class Model:
        @functools.partial(jhvd.jit, static_argnums=0)  # as jax.jit takes a method
        def double(self, x):
            return x * 2

    assert scale(jnp.ones(2), 3).tolist() == [3.0, 3.0]
    assert scale.lower(jnp.ones(2), 3) is not None  # jax.jit's own attributes
    assert Model().double(jnp.ones(1)).tolist() == [2.0]


def test_a_stale_record_is_not_attached_to_an_unrelated_jax_error(jhvd):
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    from hvdlike.jax import errors

    stale = HorovodInternalError("nobody asked for me")
    errors.record(stale)

    def users_own(x):
        raise ValueError("the user's own callback failed")

    with pytest.raises(jax.errors.JaxRuntimeError):
        with jhvd.original_errors():
            jax.jit(lambda x: io_callback(users_own, jax.ShapeDtypeStruct((2,), jnp.float32),
                                          x))(jnp.ones(2))
    assert errors.recorded() is stale
    errors.record(None)


def test_keys_and_float0_are_refused_with_what_to_do(jhvd):
    import jax

    from hvdlike.jax import ops
    from hvdlike.jax.convert import JaxAdapter

    key = jax.random.key(0)
    with pytest.raises(TypeError, match=r"hvdlike.jax.allreduce: typed PRNG key.*key_data.*"
                                        r"wrap_key_data"):
        JaxAdapter().to_torch(key, "allreduce")
    with pytest.raises(TypeError, match=r"hvdlike.jax.broadcast: typed PRNG key"):
        jax.make_jaxpr(lambda k: ops._stand_in(k, "broadcast"))(key)
    grads = jax.grad(lambda n: 0.0, allow_int=True)(np.arange(2))
    with pytest.raises(TypeError, match=r"hvdlike.jax.allreduce: float0 .* no values"):
        JaxAdapter().to_torch(grads, "allreduce")
    # numpy inputs' own refusals name this front end's function too
    with pytest.raises(TypeError, match=r"^hvdlike.jax.allgather: .*object"):
        JaxAdapter().to_torch(np.array([None, 1], dtype=object), "allgather")


def test_float0_only_pytrees_pass_through_untouched(jhvd):
    import jax

    tree = {"n": jax.grad(lambda n: 0.0, allow_int=True)(np.arange(2))}
    assert jhvd.allreduce_pytree(tree)["n"] is tree["n"]
