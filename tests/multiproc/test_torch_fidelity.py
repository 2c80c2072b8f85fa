"""Behaviours a script written for horovod.torch observes, on real ranks.

Gradients of the collectives follow Horovod's rules; broadcast_optimizer_state
initializes a fresh optimizer; join() refuses collectives that have no neutral
value; DistributedOptimizer's names, process sets, sparse_as_dense and the
synchronize()/step() warning behave as Horovod's do.
"""

from tests.multiproc.harness import run_ranks


def _gradients():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    # allgather: this rank's rows of the mean of the incoming gradients
    rows = [2, 3, 1][:n]
    x = torch.full((rows[r], 2), float(r), requires_grad=True)
    upstream = torch.arange(sum(rows) * 2, dtype=torch.float32).reshape(-1, 2) * (r + 1)
    hvd.allgather(x).backward(upstream)
    out["allgather"] = x.grad.tolist()
    # grouped_allgather: the same, tensor by tensor
    a = torch.ones(rows[r], requires_grad=True)
    b = torch.ones(rows[r], 3, requires_grad=True)
    ga, gb = hvd.grouped_allgather([a, b])
    (ga.sum() * (r + 1) + (gb * 2).sum()).backward()
    out["grouped_allgather"] = (a.grad.tolist(), b.grad.tolist())
    # broadcast: mean of the gradients on the root, zeros elsewhere
    y = torch.ones(3, requires_grad=True)
    hvd.broadcast(y, root_rank=n - 1).backward(torch.full((3,), float(r + 1)))
    out["broadcast"] = y.grad.tolist()
    # reducescatter: allgather of the gradient, times size for Sum, times the scale factors
    for op in (hvd.Sum, hvd.Average):
        z = torch.ones(2 * n, requires_grad=True)
        part = hvd.reducescatter(z, op=op, prescale_factor=2.0, postscale_factor=0.5)
        part.backward(torch.full(part.shape, float(r + 1)))
        out[f"reducescatter.{int(op)}"] = z.grad.tolist()
        zs = [torch.ones(2 * n, requires_grad=True), torch.ones(n, 2, requires_grad=True)]
        parts = hvd.grouped_reducescatter(zs, op=op)
        sum((p * (r + 1)).sum() for p in parts).backward()
        out[f"grouped_reducescatter.{int(op)}"] = [t.grad.tolist() for t in zs]
    hvd.shutdown()
    return out


def _expected(r, n):
    import torch

    rows = [2, 3, 1][:n]
    start = sum(rows[:r])
    mean_scale = sum(k + 1 for k in range(n)) / n
    full = torch.arange(sum(rows) * 2, dtype=torch.float32).reshape(-1, 2) * mean_scale
    exp = {"allgather": full[start:start + rows[r]].tolist()}
    exp["grouped_allgather"] = ([mean_scale] * rows[r], [[2.0] * 3] * rows[r])
    exp["broadcast"] = [mean_scale] * 3 if r == n - 1 else [0.0] * 3
    gathered = [float(k + 1) for k in range(n) for _ in range(2)]  # every rank's part, in order
    for op, factor in ((1, n), (0, 1)):
        exp[f"reducescatter.{op}"] = [g * factor * 2.0 * 0.5 for g in gathered]
        first = [float(k + 1) * factor for k in range(n) for _ in range(2)]
        second = [[float(k + 1) * factor] * 2 for k in range(n)]
        exp[f"grouped_reducescatter.{op}"] = [first, second]
    return exp


def test_collective_gradients_follow_horovods_rules():
    for n in (2, 3):
        results = run_ranks(_gradients, np=n, timeout=120)
        for r, got in enumerate(results):
            assert got == _expected(r, n), (n, r, got)


