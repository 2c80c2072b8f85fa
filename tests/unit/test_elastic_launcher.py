"""Elastic launcher parts without processes: discovery, blacklist, assignment, flags."""

import pytest

from hvdlike.launcher.cli import build_parser, to_config
from hvdlike.launcher.elastic.assignment import Slot, assign, placements
from hvdlike.launcher.elastic.discovery import LastGood, ScriptDiscovery, parse_discovery_output
from hvdlike.launcher.elastic.host_table import HostTable
from hvdlike.launcher.errors import LaunchError
from hvdlike.launcher.hosts import HostSlots


def _ids():
    n = 100
    while True:
        yield f"w{n}"
        n += 1


# -- discovery -------------------------------------------------------------------------


def test_discovery_output_slots_default_and_explicit():
    text = "# cluster\nhost-a:4\nhost-b\n\nhost-c slots=2\n"
    assert parse_discovery_output(text, None, "d.sh") == [
        HostSlots("host-a", 4), HostSlots("host-b", 1), HostSlots("host-c", 2)]
    assert parse_discovery_output(text, 3, "d.sh")[1] == HostSlots("host-b", 3)
    assert parse_discovery_output(text, 3, "d.sh")[0] == HostSlots("host-a", 4)
    assert parse_discovery_output("", 2, "d.sh") == []


def test_discovery_output_errors_name_the_line():
    with pytest.raises(LaunchError, match=r"'d.sh' output line 2 .*'b:x'"):
        parse_discovery_output("a:1\nb:x\n", None, "d.sh")
    with pytest.raises(LaunchError, match="names host 'a' twice"):
        parse_discovery_output("a:1\na:2\n", None, "d.sh")


def test_failing_script_first_run_raises_later_runs_keep_last_good():
    results = [(0, "a:2\n", ""), (3, "", "boom\n"), (0, "a:2\nb:2\n", "")]
    script = ScriptDiscovery("d.sh", run=lambda argv, timeout: results.pop(0))
    warnings = []
    source = LastGood(script, warnings.append)
    assert source.find() == [HostSlots("a", 2)]
    assert source.find() == [HostSlots("a", 2)]
    assert warnings == ["host discovery script 'd.sh' exited with code 3: boom; "
                        "keeping the last good host list"]
    assert source.find() == [HostSlots("a", 2), HostSlots("b", 2)]
    assert warnings[-1] == "host discovery works again"

    first = LastGood(ScriptDiscovery("d.sh", run=lambda argv, t: (1, "", "no\n")), warnings.append)
    with pytest.raises(LaunchError, match="exited with code 1: no"):
        first.find()


def test_missing_script_is_a_clear_error():
    with pytest.raises(LaunchError, match="'/nonexistent/d.sh' cannot run"):
        ScriptDiscovery("/nonexistent/d.sh").find()


# -- blacklist -------------------------------------------------------------------------


def test_blacklist_without_cooldown_is_forever():
    table = HostTable()
    table.update([HostSlots("a", 2), HostSlots("b", 2)])
    assert table.blacklist("b", now=0.0) is None
    assert table.available(1e9) == [HostSlots("a", 2)]
    assert not table.hopeless(0.0)
    table.blacklist("a", now=0.0)
    assert table.hopeless(0.0)


def test_blacklist_cooldown_returns_the_host_and_doubles():
    table = HostTable((10.0, 20.0), draw=lambda lo, hi: lo)
    table.update([HostSlots("a", 1)])
    assert table.blacklist("a", now=100.0) == 110.0
    assert table.available(105.0) == [] and not table.hopeless(105.0)
    assert table.available(110.0) == [HostSlots("a", 1)]
    assert table.blacklist("a", now=200.0) == 220.0  # second failure: twice as long


