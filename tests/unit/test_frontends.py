"""Front ends without processes: lazy framework imports and array conversions."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hvdlike.numpy.convert import NumpyAdapter, to_numpy
from tests.multiproc.harness import ROOT


def test_importing_hvdlike_does_not_import_jax_or_keras():
    # One fresh interpreter: the union of these imports must pull in no framework.
    # Then, with no KERAS_BACKEND, hvdlike.keras must explain what to set when
    # Keras falls back to a tensorflow that is not installed.
    code = ("import sys, hvdlike, hvdlike.numpy, hvdlike.torch, hvdlike.frontend\n"
            "print(' '.join(sorted(sys.modules)))\n"
            "try:\n    import hvdlike.keras\nexcept ImportError as exc:\n    print(exc)\n")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True, env=env)
    modules, _, keras_error = out.stdout.partition("\n")
    loaded = set(modules.split())
    assert "hvdlike.numpy" in loaded
    for framework in ("jax", "jaxlib", "optax", "keras", "tensorflow", "flax"):
        assert framework not in loaded, f"importing hvdlike imported {framework}"
    if keras_error.strip():
        assert "KERAS_BACKEND=torch" in keras_error


def test_numpy_arrays_cross_without_copy_when_layout_allows():
    adapter = NumpyAdapter()
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    view = base[:, ::2]                      # strided, still wrappable
    tensor = adapter.to_torch(view, "allreduce")
    assert tensor.data_ptr() == view.ctypes.data
    assert tensor.stride() == (6, 2)
    readonly = np.ones(3)
    readonly.flags.writeable = False
    assert adapter.to_torch(readonly, "allreduce").data_ptr() == readonly.ctypes.data
    reversed_ = base[::-1]                   # negative stride: copied, values kept
    np.testing.assert_array_equal(adapter.to_torch(reversed_, "allreduce").numpy(), reversed_)
    big_endian = np.arange(3, dtype=">i4")
    np.testing.assert_array_equal(adapter.to_torch(big_endian, "allgather").numpy(), [0, 1, 2])


def test_numpy_results_keep_the_dtype_and_share_memory():
    result = torch.arange(4, dtype=torch.int16)
    out = NumpyAdapter().from_torch(result, None)
    assert out.dtype == np.int16 and np.shares_memory(out, result.numpy())


def test_numpy_in_place_write_back_copies_only_when_needed():
    adapter = NumpyAdapter()
    target = np.zeros(3, dtype=np.float64)
    wrapped = adapter.to_torch(target, "allreduce_", writable=True)
    wrapped.fill_(2.0)
    assert adapter.write_back(target, wrapped) is target
    assert target.tolist() == [2.0, 2.0, 2.0]
    assert adapter.write_back(target, torch.full((3,), 5.0, dtype=torch.float64)) is target
    assert target.tolist() == [5.0, 5.0, 5.0]


def test_numpy_bfloat16_round_trip():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 numpy arrays need ml_dtypes")
    array = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    tensor = NumpyAdapter().to_torch(array, "allreduce")
    assert tensor.dtype == torch.bfloat16 and tensor.tolist() == [1.5, -2.0, 3.25]
    back = to_numpy(tensor * 2)
    assert back.dtype == array.dtype and back.astype(np.float32).tolist() == [3.0, -4.0, 6.5]


@pytest.mark.parametrize("value, fragment", [
    (np.array([object()]), "dtype object"),
    (np.array(["a"]), "dtype <U1"),
    (np.array(["2020-01-01"], dtype="datetime64[D]"), "datetime64"),
    ([1, 2], "builtins.list"),
    (torch.ones(2), "use hvdlike.torch"),
])
def test_numpy_refuses_unsupported_values_naming_them(value, fragment):
    with pytest.raises(TypeError, match="hvdlike.numpy.allreduce") as info:
        NumpyAdapter().to_torch(value, "allreduce")
    assert fragment in str(info.value)


class _FakeDevice:
    def __init__(self, platform):
        self.platform = platform

    def __repr__(self):
        return f"{self.platform}:0"


class _FakeArray:
    """Stands in for a jax.Array on an accelerator (none on this machine)."""

    def __init__(self, *platforms):
        self._devices = {_FakeDevice(p) for p in platforms}

    def is_deleted(self):
        return False

    def devices(self):
        return self._devices


def test_jax_refuses_gpu_and_sharded_arrays():
    pytest.importorskip("jax", reason="hvdlike.jax needs jax (pip install 'hvdlike[jax]')")
    from hvdlike.jax.convert import check_array

    with pytest.raises(TypeError, match=r"hvdlike.jax.allreduce: got a jax.Array on gpu.*CPU"):
        check_array(_FakeArray("gpu"), "allreduce")
    with pytest.raises(TypeError, match="sharded over 2 devices"):
        check_array(_FakeArray("cpu", "cpu"), "allgather")
    check_array(_FakeArray("cpu"), "allreduce")  # a CPU array passes


def test_jax_arrays_cross_through_dlpack_without_copy():
    pytest.importorskip("jax", reason="hvdlike.jax needs jax (pip install 'hvdlike[jax]')")
    import jax.numpy as jnp

    from hvdlike.jax.convert import JaxAdapter

    adapter = JaxAdapter()
    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    tensor = adapter.to_torch(x, "allreduce")
    assert tensor.data_ptr() == x.unsafe_buffer_pointer()
    back = adapter.from_torch(tensor * 2, x)
    assert back.dtype == jnp.float32 and back.tolist() == [[0, 2, 4], [6, 8, 10]]
    with pytest.raises(TypeError, match="hvdlike.jax.allgather expects a jax.Array"):
        adapter.to_torch("text", "allgather")


@pytest.mark.parametrize("frontend", ["hvdlike.numpy", "hvdlike.jax"])
def test_every_front_end_manages_process_sets_and_timelines(frontend):
    import importlib

    import hvdlike.torch as hvd_torch

    module = importlib.import_module(frontend)
    for name in ("add_process_set", "remove_process_set", "start_timeline", "stop_timeline"):
        assert getattr(module, name) is getattr(hvd_torch, name), name
        assert name in module.__all__