def _optimizer_behaviours():
    import warnings

    import torch

    import hvdlike.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}

    # broadcast_optimizer_state on a fresh optimizer: state created, zero grads,
    # a frozen parameter keeps grad None
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.index = torch.nn.Parameter(torch.tensor([1, 3]), requires_grad=False)
            self.w = torch.nn.Parameter(torch.rand(4))

    net = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["frozen_grad"] = net.index.grad
    out["w_grad"] = net.w.grad.tolist()
    out["state"] = sorted(opt.state[net.w])

    # no named_parameters: Horovod's _parameter_names, unique and alike on every rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1))
    names = opt._parameter_names
    out["names"] = sorted(names.values())
    out["names_unique"] = len(set(names.values())) == len(names) == 4

    # synchronize() then step() outside skip_synchronize(): exactly one warning
    loss = model(torch.ones(2, 3)).sum()
    opt.zero_grad()
    loss.backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["warnings"] = [str(w.message).split(":")[0] for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
    out["warnings_skip"] = len(caught)

    # SparseAdam with sparse_as_dense: gradients reduced dense, stepped sparse
    emb = torch.nn.Embedding(6, 2, sparse=True)
    hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
    for sparse_as_dense in (False, True):
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                       sparse_as_dense=sparse_as_dense)
        opt.zero_grad()
        emb(torch.tensor([r, 4])).sum().backward()
        opt.step()
        out[f"sparse_grad_{sparse_as_dense}"] = emb.weight.grad.is_sparse
    out["emb_equal"] = hvd.allgather(emb.weight.detach().unsqueeze(0)).unique(dim=0).shape[0]

    # a process set this rank is not in: the optimizer steps locally, never waits
    evens = hvd.add_process_set([0])
    lin = torch.nn.Linear(2, 1)
    hvd.broadcast_parameters(lin.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=1.0),
                                   named_parameters=lin.named_parameters(), process_set=evens)
    opt.zero_grad()
    (lin(torch.ones(1, 2)) * (r + 1)).sum().backward()
    opt.step()
    out["local_step_bias"] = lin.bias.detach().item()
    hvd.remove_process_set(evens)
    hvd.shutdown()
    return out


def test_distributed_optimizer_behaves_as_horovods():
    results = run_ranks(_optimizer_behaviours, np=2, timeout=120,
                        env={"HVDLIKE_DYNAMIC_PROCESS_SETS": "1"})
    biases = []
    for r, got in enumerate(results):
        assert got["frozen_grad"] is None, got
        assert got["w_grad"] == [0.0] * 4, got
        assert got["state"] == ["momentum_buffer"], got
        assert got["names_unique"] and got["names"] == results[0]["names"], got
        assert got["warnings"] == ["optimizer.step() called without optimizer.skip_synchronize() "
                                   "context after optimizer.synchronize()"], got
        assert got["warnings_skip"] == 0, got
        assert got["sparse_grad_False"] and got["sparse_grad_True"], got
        assert got["emb_equal"] == 1, got
        biases.append(got["local_step_bias"])
    # rank 1 stepped on its own gradient (twice rank 0's), so the biases differ by one lr * grad
    assert abs((biases[0] - biases[1]) - 1.0) < 1e-6, biases


def _join_refuses(op_name):
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    outcomes = []
    for first in range(n):
        if r == first:
            last = hvd.join()
        else:
            try:
                if op_name == "allgather":
                    hvd.allgather(torch.ones(2, 2))
                elif op_name == "broadcast":
                    hvd.broadcast(torch.ones(2), root_rank=r, name="after.join")
                else:
                    hvd.reducescatter(torch.ones(2 * n))
                outcomes.append("no error")
            except RuntimeError as exc:
                outcomes.append("join" in str(exc))
            last = hvd.join()
        outcomes.append(last != first)
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    hvd.shutdown()
    return outcomes, total


def test_join_makes_allgather_broadcast_and_reducescatter_raise():
    for op_name in ("allgather", "broadcast", "reducescatter"):
        results = run_ranks(_join_refuses, np=2, args=(op_name,), timeout=90)
        assert results == [([True, True, True], 2.0)] * 2, (op_name, results)
    # three ranks: the two that did not join numbered their unnamed allgathers
    # differently (one of them skipped one while it had joined); both still fail
    results = run_ranks(_join_refuses, np=3, args=("allgather",), timeout=90)
    assert results == [([True, True, True, True, True], 3.0)] * 3, results


def _adasum_reducescatter():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    try:
        hvd.reducescatter(torch.ones(4), op=hvd.Adasum)
        outcome = "no error"
    except RuntimeError as exc:
        outcome = "Adasum" in str(exc)
    after = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    hvd.shutdown()
    return outcome, after


def test_reducescatter_adasum_raises_runtime_error_on_every_rank():
    assert run_ranks(_adasum_reducescatter, np=2, timeout=60) == [(True, 2.0)] * 2


def _timeline_dynamic(tmp):
    import os

    import torch

    import hvdlike.torch as hvd

    os.chdir(tmp)
    hvd.init()
    hvd.allreduce(torch.ones(1), name="before.start")
    hvd.barrier()
    before = sorted(os.listdir(tmp))
    hvd.barrier()  # every rank has looked before rank 0 opens its file
    path = os.path.join(tmp, f"tl{hvd.rank()}.json")
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(1), name="recorded")
    hvd.stop_timeline()
    rank = hvd.rank()
    hvd.shutdown()
    return before, ("recorded" in open(path).read()) if rank == 0 else None