def test_a_dropped_slot_stays_out_for_good_or_for_its_cooldown():
    forever = HostTable()
    forever.update([HostSlots("a", 2)])
    assert forever.drop_slot(Slot("a", 1), now=0.0) is None
    assert forever.dropped_slots(1e9) == {Slot("a", 1)}
    assert forever.available(1e9) == [HostSlots("a", 2)]  # the host itself stays
    table = HostTable((10.0, 20.0), draw=lambda lo, hi: lo)
    table.update([HostSlots("a", 2)])
    assert table.drop_slot(Slot("a", 1), now=100.0) == 110.0
    assert table.dropped_slots(109.0) == {Slot("a", 1)}
    assert table.dropped_slots(110.0) == set()  # back, and forgotten
    assert table.drop_slot(Slot("a", 0), now=200.0) == 220.0  # the host's second drop


def test_update_reports_change():
    table = HostTable()
    assert table.update([HostSlots("a", 1)])
    assert not table.update([HostSlots("a", 1)])
    assert table.update([HostSlots("a", 2)])


# -- assignment ------------------------------------------------------------------------


def test_first_generation_fills_hosts_in_order():
    members = assign([], [HostSlots("a", 2), HostSlots("b", 2)], 3, _ids())
    assert [(m.worker, m.slot, m.new) for m in members] == [
        ("w100", Slot("a", 0), True), ("w101", Slot("a", 1), True), ("w102", Slot("b", 0), True)]


def test_survivors_keep_their_slots_and_order_new_ranks_only_on_new_slots():
    survivors = [("w5", Slot("b", 1)), ("w2", Slot("a", 0))]
    hosts = [HostSlots("a", 2), HostSlots("b", 2), HostSlots("c", 1)]
    members = assign(survivors, hosts, 10, _ids())
    assert [m.worker for m in members[:2]] == ["w5", "w2"]  # old order, rank 0 unchanged
    assert [m.slot for m in members[2:]] == [Slot("a", 1), Slot("b", 0), Slot("c", 0)]
    assert all(m.new for m in members[2:])
    places = placements(members)
    assert places["w5"].rank == 0 and places["w2"].rank == 1
    assert places["w5"].topology.local_rank == 0 and places["w5"].topology.local_size == 2


def test_survivors_on_removed_hosts_are_dropped_and_max_np_caps():
    survivors = [("w0", Slot("a", 0)), ("w1", Slot("b", 0)), ("w2", Slot("a", 1))]
    members = assign(survivors, [HostSlots("a", 1), HostSlots("c", 4)], 3, _ids())
    assert [m.worker for m in members] == ["w0", "w100", "w101"]
    assert [m.slot for m in members] == [Slot("a", 0), Slot("c", 0), Slot("c", 1)]


# -- flags -----------------------------------------------------------------------------


def _config(argv):
    return to_config(build_parser().parse_args(argv))


def test_elastic_flags_build_settings(tmp_path):
    cfg = _config(["--min-np", "2", "--max-np", "4", "--host-discovery-script", "d.sh",
                   "--slots-per-host", "2", "--reset-limit", "3", "--elastic-timeout", "9",
                   "--blacklist-cooldown-range", "5", "10", "python", "t.py"])
    e = cfg.elastic
    assert (e.min_np, e.max_np, e.np, e.discovery_script, e.slots_per_host, e.reset_limit,
            e.elastic_timeout, e.cooldown_range) == (2, 4, 2, "d.sh", 2, 3, 9.0, (5.0, 10.0))
    assert _config(["-np", "2", "python", "t.py"]).elastic is None
    fixed = _config(["-np", "3", "--min-np", "2", "-H", "a:2,b:2", "python", "t.py"]).elastic
    assert (fixed.np, fixed.min_np, fixed.discovery_script) == (3, 2, None)


@pytest.mark.parametrize("argv, message", [
    (["--min-np", "3", "--max-np", "2"], "--max-np 2 is less than --min-np 3"),
    (["-np", "5", "--min-np", "2", "--max-np", "4"], "-np 5 is more than --max-np 4"),
    (["-np", "2", "--max-np", "1"], "-np 2 is more than --max-np 1"),
    (["-np", "1", "--min-np", "2"], "-np 1 is less than --min-np 2"),
    (["--min-np", "2", "--blacklist-cooldown-range", "9", "3"], "cooldown-range 9 3 is not valid"),
    (["-np", "2", "--reset-limit", "2"], "--reset-limit needs an elastic job"),
    (["--host-discovery-script", "d.sh", "-H", "a"], "cannot be used together"),
    (["--mpi", "--min-np", "2"], "--mpi cannot run an elastic job"),
])
def test_bad_elastic_flags(argv, message):
    with pytest.raises(LaunchError, match=message.replace("-", r"\-")):
        _config(argv + ["python", "t.py"])


