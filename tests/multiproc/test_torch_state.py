"""broadcast_parameters and broadcast_optimizer_state on real ranks."""

import pytest
import torch

from tests.multiproc.harness import run_ranks


def _state():
    import torch.nn as nn
    import torch.nn.functional as F

    import hvdlike.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    torch.manual_seed(100 + r)  # deliberately different models per rank
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=1)
    out["params"] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(100 + 1)
    expected = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    out["params_match_root"] = all(torch.equal(v, expected.state_dict()[k])
                                   for k, v in model.state_dict().items())

    # named_parameters form, onto parameters that require grad
    other = nn.Linear(2, 2)
    with torch.no_grad():
        other.weight.fill_(float(r))
    hvd.broadcast_parameters(other.named_parameters(), root_rank=0)
    out["named_weight"] = other.weight.detach().clone()

    # Optimizer state: only the root has stepped (others have no state yet);
    # its lr differs too, and it carries a custom scalar.
    for cls, kwargs in ((torch.optim.Adam, {"lr": 0.01}),
                        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})):
        torch.manual_seed(5)
        net = nn.Linear(3, 2)
        opt = cls(net.parameters(), **kwargs)
        if r == 0:  # local steps before wrapping: only the root has state
            opt.param_groups[0]["lr"] = 0.123
            for _ in range(3):
                opt.zero_grad()
                F.mse_loss(net(torch.randn(4, 3)), torch.randn(4, 2)).backward()
                opt.step()
            opt.state[net.weight]["custom_scalar"] = 42
        opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
        before = {k: ({n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()})
                  for k, s in opt.state_dict()["state"].items()}
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        sd = opt.state_dict()
        out[cls.__name__] = {"state": sd["state"], "lr": sd["param_groups"][0]["lr"],
                             "before": before}
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_state, np=2, timeout=90)


def test_broadcast_parameters_state_dict_and_named(results):
    for out in results:
        assert out["params_match_root"]
        assert torch.equal(out["named_weight"], torch.zeros(2, 2))
    for k, v in results[0]["params"].items():
        assert torch.equal(v, results[1]["params"][k])


@pytest.mark.parametrize("cls", ["Adam", "SGD"])
def test_broadcast_optimizer_state_gives_everyone_the_roots_exact_state(results, cls):
    root, other = results[0][cls], results[1][cls]
    assert other["before"] == {}  # the non-root had no state before
    assert other["lr"] == root["lr"] == 0.123
    assert set(other["state"]) == set(root["state"]) and root["state"]
    for key, st in root["state"].items():
        assert set(other["state"][key]) == set(st)
        for name, value in st.items():
            if torch.is_tensor(value):
                assert torch.equal(other["state"][key][name], value), (key, name)
                assert other["state"][key][name].dtype == value.dtype
            else:
                assert other["state"][key][name] == value
    assert root["state"][0]["custom_scalar"] == 42
    # the root's own state is unchanged by the broadcast
    for key, st in root["before"].items():
        for name, value in st.items():
            now = root["state"][key][name]
            assert torch.equal(now, value) if torch.is_tensor(value) else now == value
