"""Host parsing, hostfiles and rank assignment (pure functions)."""

import pytest

from hvdlike.launcher.errors import LaunchError
from hvdlike.launcher.hosts import (
    HostSlots, assign_ranks, parse_hostfile, parse_hosts, read_hostfile,
)


def test_parse_hosts_with_and_without_slots():
    assert parse_hosts("a:4,b") == [HostSlots("a", 4), HostSlots("b", 1)]


def test_parse_hosts_ip_user_and_ipv6():
    assert parse_hosts("10.0.0.1:2, user@h2:3,[fe80::1]:2") == [
        HostSlots("10.0.0.1", 2), HostSlots("user@h2", 3), HostSlots("fe80::1", 2)]


@pytest.mark.parametrize("text, needle", [
    ("", "empty"),
    ("a:0", "positive integer"),
    ("a:-1", "positive integer"),
    ("a:x", "positive integer"),
    ("a:", "positive integer"),
    ("a,,b", "not valid"),
    ("a b:2", "not valid"),
    ("a:2:3", "positive integer"),
    ("a:1,a:2", "twice"),
])
def test_parse_hosts_rejects(text, needle):
    with pytest.raises(LaunchError, match=needle) as info:
        parse_hosts(text)
    assert "\n" not in str(info.value)


def test_hostfile_comments_blank_lines_and_forms():
    text = """
    # cluster
    node1 slots=4   # big one
    node2

    node3:2
    node4 slots=2 max_slots=8
    """
    assert parse_hostfile(text) == [HostSlots("node1", 4), HostSlots("node2", 1),
                                    HostSlots("node3", 2), HostSlots("node4", 2)]


@pytest.mark.parametrize("text, line", [
    ("node1 slots=4\nnode2 slots=zero\n", 2),
    ("node1 cores=4\n", 1),
    ("node1 slots=0\n", 1),
    ("# x\n\n@@@ slots=1\n", 3),
])
def test_hostfile_errors_name_the_line(text, line):
    with pytest.raises(LaunchError, match=f"line {line}"):
        parse_hostfile(text, "hosts.txt")


@pytest.mark.parametrize("entry, needle", [
    ("a..b:1", "'a..b' has an empty part between dots"),
    (".a", "'.a' has an empty part between dots"),
    ("x" * 64 + ":1", "is too long"),
    ("h." + "y" * 250, "is too long"),
    ("-v:1", "cannot start with '-'"),
    ("-oX@h:1", "cannot start with '-'"),
])
def test_host_names_a_resolver_or_ssh_would_fail_on_are_named(entry, needle):
    # These reached getaddrinfo (UnicodeError from its IDNA codec) or ssh (an option).
    with pytest.raises(LaunchError, match=needle):
        parse_hosts(entry)
    with pytest.raises(LaunchError, match="line 1 .*" + needle):
        parse_hostfile(entry.replace(":1", " slots=1"))
    assert parse_hosts("localhost.:2,h-1.example:1") == [HostSlots("localhost.", 2),
                                                         HostSlots("h-1.example", 1)]


def test_bare_ipv6_addresses_in_a_hostfile_and_clear_errors_for_them_in_dash_h():
    # A hostfile gives slots with slots=, so a bare address is unambiguous...
    assert parse_hostfile("::1 slots=2\nfe80::abcd\nu@2001:db8::7 slots=3\n") == [
        HostSlots("::1", 2), HostSlots("fe80::abcd", 1), HostSlots("u@[2001:db8::7]", 3)]
    assert parse_hostfile("[::1] slots=2") == parse_hostfile("::1 slots=2")
    assert parse_hostfile("fe80::1:4 slots=2") == [HostSlots("fe80::1:4", 2)]
    # ...unless its last group could be ':slots' and no slots= says otherwise.
    with pytest.raises(LaunchError, match=r"line 1 .*ambiguous: write \[fe80::1:4\] for the "
                                          r"address, or \[fe80::1\]:4 for its slots"):
        parse_hostfile("fe80::1:4")
    with pytest.raises(LaunchError, match="cannot start with '-'"):
        parse_hostfile("-oX@::1 slots=1")
    # -H separates slots with ':': a bare address is refused with the bracketed spelling.
    with pytest.raises(LaunchError, match=r"goes in brackets: \[fe80::1:4\] or \[fe80::1\]:4\)"):
        parse_hosts("fe80::1:4")
    with pytest.raises(LaunchError, match=r"goes in brackets: \[::1:2\] or \[::1\]:2\)"):
        parse_hosts("::1:2")

    with pytest.raises(LaunchError, match=r"goes in brackets: u@\[fe80::1\]\)"):
        parse_hosts("u@fe80::1")
    assert parse_hosts("[fe80::1]:4") == [HostSlots("fe80::1", 4)]


