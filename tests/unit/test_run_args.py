"""hvdlike.run's Horovod arguments: how each maps onto the launch, and what is refused
before anything starts."""

import os

import pytest

import hvdlike
from hvdlike.launcher import run_args
from hvdlike.launcher.errors import LaunchError
from hvdlike.launcher.hosts import HostSlots


def _noop():
    return None


def test_num_proc_and_its_older_name_np_are_one_setting():
    got = run_args.horovod_arguments(4, None, None, None, None, None, None, None)
    assert got == {"np": 4, "min_np": None, "max_np": None, "python": None}
    assert run_args.horovod_arguments(None, 3, None, 2, None, 5, None, None)["np"] == 3
    got = run_args.horovod_arguments(3, 3, 2, 2, 6, None, None, None)
    assert (got["np"], got["min_np"], got["max_np"]) == (3, 2, 6)
    with pytest.raises(LaunchError, match=r"num_proc=4 and np=2 disagree"):
        run_args.horovod_arguments(4, 2, None, None, None, None, None, None)
    with pytest.raises(LaunchError, match=r"min_num_proc=1 and min_np=2 disagree"):
        run_args.horovod_arguments(None, None, 1, 2, None, None, None, None)


def test_counts_are_checked_under_the_name_the_caller_used():
    with pytest.raises(LaunchError, match=r"num_proc must be an int, got '2' \(str\)"):
        run_args.horovod_arguments("2", None, None, None, None, None, None, None)
    with pytest.raises(LaunchError, match=r"hvdlike.run: np must be an int, got True"):
        run_args.horovod_arguments(None, True, None, None, None, None, None, None)
    with pytest.raises(LaunchError, match=r"max_np 0 is not valid: expected at least 1"):
        run_args.horovod_arguments(None, None, None, None, None, 0, None, None)


def test_executable_is_the_python_that_runs_the_ranks():
    assert run_args.horovod_arguments(None, 2, None, None, None, None, "/x/python",
                                      None)["python"] == "/x/python"
    with pytest.raises(LaunchError, match=r"executable='/a' and python='/b' disagree"):
        run_args.horovod_arguments(None, 2, None, None, None, None, "/a", "/b")
    with pytest.raises(LaunchError, match=r"executable is empty"):
        run_args.horovod_arguments(None, 2, None, None, None, None, " ", None)


def test_use_gloo_and_use_mpi_choose_the_engine():
    assert run_args.engine(None, None) is False
    assert run_args.engine(True, False) is False
    assert run_args.engine(False, True) is True
    with pytest.raises(LaunchError, match="use_gloo and use_mpi cannot both be set"):
        run_args.engine(True, True)


def test_network_interfaces_as_a_list_or_horovods_older_comma_string():
    assert run_args.interfaces("", None) == []
    assert run_args.interfaces("eth1", None) == ["eth1"]
    assert run_args.interfaces("eth1,eth2", None) == ["eth1", "eth2"]
    assert run_args.interfaces(None, ["lo", "eth0"]) == ["lo", "eth0"]
    assert run_args.interfaces(None, "eth3") == ["eth3"]
    # both given: their union, each once, as horovodrun's repeated flags
    assert run_args.interfaces("eth0,lo", ["eth1", "eth0"]) == ["eth0", "lo", "eth1"]
    with pytest.raises(LaunchError, match=r"list of interface names, got \[1\]"):
        run_args.interfaces(None, [1])
    with pytest.raises(LaunchError, match="names no interface"):
        run_args.interfaces(None, [" "])
    with pytest.raises(LaunchError, match="network_interfaces must be a list"):
        run_args.interfaces(None, 5)