def test_a_discovery_script_named_without_a_directory_runs_from_the_working_one(
        tmp_path, monkeypatch):
    script = tmp_path / "find.sh"
    script.write_text("#!/bin/sh\necho h1:2\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)  # not on PATH: it was looked up there and "not found"
    assert ScriptDiscovery("find.sh").find() == [HostSlots("h1", 2)]


def test_an_elastic_job_with_fewer_slots_than_np_says_it_starts_smaller():
    from hvdlike.launcher.elastic.launch import discovery_for

    config = _config(["-np", "3", "--min-np", "1", "-H", "localhost:2", "python", "t.py"])
    notes = []
    _, placed = discovery_for(config, config.elastic, notes.append)
    assert placed.np == 2
    assert notes == ["-np 3: 2 slot(s) found; starting with 2, more as slots appear"]
    notes.clear()
    config = _config(["-np", "2", "--min-np", "1", "-H", "localhost:2", "python", "t.py"])
    discovery_for(config, config.elastic, notes.append)
    assert notes == []


def _script(tmp_path, body: str, shell: str = "/bin/sh") -> str:
    path = tmp_path / "discover.sh"
    path.write_text(f"#!{shell}\n" + body)
    path.chmod(0o755)
    return str(path)


def test_a_discovery_script_printing_bytes_that_are_not_utf8_is_a_malformed_line(tmp_path):
    script = _script(tmp_path, "printf 'good:1\\n\\377\\376\\n'\n")
    with pytest.raises(LaunchError, match="output line 2 .* is not valid: expected"):
        ScriptDiscovery(script).find()


def test_a_discovery_script_printing_megabytes_is_refused_without_quoting_them(tmp_path):
    script = _script(tmp_path, "head -c 5000000 /dev/zero | tr '\\\\0' a\n")
    with pytest.raises(LaunchError, match="printed more than 1048576 bytes") as info:
        ScriptDiscovery(script).find()
    assert len(str(info.value)) < 500
    long_line = _script(tmp_path, "printf 'x%.0s' $(seq 1 5000); echo\n")
    with pytest.raises(LaunchError, match=r"\(5000 characters\)\): host name") as info:
        ScriptDiscovery(long_line).find()
    assert len(str(info.value)) < 500


def test_a_discovery_script_that_times_out_leaves_nothing_running(tmp_path):
    import psutil

    from hvdlike.launcher.elastic import discovery

    tag = f"{tmp_path.name}-background"
    script = _script(tmp_path, f"echo localhost:1\nexec -a {tag}a sleep 91 &\n"
                               f"exec -a {tag}b sleep 92\n", shell="/bin/bash")
    with pytest.raises(discovery.subprocess.TimeoutExpired):
        discovery._run_script([script], 1.0)
    for _ in range(50):
        left = [p for p in psutil.process_iter(["cmdline"])
                if any(tag in part for part in (p.info["cmdline"] or []))]
        if not left:
            break
        discovery.threading.Event().wait(0.1)
    assert left == []


def test_excluded_slots_are_given_to_nobody():
    # the slot of a process that never started up, on a host whose other slots are in use
    members = assign([("w0", Slot("a", 0))], [HostSlots("a", 3)], 10, _ids(),
                     excluded={Slot("a", 1)})
    assert [(m.worker, m.slot) for m in members] == [("w0", Slot("a", 0)), ("w100", Slot("a", 2))]
    survivors = assign([("w0", Slot("a", 1))], [HostSlots("a", 2)], 10, _ids(),
                       excluded={Slot("a", 1)})
    assert [m.slot for m in survivors] == [Slot("a", 0)] and survivors[0].new
