"""hvdlike.torch given bad input in a one-rank job: a clear error at the call, and a
runtime that keeps working afterwards."""

import numpy as np
import pytest
import torch
import torch.nn as nn

import hvdlike.torch as hvd
from hvdlike.torch import optimizer as optimizer_module


@pytest.fixture(scope="module", autouse=True)
def one_rank_job():
    torch.set_num_threads(1)
    hvd.init()
    yield
    hvd.shutdown()


def _meta():
    return torch.ones(2, 3, device="meta")


@pytest.mark.parametrize("call", [
    lambda: hvd.allreduce(_meta()),
    lambda: hvd.allreduce(torch.ones(2, 3, device="meta", requires_grad=True)),
    lambda: hvd.allreduce_(_meta()),
    lambda: hvd.synchronize(hvd.allreduce_async(_meta())),
    lambda: hvd.synchronize(hvd.allreduce_async_(_meta())),
    lambda: hvd.grouped_allreduce([torch.ones(2), _meta()]),
    lambda: hvd.grouped_allreduce_([_meta()]),
    lambda: hvd.allgather(_meta()),
    lambda: hvd.grouped_allgather([_meta()]),
    lambda: hvd.broadcast(_meta(), 0),
    lambda: hvd.broadcast_(_meta(), 0),
    lambda: hvd.alltoall(_meta()),
    lambda: hvd.reducescatter(_meta()),
    lambda: hvd.grouped_reducescatter([_meta()]),
    lambda: hvd.broadcast_parameters({"w": _meta()}, root_rank=0),
])
def test_a_meta_tensor_is_refused_and_the_runtime_keeps_working(call):
    with pytest.raises(TypeError, match="device 'meta'"):
        call()
    # Before, the meta tensor reached the data plane and every later collective failed.
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.ones(2))


@pytest.mark.parametrize("splits, match", [
    ("2", "got str"),
    (2, "got int"),
    ([2.0], r"splits\[0\] is float"),
    ([True], r"splits\[0\] is bool"),
    (torch.tensor([2.0]), "float32 tensor"),
    (torch.tensor([[2]]), "2-D int64 tensor"),
])
def test_alltoall_splits_of_the_wrong_kind_are_a_type_error(splits, match):
    with pytest.raises(TypeError, match=match):
        hvd.alltoall(torch.ones(2), splits=splits)


def test_alltoall_splits_may_be_a_list_a_tensor_or_a_numpy_array():
    for splits in ([2], (2,), torch.tensor([2], dtype=torch.int32), np.array([2])):
        out, received = hvd.alltoall(torch.arange(2.0), splits=splits)
        assert out.tolist() == [0.0, 1.0] and received.tolist() == [2]


@pytest.mark.parametrize("call, match", [
    (lambda: hvd.allreduce(torch.ones(2), prescale_factor="x"), "allreduce: prescale_factor"),
    (lambda: hvd.allreduce_async(torch.ones(2), postscale_factor=None),
     "allreduce: postscale_factor"),
    (lambda: hvd.grouped_allreduce([torch.ones(2)], prescale_factor=[2.0]),
     "grouped_allreduce: prescale_factor"),
    (lambda: hvd.reducescatter(torch.ones(2), postscale_factor="2"),
     "reducescatter: postscale_factor"),
    (lambda: hvd.grouped_reducescatter([torch.ones(2)], prescale_factor=object()),
     "grouped_reducescatter: prescale_factor"),
])
def test_scale_factors_that_are_not_numbers_are_named(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_numeric_scale_factors_of_any_kind_still_work():
    for factor in (2, np.float32(2.0), torch.tensor(2.0)):
        assert hvd.allreduce(torch.ones(2), prescale_factor=factor).tolist() == [2.0, 2.0]


@pytest.mark.parametrize("call", [
    lambda: hvd.allreduce(torch.ones(2), compression=3),
    lambda: hvd.grouped_allreduce([torch.ones(2)], compression="fp16"),
    lambda: hvd.reducescatter(torch.ones(2), compression=None),
])
def test_a_compression_that_is_not_a_compressor_is_a_type_error(call):
    with pytest.raises(TypeError, match="compression needs compress"):
        call()


def test_grouped_reducescatter_of_a_single_tensor_says_it_wants_a_list():
    with pytest.raises(TypeError, match="expects a list of tensors"):
        hvd.grouped_reducescatter(torch.ones(4))


def test_a_differentiable_allreduce_names_an_unknown_op():
    with pytest.raises(ValueError, match="allreduce: unknown reduction op 'sum'"):
        hvd.allreduce(torch.ones(2, requires_grad=True), op="sum")
    with pytest.raises(ValueError, match="grouped_allreduce: unknown reduction op 7"):
        hvd.grouped_allreduce([torch.ones(2, requires_grad=True)], op=7)


@pytest.mark.parametrize("wrap", [False, True])
def test_broadcast_optimizer_state_initializes_a_fresh_lbfgs(wrap):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5)
    if wrap:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # was: step() missing 'closure'
    assert opt.state_dict()["state"]  # it has state now, as the other optimizers get
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q)  # a step on zero gradients changes nothing
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    first = closure().item()
    opt.step(closure)
    assert closure().item() < first


