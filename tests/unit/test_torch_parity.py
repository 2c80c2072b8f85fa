"""Every public name of horovod.torch 0.28.1 exists in hvdlike.torch with a compatible signature.

The table below is written from Horovod's documented signatures. A hvdlike
signature is compatible when every Horovod parameter appears at the same
position with the same name and, where Horovod has a default, the same
default; hvdlike may add trailing keyword parameters with defaults, and may
give a default to a parameter Horovod requires (calls valid for Horovod stay
valid). Deliberate differences are listed in docs/parity.md.
"""

import importlib
import inspect

import pytest

import hvdlike.torch as hvd
from hvdlike.core.process_sets import global_process_set

REQUIRED = inspect.Parameter.empty
GPS = "global_process_set"
NONE_C = "Compression.none"
AVG = "Average"

# name -> list of (parameter, default); REQUIRED marks a parameter without default.
ALLREDUCE = [("tensor", REQUIRED), ("average", None), ("name", None), ("op", None),
             ("prescale_factor", 1.0), ("postscale_factor", 1.0), ("process_set", GPS)]
GROUPED_ALLREDUCE = [("tensors", REQUIRED)] + ALLREDUCE[1:]
WITH_COMPRESSION = ALLREDUCE[:3] + [("compression", NONE_C)] + ALLREDUCE[3:]
BROADCAST = [("tensor", REQUIRED), ("root_rank", REQUIRED), ("name", None), ("process_set", GPS)]
ALLGATHER = [("tensor", REQUIRED), ("name", None), ("process_set", GPS)]
ALLTOALL = [("tensor", REQUIRED), ("splits", None), ("name", None), ("process_set", GPS)]
RS_ASYNC = [("tensor", REQUIRED), ("name", None), ("op", AVG), ("process_set", GPS),
            ("prescale_factor", 1.0), ("postscale_factor", 1.0)]
RS = RS_ASYNC[:2] + [("compression", NONE_C)] + RS_ASYNC[2:]

SIGNATURES = {
    "allreduce": WITH_COMPRESSION,
    "allreduce_async": ALLREDUCE,
    "allreduce_": ALLREDUCE,
    "allreduce_async_": ALLREDUCE,
    "grouped_allreduce": [("tensors", REQUIRED)] + WITH_COMPRESSION[1:],
    "grouped_allreduce_async": GROUPED_ALLREDUCE,
    "grouped_allreduce_": GROUPED_ALLREDUCE,
    "grouped_allreduce_async_": GROUPED_ALLREDUCE,
    "sparse_allreduce_async": [("tensor", REQUIRED), ("name", REQUIRED), ("op", REQUIRED),
                               ("process_set", GPS)],
    "allgather": ALLGATHER,
    "allgather_async": ALLGATHER,
    "grouped_allgather": [("tensors", REQUIRED)] + ALLGATHER[1:],
    "grouped_allgather_async": [("tensors", REQUIRED)] + ALLGATHER[1:],
    "broadcast": BROADCAST,
    "broadcast_": BROADCAST,
    "broadcast_async": BROADCAST,
    "broadcast_async_": BROADCAST,
    "alltoall": ALLTOALL,
    "alltoall_async": ALLTOALL,
    "reducescatter": RS,
    "reducescatter_async": RS_ASYNC,
    "grouped_reducescatter": [("tensors", REQUIRED)] + RS[1:],
    "grouped_reducescatter_async": [("tensors", REQUIRED)] + RS_ASYNC[1:],
    "barrier": [("process_set", GPS)],
    "join": [("device", -1)],
    "poll": [("handle", REQUIRED)],
    "synchronize": [("handle", REQUIRED)],
    "broadcast_object": [("obj", REQUIRED), ("root_rank", 0), ("name", None),
                         ("process_set", GPS)],
    "allgather_object": [("obj", REQUIRED), ("name", None), ("process_set", GPS)],
    "broadcast_parameters": [("params", REQUIRED), ("root_rank", REQUIRED),
                             ("process_set", GPS)],
    # Horovod's third parameter is model (to find sparse embeddings); process_set is ours.
    "broadcast_optimizer_state": [("optimizer", REQUIRED), ("root_rank", REQUIRED),
                                  ("model", None), ("process_set", GPS)],
    "DistributedOptimizer": [("optimizer", REQUIRED), ("named_parameters", None),
                             ("compression", NONE_C), ("backward_passes_per_step", 1),
                             ("op", AVG), ("gradient_predivide_factor", 1.0),
                             ("num_groups", 0), ("groups", None), ("sparse_as_dense", False),
                             ("process_set", GPS)],
    "SyncBatchNorm": [("num_features", REQUIRED), ("eps", 1e-5), ("momentum", 0.1),
                      ("affine", True), ("track_running_stats", True)],
    "ProcessSet": [("ranks_or_comm", REQUIRED)],
    "add_process_set": [("process_set", REQUIRED)],
    "remove_process_set": [("process_set", REQUIRED)],
    "init": [("comm", None), ("process_sets", None)],
    "start_timeline": [("file_path", REQUIRED), ("mark_cycles", False)],
    "stop_timeline": [],
    "check_extension": [("ext_name", REQUIRED), ("ext_env_var", REQUIRED),
                        ("pkg_path", REQUIRED), ("*args", REQUIRED)],
}
NO_ARGS = ["shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "ccl_built", "cuda_built", "ddl_built", "gloo_built",
           "gloo_enabled", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
           "rocm_built"]
