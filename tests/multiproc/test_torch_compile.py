"""hvdlike.torch collectives called from code torch.compile compiles: a graph break.

Traced like user code, a collective took Dynamo into the runtime's data plane
and compiled its copies into graphs: wrong sums without an error, or a broken
runtime at the next call.
"""

from tests.multiproc.harness import run_ranks


def _compiled_collectives():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()

    def reduce(t):
        return hvd.allreduce(t * 2) + 1

    def step(t):
        handle = hvd.allreduce_async_(t.clone(), name="compiled.async")
        gathered = hvd.allgather(t.reshape(1, -1))
        return hvd.synchronize(handle) * 2, gathered

    # Whether the calling thread ran the negotiation itself (and so was traced)
    # varied from call to call: several calls, of odd and even lengths.
    compiled_reduce = torch.compile(reduce, backend="inductor")
    compiled_step = torch.compile(step, backend="inductor")
    reduced = [compiled_reduce(torch.full((3 + 2 * (i % 2),), float(r + i))).tolist()
               for i in range(8)]
    results = []
    for i in range(8):
        averaged, gathered = compiled_step(torch.full((3 + 2 * (i % 2),), float(r + i)))
        results.append((reduced[i], averaged.tolist(), gathered.tolist()))
    hvd.shutdown()
    return results


def test_collectives_inside_a_compiled_function_run_as_graph_breaks():
    for out in run_ranks(_compiled_collectives, np=2, timeout=240):
        for i, (reduced, doubled, gathered) in enumerate(out):
            n = 3 + 2 * (i % 2)
            assert reduced == [2 * (i + 0.5) + 1] * n, (i, reduced)
            assert doubled == [2 * (i + 0.5)] * n, (i, doubled)
            assert gathered == [[float(i)] * n, [float(i + 1)] * n], (i, gathered)


def _fullgraph_and_one_rank():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()

    def f(t):
        return hvd.allreduce(t * 2, op=hvd.Sum) + 1

    whole = torch.compile(f, backend="eager", fullgraph=True)  # loads torch._dynamo
    hvd.allreduce(torch.zeros(1), name="eager.first")  # an eager call prepares the guards
    try:
        whole(torch.ones(3))
        refused = ""
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        refused = str(exc)
    value = torch.compile(f, backend="eager")(torch.ones(3)).tolist()
    hvd.shutdown()
    return refused, value


def test_fullgraph_names_the_collective_instead_of_failing_inside_the_runtime():
    # Traced into, the runtime failed with Dynamo's complaint about a lock.
    refused, value = run_ranks(_fullgraph_and_one_rank, np=1, timeout=120)[0]
    assert "hvdlike collectives run outside compiled graphs" in refused, refused[:500]
    assert value == [3.0, 3.0, 3.0]
