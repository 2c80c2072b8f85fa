"""``init(comm=...)``'s argument and its checks, without processes."""

import numpy as np
import pytest

from hvdlike.core import world
from hvdlike.core.errors import HvdlikeError
from hvdlike.core.runtime import Runtime
from hvdlike.core.topology import Topology


def test_lists_keep_their_order_and_accept_any_integer_type():
    assert world.parse([2, 0]).ranks == [2, 0]
    assert world.parse(np.arange(3)[::-1]).ranks == [2, 1, 0]
    assert world.parse(range(2)).ranks == [0, 1]
    assert world.parse(None) is None
    assert world.parse([]) is None  # as Horovod: every rank


@pytest.mark.parametrize("comm, error, text", [
    ([0, 0], ValueError, "more than once"),
    ([0, -2], ValueError, "-2"),
    ([1.0], ValueError, "float"),
    ([False], ValueError, "bool"),
    ("01", TypeError, "str"),
    (5, TypeError, "int"),
    ({0: 1}, TypeError, "dict"),
])
def test_bad_lists_are_refused_naming_what_is_wrong(comm, error, text):
    with pytest.raises(error, match=text):
        world.parse(comm)


def test_a_list_must_hold_this_process_and_fit_the_launched_job():
    launched = Topology(rank=1, size=3)
    world.check_member(world.World(ranks=[2, 1]), launched)
    with pytest.raises(ValueError, match=r"does not include this process \(rank 1"):
        world.check_member(world.World(ranks=[0, 2]), launched)
    with pytest.raises(ValueError, match=r"names rank\(s\) \[3\].*3 rank"):
        world.check_member(world.World(ranks=[1, 3]), launched)


def test_disjoint_lists_get_distinct_namespaces_and_the_order_does_not_matter():
    assert world.World(ranks=[0, 2]).tag() == world.World(ranks=[2, 0]).tag()
    assert world.World(ranks=[0, 2]).tag() != world.World(ranks=[1, 3]).tag()


def test_an_mpi_communicator_is_recognised_and_kept():
    MPI = pytest.importorskip("mpi4py.MPI", reason="needs mpi4py (pip install 'hvdlike[mpi]')")
    parsed = world.parse(MPI.COMM_SELF)
    assert parsed.comm is MPI.COMM_SELF and parsed.ranks is None
    assert not world.is_mpi_comm([0, 1])


def test_an_elastic_job_refuses_a_subset_before_touching_anything():
    environ = {"HVDLIKE_ELASTIC_WORKER": "host:0", "HVDLIKE_RANK": "0", "HVDLIKE_SIZE": "2"}
    with pytest.raises(HvdlikeError, match="elastic job"):
        Runtime.build(environ=environ, world=world.World(ranks=[0]))


def test_a_store_hosted_for_part_of_the_job_outlives_that_runtime():
    """Under srun rank 0 hosts the job's store; with init(comm=[0]) the ranks of other
    lists still use it after rank 0's runtime ends, and rank 0's next runtime reuses it."""
    import socket

    from hvdlike.core.job_store import JobStore
    from hvdlike.core.topology import Rendezvous

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rdzv = Rendezvous(launcher="srun", addr="127.0.0.1", port=port, secret="s" * 32,
                      host_store=True)
    launched = Topology(rank=0, size=3)
    part = JobStore(launched, rdzv, 10.0)
    part.keep_server = True
    part.connect().set("k", b"v")
    part.close()
    other = JobStore(Topology(rank=1, size=3), rdzv, 10.0).connect()  # a rank of another list
    assert other.get("k") == b"v"
    again = JobStore(launched, rdzv, 10.0)  # this process's next runtime: no second bind
    assert again.connect().get("k") == b"v"
    again.close()