for _name in NO_ARGS:
    SIGNATURES[_name] = []

# Every public name of horovod.torch listed in the parity issue.
HOROVOD_NAMES = (
    "Adasum Average Sum Min Max Product Compression DistributedOptimizer HorovodInternalError "
    "ProcessSet SyncBatchNorm add_process_set remove_process_set global_process_set allgather "
    "allgather_async allgather_object allreduce allreduce_ allreduce_async allreduce_async_ "
    "alltoall alltoall_async barrier broadcast broadcast_ broadcast_async broadcast_async_ "
    "broadcast_object broadcast_optimizer_state broadcast_parameters grouped_allgather "
    "grouped_allgather_async grouped_allreduce grouped_allreduce_ grouped_allreduce_async "
    "grouped_allreduce_async_ grouped_reducescatter grouped_reducescatter_async reducescatter "
    "reducescatter_async sparse_allreduce_async join poll synchronize init shutdown "
    "is_initialized rank size local_rank local_size cross_rank cross_size start_timeline "
    "stop_timeline ccl_built cuda_built ddl_built gloo_built gloo_enabled mpi_built mpi_enabled "
    "mpi_threads_supported nccl_built rocm_built check_extension"
).split()

# Reduction constants carry Horovod's integer values.
OP_VALUES = {"Average": 0, "Sum": 1, "Adasum": 2, "Min": 3, "Max": 4, "Product": 5}


def _default_matches(ours, theirs) -> bool:
    if theirs == GPS:
        return ours is global_process_set
    if theirs == NONE_C:
        return ours is hvd.Compression.none
    if theirs == AVG:
        return ours == hvd.Average
    return type(ours) is type(theirs) and ours == theirs


def test_every_horovod_name_exists():
    missing = [n for n in HOROVOD_NAMES if not hasattr(hvd, n)]
    assert not missing, f"hvdlike.torch lacks {missing}"
    assert set(HOROVOD_NAMES) - {"global_process_set", "HorovodInternalError", "Compression",
                                 *OP_VALUES} == set(SIGNATURES)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_compatible(name):
    fn = getattr(hvd, name)
    assert callable(fn)
    target = fn.__init__ if inspect.isclass(fn) else fn
    params = list(inspect.signature(target).parameters.values())
    if inspect.isclass(fn):
        params = params[1:]  # self
    expected = SIGNATURES[name]
    assert len(params) >= len(expected), f"{name}{inspect.signature(target)}"
    for (want, default), param in zip(expected, params):
        if want.startswith("*"):
            assert param.kind is inspect.Parameter.VAR_POSITIONAL, name
            continue
        assert param.name == want, f"{name}: parameter {param.name!r}, Horovod has {want!r}"
        if default is not REQUIRED:
            assert param.default is not REQUIRED, f"{name}: {want} needs a default"
            assert _default_matches(param.default, default), \
                f"{name}: {want}={param.default!r}, Horovod has {default!r}"
    for extra in params[len(expected):]:
        # Anything beyond Horovod's parameters must be optional.
        assert extra.default is not REQUIRED or extra.kind in (
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD), \
            f"{name}: extra required parameter {extra.name!r}"