def test_timeline_dynamic_writes_nothing_until_start_timeline(tmp_path):
    results = run_ranks(_timeline_dynamic, np=2, args=(str(tmp_path),), timeout=60,
                        env={"HOROVOD_TIMELINE": "DYNAMIC"})
    assert results[0] == ([], True), results
    assert results[1] == ([], None), results
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tl0.json"]


def _ported_calls():
    import warnings

    import torch
    import torch.nn as nn

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    # synchronize() of an alltoall handle is (output, received_splits) even without splits
    t = torch.arange(2 * n, dtype=torch.float32) + 10 * r
    result = hvd.synchronize(hvd.alltoall_async(t))
    received, splits = result
    out["alltoall_async"] = (received.tolist(), splits.tolist())
    out["alltoall"] = hvd.alltoall(t).tolist()  # the synchronous form: the tensor alone
    # broadcast_parameters(model.parameters()): a list of tensors, named by position
    torch.manual_seed(r)
    model = nn.Linear(3, 2)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=1)
    out["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
    # grouped_allreduce with Max on tensors that require grad: the forward runs, and the
    # gradient goes to the rank holding the maximum (rank 1 here)
    a = torch.tensor([float(r), 5.0 - r], requires_grad=True)
    b = torch.tensor([2.0 * r], requires_grad=True)
    ma, mb = hvd.grouped_allreduce([a, b], op=hvd.Max)
    (ma.sum() + 3 * mb.sum()).backward()
    out["grouped_max"] = (ma.tolist(), mb.tolist(), a.grad.tolist(), b.grad.tolist())
    prod = hvd.grouped_allreduce([a * 1.0], op=hvd.Product)[0]
    try:
        prod.sum().backward()
        out["product_backward"] = "no error"
    except RuntimeError as exc:
        out["product_backward"] = str(exc)
    # load_state_dict abandons the round in progress (here: one of two backward passes)
    torch.manual_seed(0)
    net = nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters(),
                                   backward_passes_per_step=2)
    saved = opt.state_dict()
    net(torch.ones(1, 2)).sum().backward()
    opt.load_state_dict(saved)
    opt.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            net(torch.full((1, 2), float(r + 1))).sum().backward()
        opt.step()
    out["after_load"] = (net.weight.grad.tolist(), [str(w.message) for w in caught])
    # SyncBatchNorm without running statistics normalizes with the global batch in eval too
    bn = hvd.SyncBatchNorm(2, track_running_stats=False, affine=False).eval()
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2) * (r + 1)
    out["bn_eval"] = bn(x).tolist()
    everyone = torch.cat([torch.arange(6, dtype=torch.float32).reshape(3, 2) * (k + 1)
                          for k in range(n)])
    out["bn_expected"] = torch.nn.functional.batch_norm(
        everyone, None, None, training=True)[3 * r:3 * r + 3].tolist()
    hvd.shutdown()
    return out


def test_calls_ported_from_horovod_torch_behave_as_there():
    results = run_ranks(_ported_calls, np=2, timeout=120)
    for r, out in enumerate(results):
        received, splits = out["alltoall_async"]
        assert received == [2.0 * r, 2.0 * r + 1, 10 + 2.0 * r, 11 + 2.0 * r]
        assert splits == [2, 2]
        assert out["alltoall"] == received
        assert out["params"] == results[1]["params"]
        ma, mb, ga, gb = out["grouped_max"]
        assert ma == [1.0, 5.0] and mb == [2.0]
        # Max of a[0] is rank 1's, of a[1] rank 0's; b's max is rank 1's (2 ranks x 3)
        assert ga == ([0.0, 2.0] if r == 0 else [2.0, 0.0]), ga
        assert gb == ([0.0] if r == 0 else [6.0]), gb
        assert "grouped_allreduce with op Product is not differentiable" in \
            out["product_backward"]
        grad, caught = out["after_load"]
        # two fresh passes on each rank (inputs r + 1), averaged: (2*1 + 2*2) / 2 = 3
        assert grad == [[3.0, 3.0]], grad
        assert caught == [], caught
        for got, want in zip(out["bn_eval"], out["bn_expected"]):
            assert all(abs(g - w) < 1e-5 for g, w in zip(got, want)), (got, want)