def test_hostfile_that_is_no_regular_file_or_too_large_is_refused_unopened(tmp_path):
    import os
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would block until a writer came
    with pytest.raises(LaunchError, match="is a FIFO, not a regular file"):
        read_hostfile(str(fifo))
    with pytest.raises(LaunchError, match="is a character device"):
        read_hostfile("/dev/zero")  # read whole, it filled memory
    big = tmp_path / "big"
    big.write_text("h slots=1\n" + "#" * (1 << 20))
    with pytest.raises(LaunchError, match="larger than 1048576 bytes .*the most a hostfile"):
        read_hostfile(str(big))
    with pytest.raises(LaunchError, match="cannot read hostfile .*: no such file"):
        read_hostfile(str(tmp_path / "missing"))


def test_empty_hostfile_is_an_error():
    with pytest.raises(LaunchError, match="no hosts"):
        parse_hostfile("# nothing\n\n")


def _layout(hosts, np):
    return [(p.host, p.topology.local_rank, p.topology.local_size,
             p.topology.cross_rank, p.topology.cross_size) for p in assign_ranks(hosts, np)]


def test_assign_fills_hosts_in_order():
    placements = assign_ranks([HostSlots("a", 2), HostSlots("b", 2)], 4)
    assert [p.rank for p in placements] == [0, 1, 2, 3]
    assert _layout([HostSlots("a", 2), HostSlots("b", 2)], 4) == [
        ("a", 0, 2, 0, 2), ("a", 1, 2, 0, 2), ("b", 0, 2, 1, 2), ("b", 1, 2, 1, 2)]
    assert all(p.topology.size == 4 for p in placements)


def test_assign_uneven_hosts_cross_ranks_follow_horovod():
    # a has 3 ranks, b 1: local rank 0 exists on both hosts, 1 and 2 only on a.
    assert _layout([HostSlots("a", 3), HostSlots("b", 2)], 4) == [
        ("a", 0, 3, 0, 2), ("a", 1, 3, 0, 1), ("a", 2, 3, 0, 1), ("b", 0, 1, 1, 2)]


def test_assign_partial_fill_and_default_np():
    assert [p.host for p in assign_ranks([HostSlots("a", 2), HostSlots("b", 2)], 3)] == [
        "a", "a", "b"]
    assert len(assign_ranks([HostSlots("a", 2), HostSlots("b", 3)], None)) == 5


def test_assign_single_rank_per_host():
    assert _layout([HostSlots("a", 1), HostSlots("b", 1), HostSlots("c", 1)], 3) == [
        ("a", 0, 1, 0, 3), ("b", 0, 1, 1, 3), ("c", 0, 1, 2, 3)]


@pytest.mark.parametrize("np, needle", [(0, "at least 1"), (-2, "at least 1"), (5, "more than the 4")])
def test_assign_rejects_bad_np(np, needle):
    with pytest.raises(LaunchError, match=needle):
        assign_ranks([HostSlots("a", 2), HostSlots("b", 2)], np)


def test_a_local_host_with_another_user_is_reached_over_ssh_as_that_user():
    import getpass

    from hvdlike.launcher.rendezvous import is_local

    me = getpass.getuser()
    assert is_local("localhost") and is_local(f"{me}@localhost")
    # Running the rank here would ignore the user asked for: ssh logs in as them.
    assert not is_local("someone-else-entirely@localhost")
