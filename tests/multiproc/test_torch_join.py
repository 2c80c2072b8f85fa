"""join() with DistributedOptimizer when ranks hold different numbers of batches."""

import torch

from tests.multiproc.harness import run_ranks

BATCHES = [0, 4, 2]  # per rank: rank 0 joins before any name is cached
B = 3


def _train(batches):
    import torch.nn as nn
    import torch.nn.functional as F

    import hvdlike.torch as hvd

    pair = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[pair])
    r, n = hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(3)
    steps = max(batches)
    X = torch.randn(n, steps, B, 4, generator=g)
    Y = torch.randn(n, steps, B, 1, generator=g)

    def make():
        torch.manual_seed(r)  # different on purpose: broadcast_parameters fixes it
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, opt = make()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for t in range(batches[r]):
        opt.zero_grad()
        F.mse_loss(model(X[r, t]), Y[r, t]).backward()
        opt.step()
    last = hvd.join()
    # Resync: the last rank to join trained on every step.
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    hvd.broadcast_optimizer_state(opt, root_rank=last)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    # Oracle: at each step, active ranks' gradients summed and divided by
    # the full size (joined ranks contribute zeros).
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for t in range(steps):
        ref_opt.zero_grad()
        active = [q for q in range(n) if batches[q] > t]
        (sum(F.mse_loss(ref(X[q, t]), Y[q, t]) for q in active) / n).backward()
        ref_opt.step()
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])

    # After join the job carries on normally: one more synchronized step.
    opt.zero_grad()
    F.mse_loss(model(X[r, 0]), Y[r, 0]).backward()
    opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # and a second join with equal data reports some rank
    again = hvd.join()
    # With rank 0 joined, an Average is the others' sum over 3, correctly rounded:
    # 142 / 3 and 130 / 3 come out one unit in the last place off as 142 * (1/3).
    probe = torch.tensor([71.0, 65.0, 75.0])
    exact = None
    if r == 0:
        hvd.join()
    else:
        exact = torch.equal(hvd.allreduce(probe, name="join.average"), probe * 2 / 3)
        hvd.join()

    # A DistributedOptimizer within a process set: ranks 0 and 2 train, rank 1 does not.
    pair_diff = None
    if r in (0, 2):
        me = pair.rank()
        torch.manual_seed(0)
        net = nn.Linear(4, 1)
        popt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                        named_parameters=net.named_parameters(),
                                        process_set=pair)
        torch.manual_seed(0)
        ref_net = nn.Linear(4, 1)
        ref_opt = torch.optim.SGD(ref_net.parameters(), lr=0.1)
        for t in range(3):
            popt.zero_grad()
            F.mse_loss(net(X[me, t]), Y[me, t]).backward()
            popt.step()
            ref_opt.zero_grad()
            (sum(F.mse_loss(ref_net(X[q, t]), Y[q, t]) for q in range(2)) / 2).backward()
            ref_opt.step()
        pair_diff = max(float((a - b).abs().max())
                        for a, b in zip(net.parameters(), ref_net.parameters()))
    hvd.barrier()  # shutdown stops every rank: rank 1 waits for the pair to finish
    hvd.shutdown()
    return {"last": last, "diff": float((params - expected).abs().max()), "params": params,
            "after": after, "again": again, "pair_diff": pair_diff, "exact": exact}


def test_join_with_uneven_batches_finishes_and_matches_the_oracle():
    """Also trains a DistributedOptimizer on a process set of ranks 0 and 2."""
    results = run_ranks(_train, np=3, args=(BATCHES,), timeout=120)
    for out in results:
        assert out["last"] == 1  # the rank with the most batches joins last
        assert out["diff"] < 1e-5
        assert torch.equal(out["params"], results[0]["params"])
        assert torch.equal(out["after"], results[0]["after"])
        assert out["again"] in range(3)
    assert results[0]["pair_diff"] < 1e-6 and results[2]["pair_diff"] < 1e-6
    assert results[1]["pair_diff"] is None
    assert [out["exact"] for out in results] == [None, True, True]