def test_broadcast_optimizer_state_rejects_a_root_outside_the_job():
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="out of range"):
        hvd.broadcast_optimizer_state(opt, root_rank=4)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.Linear(2, 1))


@pytest.mark.parametrize("kwargs", [{}, {"num_groups": 2}])
def test_buckets_and_groups_follow_the_names_not_the_param_groups_order(monkeypatch, kwargs):
    monkeypatch.setattr(optimizer_module, "_overlaps_cpu", lambda: True)
    plans = []
    for order in (lambda ps: ps, lambda ps: ps[::-1], lambda ps: ps[1::2] + ps[0::2]):
        model = _model()
        params = order(list(model.parameters()))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                       named_parameters=model.named_parameters(), **kwargs)
        names = dict((p, n) for n, p in model.named_parameters())
        plans.append(([(b.name.replace(opt._hvd_prefix, ""), [names[p] for p in b.members])
                       for b in opt._hvd_buckets],
                      [[names[p] for p in g] for g in opt._hvd_groups]))
        del opt
    assert plans[0] == plans[1] == plans[2], plans
    assert plans[0][0] or plans[0][1]  # something was planned


def test_in_place_collectives_refuse_an_expanded_tensor_before_submitting():
    # Every element of an expanded tensor is one memory location: the result could not
    # be written back, and finding out after the collective ran leaves it half done.
    import torch

    from hvdlike.core import collectives

    expanded = torch.zeros(1).expand(3)
    for build, what in ((lambda: collectives.allreduce_entry(expanded, "x", inplace=True),
                         "allreduce"),
                        (lambda: collectives.broadcast_entry(expanded, 0, 2, "y", inplace=True),
                         "broadcast")):
        with pytest.raises(ValueError) as err:
            build()
        assert str(err.value) == (
            f"{what}_: the tensor cannot be written in place, several of its elements share "
            f"memory (an expanded tensor, shape [3], strides [0]); pass tensor.clone() or use "
            f"{what}, which returns a new tensor")
    # Not in place, or a strided tensor whose elements are distinct: accepted.
    assert collectives.allreduce_entry(expanded, "z").output.shape == (3,)
    strided = torch.zeros(4, 4).t()
    assert collectives.allreduce_entry(strided, "w", inplace=True).finish is not None
    assert collectives.broadcast_entry(strided, 0, 2, "v", inplace=True).finish is not None


