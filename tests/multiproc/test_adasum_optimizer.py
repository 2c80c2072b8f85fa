"""DistributedOptimizer(op=Adasum) on real ranks: every rank takes its local step and the
ranks combine the parameter changes with Adasum.

Each rank also computes, from first principles, what every rank should hold: one plain
copy of the model and optimizer per rank (each with its own state), a local step on that
rank's gradient from the shared parameters, and the Adasum of the changes with the
pairwise rule ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b`` (dot products in float64).
"""

import pytest
import torch

from tests.multiproc.harness import run_ranks

STEPS = 3


class Net(torch.nn.Module):
    """Two layers and a bias only rank 0 uses (the other ranks never give it a gradient)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 3)
        self.fc2 = torch.nn.Linear(3, 2)
        self.extra = torch.nn.Parameter(torch.full((2,), 0.25))

    def forward(self, x, rank):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out + self.extra if rank == 0 else out


def _net(seed=0):
    torch.manual_seed(seed)
    return Net()


def _loss(model, rank, step, part):
    """Rank ``rank``'s loss for backward pass ``part`` of ``step``: its own data."""
    g = torch.Generator().manual_seed(10_000 + 100 * rank + 10 * step + part)
    x = torch.randn(5, 4, generator=g)
    y = torch.randn(5, 2, generator=g)
    return (model(x, rank) - y).pow(2).mean()


def _optimizer(kind, params):
    if kind == "momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1)


def _pair(a, b):
    """Adasum of two changes, computed here in float64."""
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    dot = float(a64 @ b64)
    aa, bb = float(a64 @ a64), float(b64 @ b64)
    ca = 1.0 - dot / (2.0 * aa) if aa >= 1e-8 else 1.0  # Horovod's threshold
    cb = 1.0 - dot / (2.0 * bb) if bb >= 1e-8 else 1.0
    return (ca * a64 + cb * b64).reshape(a.shape)


def _adasum(deltas):
    """The ranks' changes in rank order, combined as recursive doubling pairs them: with
    three ranks the third folds into the first, then the first pair combines."""
    if len(deltas) == 1:
        return deltas[0].double()
    if len(deltas) == 2:
        return _pair(deltas[0], deltas[1])
    if len(deltas) == 3:
        return _pair(_pair(deltas[0], deltas[2]), deltas[1])
    raise AssertionError("the reference covers 1 to 3 ranks")


class Reference:
    """Every member rank's plain model and optimizer, stepped locally from shared values."""

    def __init__(self, kind, ranks, passes=1, wire=None):
        self.models = {r: _net() for r in ranks}
        self.opts = {r: _optimizer(kind, self.models[r].parameters()) for r in ranks}
        self.shared = [p.detach().clone() for p in _net().parameters()]
        self.passes, self.wire = passes, wire

    def step(self, step):
        deltas = []
        for rank, model in self.models.items():
            with torch.no_grad():
                for p, s in zip(model.parameters(), self.shared):
                    p.copy_(s)
            self.opts[rank].zero_grad()
            for part in range(self.passes):
                _loss(model, rank, step, part).backward()
            self.opts[rank].step()
            change = [p.detach() - s for p, s in zip(model.parameters(), self.shared)]
            if self.wire is not None:  # what compression puts on the wire
                change = [d.to(self.wire) for d in change]
            deltas.append(change)
        for i, s in enumerate(self.shared):
            combined = _adasum([d[i] for d in deltas])
            if self.wire is not None:
                combined = combined.to(self.wire)
            s.add_(combined.to(s.dtype))


def _train(kind, passes=1, compression=None, checks=False):
    import torch

    import hvdlike.torch as hvd
    from tests.multiproc.test_adasum_optimizer import STEPS, Reference, _loss, _net, _optimizer

    torch.set_num_threads(1)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"errors": {}}
    model = _net()
    opt = hvd.DistributedOptimizer(
        _optimizer(kind, model.parameters()), named_parameters=model.named_parameters(),
        op=hvd.Adasum, backward_passes_per_step=passes,
        compression=getattr(hvd.Compression, compression or "none"))
    out["class"] = type(opt).__mro__[1].__name__
    wire = torch.float16 if compression == "fp16" else None
    ref = Reference(kind, range(n), passes, wire)
    names = dict(opt._parameter_names)
    out["names"] = sorted(names[p] for p in model.parameters())
    for step in range(STEPS):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        for part in range(passes):
            _loss(model, r, step, part).backward()
            if part < passes - 1:
                out.setdefault("started_early", []).append(len(opt._hvd_handles))
        # The local steps ran during backward (their Adasum started); the parameters
        # still hold their start until step().
        out.setdefault("started", []).append(len(opt._hvd_handles))
        out.setdefault("kept", []).append(
            all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))
        if checks and step == 1:
            try:
                opt.zero_grad()
            except RuntimeError as exc:
                out["errors"]["zero_grad"] = str(exc)
            try:
                with opt.skip_synchronize():
                    pass
            except RuntimeError as exc:
                out["errors"]["skip_synchronize"] = str(exc)
            opt.synchronize()  # nothing to do: the parameters do not move
            out["sync_kept"] = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            try:
                _loss(model, r, step, 0).backward()  # one backward too many
            except RuntimeError as exc:
                out["errors"]["overflow"] = str(exc)
        opt.step()
        ref.step(step)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["reference"] = [s.clone() for s in ref.shared]
    out["error"] = max(float((p.double() - s.double()).abs().max())
                       for p, s in zip(out["params"], out["reference"]))
    out["grad"] = model.fc1.weight.grad.clone()  # gradients are never exchanged
    hvd.barrier()
    hvd.shutdown()
    return out


