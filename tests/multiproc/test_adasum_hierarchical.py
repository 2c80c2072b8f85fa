"""Hierarchical Adasum (Horovod's GPU Adasum: an average inside each host, Adasum across
hosts) on real ranks, its code path run on CPU tensors with HVDLIKE_ADASUM_HIERARCHICAL=1
and hosts named per rank."""

from tests.multiproc.harness import run_ranks


def _hierarchical(hosts):
    import torch

    import hvdlike.torch as hvd
    from hvdlike.core.adasum import hierarchical_reference, reference
    from tests.multiproc.test_adasum import _inputs

    torch.set_num_threads(1)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    a = _inputs(r, (6,))
    everyone = [_inputs(i, (6,)) for i in range(n)]
    got = hvd.allreduce(a, op=hvd.Adasum, name="h")
    want = hierarchical_reference(everyone, hosts)
    flat = reference(everyone)
    half = hvd.allreduce(a.half(), op=hvd.Adasum, prescale_factor=0.5, name="h16")
    want_half = hierarchical_reference([0.5 * t.half() for t in everyone], hosts)
    rows = hvd.allgather(got.unsqueeze(0))
    # Horovod's own expectation, independent of the reference: orthogonal vectors
    # give their sum divided by the ranks per host (hosts here are of equal size).
    q, _ = torch.linalg.qr(torch.randn(40, n, generator=torch.Generator().manual_seed(7),
                                       dtype=torch.float64))
    orthogonal = hvd.allreduce(q[:, r].contiguous(), op=hvd.Adasum, name="orth")
    per_host = len(hosts[0])
    out = (float((got - want).abs().max()), float((got - flat).abs().max()),
           float((half.double() - want_half.double()).abs().max()),
           all(torch.equal(rows[0], row) for row in rows),
           float((orthogonal - q.sum(1) / per_host).abs().max()),
           float((got - torch.stack(everyone).mean(0)).abs().max()))
    hvd.shutdown()
    return out


def _run(hosts, names, knob="1"):
    host_of = {r: names[i] for i, ranks in enumerate(hosts) for r in ranks}
    return run_ranks(_hierarchical, np=len(host_of), args=(hosts,), timeout=90,
                     env={"HVDLIKE_ADASUM_HIERARCHICAL": knob, "HVDLIKE_SHM": "0"},
                     per_rank_env=lambda r: {"HVDLIKE_HOSTNAME": host_of[r]})


def test_two_hosts_of_two_average_inside_and_combine_across():
    for error, from_flat, half_error, identical, orth, _ in _run([[0, 1], [2, 3]], ["a", "b"]):
        assert error < 1e-5 and half_error < 5e-3 and identical, (error, half_error)
        assert from_flat > 0.1  # not the flat Adasum of the four
        assert orth < 1e-12, orth


def test_uneven_hosts_and_one_host_which_makes_it_the_average():
    for error, _, half_error, identical, _, _ in _run([[0, 1], [2]], ["a", "b"]):
        assert error < 1e-5 and half_error < 5e-3 and identical, (error, half_error)
    for error, _, _, identical, orth, mean in _run([[0, 1, 2]], ["only"]):
        # one host: the plain average
        assert error < 1e-5 and mean < 1e-6 and orth < 1e-12 and identical, (error, mean)


def test_the_knob_off_keeps_cpu_tensors_flat():
    from tests.multiproc.test_adasum_hierarchical import _hierarchical  # noqa: F401

    for error, from_flat, _, identical, _, _ in _run([[0, 1], [2, 3]], ["a", "b"], knob="0"):
        assert from_flat < 1e-5 and error > 0.1 and identical, (error, from_flat)
