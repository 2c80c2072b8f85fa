"""A user's post-accumulate-grad hook runs before DistributedOptimizer's, whenever registered.

Per-parameter clipping or scaling done in ``p.register_post_accumulate_grad_hook``
after wrapping the optimizer (as under Horovod and DDP, whose hooks sit on each
parameter's gradient accumulator and so run after all of the tensor's hooks)
changes what the ranks reduce: every rank ends each step with the average of
the ranks' clipped gradients, in the deferred default and with
``HVDLIKE_CPU_OVERLAP=1``, with and without buckets, and nothing warns or is
refused as a change made after the reduction started.
"""

import pytest

from tests.multiproc.harness import run_ranks

CLIP = 0.05
SCALE = 0.5
ROWS = 4  # examples per rank and backward pass
STEPS = 3


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _add_user_hooks(model, watch=None):
    """Weights are clipped in place, biases scaled into a new tensor; ``watch(p)`` first."""

    def clip(p):
        if watch is not None:
            watch(p)
        p.grad.clamp_(-CLIP, CLIP)

    def scale(p):
        if watch is not None:
            watch(p)
        p.grad = p.grad * SCALE

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(clip if name.endswith("weight") else scale)


def _batches(step, ranks, passes):
    """Every rank's inputs and targets of one step: [rank][pass] -> (x, y)."""
    import torch

    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ranks, passes, ROWS, 6, generator=g)
    y = torch.randn(ranks, passes, ROWS, 3, generator=g)
    return [[(x[r, i], y[r, i]) for i in range(passes)] for r in range(ranks)]


def _train(k, groups, adasum):
    import warnings

    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = _model()
    options = {"backward_passes_per_step": k}
    if groups:
        options["groups"] = groups
    if adasum:
        options["op"] = hvd.Adasum
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), **options)
    done = [0]  # backward passes of this step so far
    early = []  # parameters the optimizer had counted in before the user's hook ran

    def watch(p):
        where = opt._hvd_bucket_of.get(id(p))
        if (opt._hvd_passes.get(id(p), 0) != done[0] or id(p) in opt._hvd_handles
                or (where is not None and where[0].marked[where[1]])):
            early.append(opt._hvd_names[p])

    _add_user_hooks(model, watch)  # after wrapping
    grads, in_flight, error = [], [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(STEPS):
                opt.zero_grad()
                for done[0], (x, y) in enumerate(_batches(step, n, k)[r]):
                    torch.nn.functional.mse_loss(model(x), y).backward()
                # What backward left for the step: started reductions or held-back ones.
                in_flight.append((len(opt._hvd_handles), len(opt._hvd_deferred)))
                opt.step()
                grads.append([p.grad.clone() for p in model.parameters()])
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            error = f"{type(exc).__name__}: {exc}"
    messages = [str(w.message) for w in caught if "DistributedOptimizer" in str(w.message)]
    params = [p.detach().clone() for p in model.parameters()]
    hvd.shutdown()
    return error, messages, early, in_flight, grads, params


def _reference(k):
    """One process: each rank's gradient through the same hooks, averaged, then SGD."""
    import torch

    model = _model()
    _add_user_hooks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        per_rank = []
        for batches in _batches(step, 2, k):
            opt.zero_grad()
            for x, y in batches:
                torch.nn.functional.mse_loss(model(x), y).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        average = [(a + b) / 2 for a, b in zip(*per_rank)]
        for p, g in zip(model.parameters(), average):
            p.grad = g
        opt.step()
        grads.append(average)
    return grads, [p.detach().clone() for p in model.parameters()]


def _adasum_reference():
    """One process: each rank's SGD change on its clipped gradient, combined by Adasum."""
    import torch

    model = _model()
    _add_user_hooks(model)
    for step in range(STEPS):
        deltas = []
        for batches in _batches(step, 2, 1):
            model.zero_grad()
            for x, y in batches:
                torch.nn.functional.mse_loss(model(x), y).backward()
            deltas.append([-0.1 * p.grad for p in model.parameters()])
        with torch.no_grad():
            for p, a, b in zip(model.parameters(), *deltas):
                a, b = a.double(), b.double()
                dot = (a * b).sum()
                combined = (1 - dot / (2 * (a * a).sum())) * a + (1 - dot / (2 * (b * b).sum())) * b
                p.add_(combined.float())
    return [p.detach().clone() for p in model.parameters()]


CASES = {
    # name: (HVDLIKE_CPU_OVERLAP, buckets, backward_passes_per_step, groups)
    "deferred-buckets": ("0", True, 1, None),
    "deferred-one-per-gradient": ("0", False, 1, None),
    "overlap-buckets": ("1", True, 1, None),
    "overlap-one-per-gradient": ("1", False, 1, None),
    "overlap-buckets-two-passes": ("1", True, 2, None),
    "overlap-groups": ("1", True, 1, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hook_registered_after_wrapping_changes_what_is_reduced(case):
    overlap, buckets, k, groups = CASES[case]
    env = {"HVDLIKE_CPU_OVERLAP": overlap}
    if not buckets:
        env["HVDLIKE_FUSION_THRESHOLD"] = "0"
    results = run_ranks(_train, np=2, args=(k, groups, False), env=env, timeout=90)
    ref_grads, ref_params = _reference(k)
    for rank, (error, messages, early, in_flight, grads, params) in enumerate(results):
        assert error is None, (rank, error)
        assert messages == [], (rank, messages)
        for handles, deferred in in_flight:  # the mode under test is the one that ran
            assert (handles > 0) if overlap == "1" else (deferred > 0 and handles == 0), \
                (rank, in_flight)
        for step, (got, want) in enumerate(zip(grads, ref_grads)):
            for i, (a, b) in enumerate(zip(got, want)):
                assert (a - b).abs().max().item() < 1e-6, (rank, step, i, a, b)
        for a, b in zip(params, ref_params):
            assert (a - b).abs().max().item() < 1e-6, (rank, a, b)
        assert early == [], (rank, early)


def test_adasum_local_steps_use_the_gradient_a_user_hook_left():
    # Each rank's local step runs in the optimizer's hook, during backward: it
    # used to step on the gradient before the user's hook clipped it.
    results = run_ranks(_train, np=2, args=(1, None, True), timeout=90)
    want = _adasum_reference()
    for rank, (error, messages, early, _, _, params) in enumerate(results):
        assert error is None, (rank, error)
        assert messages == [], (rank, messages)
        for a, b in zip(params, want):
            assert (a - b).abs().max().item() < 1e-5, (rank, a, b)
        assert early == [], (rank, early)