def _agree(results, atol):
    first = results[0]["params"]
    for res in results:
        assert all(torch.equal(p, q) for p, q in zip(res["params"], first)), \
            "ranks ended with different parameters"
        assert res["error"] <= atol, res["error"]
        assert all(res["kept"]), "a parameter moved between backward and step()"
        assert res["class"] == "_DistributedAdasum"
    return first


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_stateful_optimizers_combine_the_local_steps(kind):
    results = run_ranks(_train, np=2, args=(kind,), timeout=60)
    _agree(results, 1e-6)
    for res in results:
        # every parameter started its Adasum in backward but "extra" on rank 1,
        # which has no gradient for it and is submitted at step()
        assert res["started"] == [5 if res is results[0] else 4] * STEPS
        assert res["names"] == ["extra", "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert not torch.equal(results[0]["grad"], results[1]["grad"])


def test_plain_sgd_still_matches():
    results = run_ranks(_train, np=2, args=("sgd",), timeout=60)
    _agree(results, 1e-6)


def test_backward_passes_per_step_accumulates_before_the_local_step():
    results = run_ranks(_train, np=2, args=("momentum", 2), timeout=60)
    _agree(results, 1e-6)
    for res in results:
        assert res["started_early"] == [0] * STEPS  # nothing before the second pass


def test_fp16_compression_carries_the_changes_in_half_precision():
    results = run_ranks(_train, np=2, args=("adam", 1, "fp16"), timeout=60)
    _agree(results, 3e-5)


def test_misuse_gives_clear_errors_and_the_ranks_still_agree():
    results = run_ranks(_train, np=2, args=("momentum", 1, None, True), timeout=60)
    _agree(results, 1e-6)
    for res in results:
        errors = res["errors"]
        assert "zero_grad() was called after backward() but before step()" in errors["zero_grad"]
        assert "skip_synchronize() is not supported" in errors["skip_synchronize"]
        assert "backward_passes_per_step=1" in errors["overflow"]
        assert res["sync_kept"]


def _three_ranks():
    import torch

    import hvdlike.torch as hvd
    from tests.multiproc.test_adasum_optimizer import STEPS, Reference, _loss, _net, _optimizer

    torch.set_num_threads(1)
    sub = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[sub])
    r = hvd.rank()
    out = {}
    # Adam over all three ranks (rank 2 folds into rank 0), momentum SGD over ranks 0 and 2.
    whole, part = _net(), _net()
    opt_whole = hvd.DistributedOptimizer(_optimizer("adam", whole.parameters()),
                                         named_parameters=whole.named_parameters(),
                                         op=hvd.Adasum)
    opt_part = hvd.DistributedOptimizer(_optimizer("momentum", part.parameters()),
                                        named_parameters=part.named_parameters(),
                                        op=hvd.Adasum, process_set=sub)
    ref_whole = Reference("adam", [0, 1, 2])
    ref_part = Reference("momentum", [0, 2] if r != 1 else [1])
    for step in range(STEPS):
        for opt, model in ((opt_whole, whole), (opt_part, part)):
            opt.zero_grad()
            _loss(model, r, step, 0).backward()
            opt.step()
        ref_whole.step(step)
        ref_part.step(step)
    for label, model, ref in (("whole", whole, ref_whole), ("part", part, ref_part)):
        out[label] = [p.detach().clone() for p in model.parameters()]
        out[label + ".error"] = max(float((p.double() - s.double()).abs().max())
                                    for p, s in zip(out[label], ref.shared))
    hvd.barrier()
    hvd.shutdown()
    return out


def test_three_ranks_and_a_process_set():
    results = run_ranks(_three_ranks, np=3, timeout=90)
    for res in results:
        assert res["whole.error"] <= 1e-6 and res["part.error"] <= 1e-6, res
    for label, members in (("whole", [0, 1, 2]), ("part", [0, 2])):
        for rank in members:
            assert all(torch.equal(p, q) for p, q in zip(results[rank][label],
                                                         results[members[0]][label])), label
    # Rank 1 is outside the set: it took its own local steps, unlike ranks 0 and 2.
    assert not all(torch.equal(p, q) for p, q in zip(results[1]["part"], results[0]["part"]))