def test_scale_factors_must_be_finite_and_splits_whole_and_roots_any_integer_type():
    # A NaN factor would never equal the other ranks' (a false mismatch); a fractional
    # split was truncated, so the error named splits the caller never passed; a numpy
    # integer root is what an index into an array gives, and Horovod takes it.
    import torch

    from hvdlike.core import collectives

    for pre, post, bad in ((float("nan"), 1.0, "prescale_factor"),
                           (1.0, float("inf"), "postscale_factor")):
        with pytest.raises(ValueError) as err:
            collectives.allreduce_entry(torch.ones(2), "nan.factor", prescale_factor=pre,
                                        postscale_factor=post)
        assert str(err.value).startswith(f"allreduce: {bad} must be a finite number, got ")
        with pytest.raises(ValueError) as err:
            collectives.reducescatter_entry(torch.ones(2), "rs", prescale_factor=pre,
                                            postscale_factor=post)
        assert str(err.value).startswith(f"reducescatter: {bad} must be a finite number")
    with pytest.raises(TypeError) as err:
        collectives.alltoall_entry(torch.ones(4), [1.5, 2.5], 2, "a2a")
    assert str(err.value) == "alltoall: splits must be integers; splits[0] is float 1.5"
    with pytest.raises(TypeError) as err:
        collectives.alltoall_entry(torch.ones(4), torch.tensor([2.0, 2.0]), 2, "a2a")
    assert str(err.value) == "alltoall: splits must be integers, got a float32 tensor"
    # Horovod's own test_horovod_alltoall_splits_type_error catches ValueError for it.
    assert isinstance(err.value, ValueError)
    assert collectives.alltoall_entry(torch.ones(4), np.array([1, 3]), 2, "a2a") is not None
    assert collectives.check_root(np.int64(1), 2, "broadcast") == 1
    assert type(collectives.check_root(np.int64(1), 2, "broadcast")) is int
    for bad_root in (True, 1.0, "1", None):
        with pytest.raises(TypeError):
            collectives.check_root(bad_root, 2, "broadcast")
    with pytest.raises(ValueError):
        collectives.check_root(np.int64(2), 2, "broadcast")


def test_numpy_alltoall_refuses_fractional_splits_instead_of_truncating():
    import hvdlike.numpy as hnp

    with pytest.raises(TypeError) as err:
        hnp.alltoall(np.arange(4.0), splits=np.array([1.5, 2.5]))
    assert str(err.value).endswith("alltoall: splits must be integers; splits[0] is float 1.5")
    received, splits = hnp.alltoall(np.arange(4.0), splits=np.array([4]))  # one rank
    assert received.tolist() == [0.0, 1.0, 2.0, 3.0] and list(splits) == [4]


@pytest.mark.parametrize("call", [
    lambda: hvd.allreduce(torch.ones(2), op=True),
    lambda: hvd.allreduce_async_(torch.ones(2), op=False),
    lambda: hvd.allreduce(torch.ones(2, requires_grad=True), op=True),
])
def test_a_bool_op_is_refused_rather_than_read_as_a_reduction(call):
    # ReduceOp(True) is Sum: a bool in op's place (Horovod's ``average``) would
    # silently sum where the caller meant to choose averaging.
    with pytest.raises(TypeError, match="op must be a reduction op"):
        call()


def test_malformed_named_parameters_are_a_value_error_as_in_horovod_and_a_type_error():
    model = torch.nn.Linear(2, 1)
    for kind in (ValueError, TypeError):
        with pytest.raises(kind, match="named_parameters must be"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=list(model.parameters()))


def test_a_model_whose_parameters_are_hooked_can_still_be_saved_whole():
    import io

    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the hook record used to sit on the parameter, unpicklable
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False).weight, model.weight)


def _two_tensor():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    return two_tensor.TwoTensor(torch.ones(2), torch.full((2,), 10.0))


@pytest.mark.parametrize("make, match", [
    (lambda: torch.ones(2, 2).to_sparse_csr(), "layout torch.sparse_csr"),
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor"),
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
     "layout torch.jagged"),
    (_two_tensor, "TwoTensor, a tensor subclass that intercepts torch operations"),
], ids=["sparse_csr", "nested", "jagged", "wrapper_subclass"])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tensors_that_are_not_plain_memory_are_refused_before_submission(make, match):
    # They passed the dtype checks, then failed in the data plane and took the
    # runtime down for every later collective (or returned garbage).
    tensor = make()
    for call in (hvd.allreduce, hvd.allgather, lambda t: hvd.broadcast(t, 0), hvd.allreduce_async_):
        with pytest.raises(TypeError, match=match):
            call(tensor)
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.ones(3))


def test_a_collective_inside_a_torch_func_transform_is_refused():
    with pytest.raises(TypeError, match="inside a torch.func transform"):
        torch.func.vmap(lambda t: hvd.allreduce(t))(torch.ones(2, 3))
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.ones(3))
