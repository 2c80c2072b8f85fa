"""What ranks see: environment forwarding, per-rank variables, ssh quoting."""

import shlex

from hvdlike.core import bootstrap
from hvdlike.launcher import env as rank_env
from hvdlike.launcher.hosts import HostSlots, assign_ranks
from hvdlike.launcher.launch_config import SshOptions
from hvdlike.launcher.ssh_exec import SSH_BURST, remote_helper_command, ssh_command, start_delay

LAUNCHER_ENV = {
    "PATH": "/venv/bin:/usr/bin", "PYTHONPATH": "/src", "VIRTUAL_ENV": "/venv",
    "HVDLIKE_CYCLE_TIME": "2", "MY_SETTING": "x y 'z'", "HOSTNAME": "launcherbox",
    "SSH_AUTH_SOCK": "/tmp/agent", "SSH_CONNECTION": "1 2 3 4", "DISPLAY": ":0",
    "HVDLIKE_RANK": "7", "HVDLIKE_JOB_SECRET": "old", "OMPI_COMM_WORLD_RANK": "1",
    "BASH_FUNC_foo%%": "() { :; }",
}


def test_remote_forwarding_keeps_user_variables_and_drops_host_specific():
    base = rank_env.base_environment(LAUNCHER_ENV, remote=True)
    assert {"PATH", "PYTHONPATH", "VIRTUAL_ENV", "HVDLIKE_CYCLE_TIME", "MY_SETTING"} <= set(base)
    for name in ("HOSTNAME", "SSH_AUTH_SOCK", "SSH_CONNECTION", "DISPLAY", "HVDLIKE_RANK",
                 "HVDLIKE_JOB_SECRET", "OMPI_COMM_WORLD_RANK", "BASH_FUNC_foo%%"):
        assert name not in base


def test_local_ranks_keep_everything_but_old_job_variables():
    base = rank_env.base_environment(LAUNCHER_ENV, remote=False)
    assert base["HOSTNAME"] == "launcherbox"
    assert "HVDLIKE_RANK" not in base and "HVDLIKE_JOB_SECRET" not in base


def test_rank_environment_uses_the_bootstrap_contract():
    placement = assign_ranks([HostSlots("a", 2), HostSlots("b", 2)], 4)[2]
    env = rank_env.rank_environment({"PATH": "/bin"}, placement, "10.0.0.1", 1234, "s3cret",
                                    gloo_iface="eth1", knobs={"HVDLIKE_CYCLE_TIME": "3"})
    topo, rdzv = bootstrap.from_hvdlike_run(env)
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (2, 4, 0, 2)
    assert (topo.cross_rank, topo.cross_size, topo.hostname) == (1, 2, "b")
    assert (rdzv.addr, rdzv.port, rdzv.secret, rdzv.gloo_iface) == ("10.0.0.1", 1234, "s3cret", "eth1")
    assert env["HVDLIKE_CYCLE_TIME"] == "3" and env["PATH"] == "/bin"


def test_redact_hides_the_secret():
    shown = rank_env.redact({bootstrap.ENV_JOB_SECRET: "s3cret", "A": "1"})
    assert shown == {bootstrap.ENV_JOB_SECRET: "<hidden>", "A": "1"}


def test_ssh_command_quotes_and_carries_no_environment():
    argv = ssh_command("user@h1", SshOptions(port=2222, identity_file="/k", options=["A=b"]),
                       ["/opt/my python/bin/python", "-c", "print('x; rm -rf /')"])
    assert argv[0] == "ssh" and argv[-2] == "user@h1"
    assert shlex.split(argv[-1]) == ["/opt/my python/bin/python", "-c", "print('x; rm -rf /')"]
    assert argv.index("A=b") < argv.index("BatchMode=yes")  # user options win in ssh
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == "/k"
    assert any(word.startswith("ConnectTimeout=") for word in argv)


def test_remote_helper_command_line_has_no_secret():
    argv = remote_helper_command("h1", SshOptions(), "/usr/bin/python3")
    assert shlex.split(argv[-1]) == ["/usr/bin/python3", "-m", "hvdlike.launcher.remote"]
    argv = remote_helper_command("h1", SshOptions(), "/usr/bin/python3", "/x/remote.py")
    assert shlex.split(argv[-1]) == ["/usr/bin/python3", "/x/remote.py"]


def test_many_ranks_on_one_host_open_ssh_paced():
    assert [start_delay(i) for i in range(SSH_BURST)] == [0.0] * SSH_BURST
    assert 0 < start_delay(SSH_BURST) < start_delay(SSH_BURST + 1)


def _every_variable_a_launcher_sets_for_its_ranks():
    """What a rank of an elastic hvdlike.run job under hvdlike-run finds in its
    environment from its launchers (the elastic driver's own, the run helper's, the job's)."""
    import types

    from hvdlike.launcher import task
    from hvdlike.launcher.elastic.driver import ElasticDriver

    placement = assign_ranks([HostSlots("a", 2)], 2)[1]
    env = rank_env.rank_environment({}, placement, "10.0.0.1", 1234, "s3cret", gloo_iface="eth1")
    driver = types.SimpleNamespace(settings=types.SimpleNamespace(elastic_timeout=600),
                                   _secrets={"w9": "worker-secret"})
    env.update(ElasticDriver.worker_env(driver, "w9", 5))
    env.update({task.RUN_STORE_ENV: "10.0.0.1:1234", task.RUN_SECRET_ENV: "s3cret"})
    return env


def test_a_launcher_started_inside_a_rank_passes_none_of_the_outer_jobs_variables():
    # A rank of an elastic job that starts a job of its own: its ranks must not take
    # the outer worker id, generation or worker secret for theirs.
    outer = _every_variable_a_launcher_sets_for_its_ranks()
    assert {"HVDLIKE_ELASTIC_WORKER", "HVDLIKE_ELASTIC_GENERATION", "HVDLIKE_ELASTIC_TIMEOUT",
            "HVDLIKE_ELASTIC_WORKER_SECRET"} <= set(outer)
    outer["HVDLIKE_CYCLE_TIME"] = "2"  # a knob is the user's setting: it stays
    for remote in (False, True):
        base = rank_env.base_environment(outer, remote=remote)
        assert base == {"HVDLIKE_CYCLE_TIME": "2"}, (remote, base)


def test_redact_hides_every_secret_a_rank_gets():
    shown = rank_env.redact(_every_variable_a_launcher_sets_for_its_ranks())
    assert "s3cret" not in shown.values() and "worker-secret" not in shown.values()


def test_the_launchers_elastic_variable_names_are_the_elastic_protocols_and_load_no_torch():
    import subprocess
    import sys

    from hvdlike.core.elastic import protocol
    from hvdlike.launcher import env

    assert set(env.ELASTIC_VARIABLES) == {protocol.ENV_WORKER, protocol.ENV_GENERATION,
                                          protocol.ENV_TIMEOUT, protocol.ENV_WORKER_SECRET}
    # The launcher imports torch only where a Ctrl-C is held back (hvdlike.launcher.interrupts).
    probe = ("import sys, hvdlike.launcher.cli, hvdlike.launcher.env, hvdlike.launcher.job; "
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