def test_hosts_hostfile_or_localhost(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1 slots=2\n127.0.0.2 slots=1\n")
    assert run_args.host_list(None, str(hostfile), None) == [
        HostSlots("127.0.0.1", 2), HostSlots("127.0.0.2", 1)]
    assert run_args.host_list("a:1,b:3", None, None) == [HostSlots("a", 1), HostSlots("b", 3)]
    assert run_args.host_list(None, None, 3) == [HostSlots("localhost", 3)]
    assert run_args.host_list(None, None, None) == [HostSlots("localhost", 1)]  # as Horovod
    with pytest.raises(LaunchError, match="pass hosts or hostfile, not both"):
        run_args.host_list("a:1", str(hostfile), None)
    with pytest.raises(LaunchError, match="list of HostSlots"):
        run_args.host_list([("a", 1)], None, None)
    with pytest.raises(LaunchError):
        run_args.host_list(None, str(tmp_path / "missing"), None)


def test_mpi_args_as_one_string_or_a_list():
    assert run_args.mpi_arguments(None) == []
    assert run_args.mpi_arguments("-x FOO --bind-to 'core'") == ["-x", "FOO", "--bind-to", "core"]
    assert run_args.mpi_arguments(["-iface", "eth1"]) == ["-iface", "eth1"]
    with pytest.raises(LaunchError, match="mpi_args .* is not valid"):
        run_args.mpi_arguments("-x 'unbalanced")
    with pytest.raises(LaunchError, match="mpi_args must be a str or a list of str"):
        run_args.mpi_arguments(7)


def test_elastic_arguments_make_an_elastic_job_and_need_one():
    assert run_args.elastic_settings(2, None, None, None, None, None, None, None) is None
    got = run_args.elastic_settings(2, 1, 4, None, 2, 3, (1, 5), 30)
    assert (got.np, got.min_np, got.max_np, got.slots_per_host, got.reset_limit,
            got.cooldown_range, got.elastic_timeout) == (2, 1, 4, 2, 3, (1.0, 5.0), 30.0)
    for name, value in (("slots", 2), ("reset_limit", 1), ("cooldown_range", (1, 2)),
                        ("elastic_timeout", 9)):
        kwargs = {"slots": None, "reset_limit": None, "cooldown_range": None,
                  "elastic_timeout": None, name: value}
        with pytest.raises(LaunchError, match=f"{name} needs an elastic job"):
            run_args.elastic_settings(2, None, None, None, kwargs["slots"],
                                      kwargs["reset_limit"], kwargs["cooldown_range"],
                                      kwargs["elastic_timeout"])
    with pytest.raises(LaunchError, match="cooldown_range must be"):
        run_args.elastic_settings(2, 1, None, None, None, None, "soon", None)
    with pytest.raises(LaunchError, match="reset_limit -1 is not valid"):
        run_args.elastic_settings(2, 1, None, None, None, -1, None, None)
    with pytest.raises(LaunchError, match="hvdlike.run: max_np 1 is less than min_np 2"):
        run_args.elastic_settings(2, 2, 1, None, None, None, None, None)


def test_disable_cache_is_accepted_and_leaves_the_response_cache_alone():
    # horovod.run's disable_cache is about its launcher's cache of host checks
    assert run_args.checked_knobs(None, True) == {}
    assert run_args.checked_knobs({"cache_capacity": 0}, True) == {"cache_capacity": 0}
    assert run_args.checked_knobs({"cycle_time": 1}, None) == {"cycle_time": 1}
    with pytest.raises(TypeError, match="knobs must be a mapping"):
        run_args.checked_knobs([("cycle_time", 1)], None)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_proc=2, np=3), "num_proc=2 and np=3 disagree"),
    (dict(np=2, use_gloo=True, use_mpi=True), "use_gloo and use_mpi cannot both be set"),
    (dict(num_proc=2, min_num_proc=2, use_mpi=True), "use_mpi cannot run an elastic job"),
    (dict(np=2, host_discovery_script="./find.sh", hosts="a:1"),
     "host_discovery_script and hosts/hostfile cannot be used together"),
    (dict(np=2, slots=2), "slots needs an elastic job"),
    (dict(np=2, output_filename=""), "output_filename is empty"),
    (dict(np=2, hosts="a:1", hostfile="f"), "pass hosts or hostfile, not both"),
    # Each of these was a bare TypeError/ValueError, a torch stack, or silently ignored.
    (dict(np=1, start_timeout=-1), r"start_timeout=-1 is not valid: expected seconds > 0"),
    (dict(np=1, start_timeout=0), r"start_timeout=0 is not valid"),
    (dict(np=1, start_timeout=float("nan")), r"start_timeout=nan is not valid"),
    (dict(np=1, start_timeout="abc"), r"start_timeout='abc' is not a number of seconds"),
    (dict(np=1, hosts=5), "hosts must be a 'host:slots,...' string or a list"),
    (dict(np=1, hosts="a..b:1"), "'a..b' has an empty part between dots"),
    (dict(np=1, ssh_options="foo"), "ssh_options must be a list of 'KEY=VALUE' strings"),
    (dict(np=1, ssh_options=["a b=c"]), "ssh_options entry 'a b=c' is not valid"),
    (dict(np=1, ssh_port=0), r"ssh_port=0 is not a TCP port \(1-65535\)"),
    (dict(np=1, ssh_port=True), r"ssh_port=True is not a TCP port"),
    (dict(np=1, knobs={"cycle_time": True}), "this knob takes a value, not on/off"),
    # the checks shared with hvdlike-run name run's arguments, not its flags
    (dict(np=1, hosts=""), r"^hvdlike.run: hosts is empty"),
    (dict(np=1, hosts=" "), r"^hvdlike.run: hosts is empty"),
    (dict(np=2, hosts="localhost:1"),
     r"^hvdlike.run: np 2 is more than the 1 slot\(s\) available \(localhost:1\)$"),
    (dict(np=2, min_np=1, cooldown_range=(5, 1)),
     r"^hvdlike.run: cooldown_range 5 1 is not valid: expected 0 <= LO <= HI$"),
    (dict(np=2, min_np=3), r"^hvdlike.run: np 2 is less than min_np 3$"),
    (dict(np=1, hosts="a:x"), r"^hvdlike.run: hosts entry 'a:x': slots 'x' must be"),
    (dict(np=1, host_discovery_script="/"), r"^hvdlike.run: host_discovery_script /: is a "
                                            r"directory, not an executable script$"),
])
def test_bad_combinations_are_refused_before_anything_starts(kwargs, match):
    before = set(os.listdir("/proc"))
    with pytest.raises(LaunchError, match=match):
        hvdlike.run(_noop, **kwargs)
    started = [p for p in set(os.listdir("/proc")) - before if p.isdigit()]
    children = []
    for pid in started:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                if int(handle.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    children.append(pid)
        except OSError:
            pass
    assert not children, children


def test_mpi_args_without_use_mpi_are_ignored_saying_so(capsys, monkeypatch):
    # As in Horovod they only apply under mpirun; here the call goes on and says so.
    # (Stopped right after the notice: the store is never started.)
    def stop(*_args, **_kwargs):
        raise RuntimeError("stopped before the launch")

    monkeypatch.setattr("hvdlike.launcher.api.Job", stop)
    with pytest.raises(RuntimeError, match="stopped before the launch"):
        hvdlike.run(_noop, np=1, mpi_args="-x FOO")
    assert "mpi_args applies with use_mpi=True only; ignored" in capsys.readouterr().err


def test_flag_names_in_shared_checks_become_run_argument_names():
    assert run_args.in_api_terms("--max-np 1 is less than --min-np 2") == \
        "hvdlike.run: max_np 1 is less than min_np 2"
    assert run_args.in_api_terms("-np 3 is more than ...") == "hvdlike.run: np 3 is more than ..."
    assert run_args.in_api_terms("-i/--ssh-identity-file k: no such file") == \
        "hvdlike.run: ssh_identity_file k: no such file"
    # already in API terms, or a flag-like word inside a value: left alone
    assert run_args.in_api_terms("hvdlike.run: -np x") == "hvdlike.run: -np x"
    assert run_args.in_api_terms("host 'a-np' twice") == "hvdlike.run: host 'a-np' twice"