def test_constants_and_types():
    for name, value in OP_VALUES.items():
        assert int(getattr(hvd, name)) == value
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert hvd.HorovodInternalError is hvd.HvdlikeInternalError
    assert hasattr(hvd.Compression, "none") and hasattr(hvd.Compression, "fp16")
    assert hvd.global_process_set.process_set_id == 0


@pytest.mark.parametrize("module, names", [
    ("mpi_ops", ["allreduce", "allreduce_async_", "synchronize", "poll", "Average", "Adasum",
                 "init", "size", "ProcessSet", "global_process_set", "add_process_set",
                 "sparse_allreduce_async", "HorovodInternalError", "join", "barrier"]),
    ("compression", ["Compression"]),
    ("functions", ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object"]),
    ("optimizer", ["DistributedOptimizer"]),
    ("sync_batch_norm", ["SyncBatchNorm"]),
])
def test_submodules_users_import_from(module, names):
    mod = importlib.import_module(f"hvdlike.torch.{module}")
    for name in names:
        assert getattr(mod, name) is not None, f"hvdlike.torch.{module}.{name}"
    assert importlib.import_module("hvdlike.torch.mpi_ops").allreduce is hvd.allreduce
    assert hvd.mpi_ops.synchronize is hvd.synchronize  # an attribute, as in Horovod


def test_build_queries_truthful():
    import torch
    import torch.distributed as dist

    assert hvd.gloo_built() == dist.is_gloo_available()
    assert hvd.cuda_built() == (torch.version.cuda is not None)
    assert hvd.nccl_built() == bool(dist.is_nccl_available() and torch.version.cuda)
    assert hvd.rocm_built() == (getattr(torch.version, "hip", None) is not None)
    assert hvd.ddl_built() is False and hvd.ccl_built() is False
    assert hvd.mpi_enabled() is False  # not launched by MPI here


def test_check_extension():
    hvd.check_extension("horovod.torch", "HOROVOD_WITH_PYTORCH", __file__, "mpi_lib_v2")
    hvd.check_extension("hvdlike.torch", "HVDLIKE_WITH_PYTORCH", __file__)
    with pytest.raises(ImportError, match="tensorflow"):
        hvd.check_extension("horovod.tensorflow", "HOROVOD_WITH_TENSORFLOW", __file__)
    with pytest.raises(TypeError, match="ext_env_var"):
        hvd.check_extension("horovod.torch", None, __file__)


def test_process_set_object_before_registration():
    ps = hvd.ProcessSet([2, 0])
    assert ps.ranks == [0, 2] and ps.process_set_id is None
    assert ps.size() is None and ps.rank() is None
    assert repr(ps) == "ProcessSet(process_set_id=None, ranks=[0, 2], mpi_comm=None)"
    with pytest.raises(ValueError, match="unique"):
        hvd.ProcessSet([1, 1])
    with pytest.raises(ValueError, match="non-negative"):
        hvd.ProcessSet([0, -1])
    with pytest.raises(TypeError):
        hvd.ProcessSet("01")
    with pytest.raises(ValueError, match="not registered"):
        from hvdlike.core.process_sets import resolve

        resolve(ps)


def test_uninitialized_calls_raise_clearly():
    import torch

    with pytest.raises(ValueError, match="not been initialized"):
        hvd.allreduce(torch.ones(1))
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.start_timeline("/tmp/never.json")
