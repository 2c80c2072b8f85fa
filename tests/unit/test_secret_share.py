"""A torchrun/srun job on one host shares a fresh secret through an owner-only file."""

import os
import stat

import pytest

from hvdlike.core import bootstrap, secret_share
from hvdlike.core.errors import ConfigError

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "unit-test-run", "TORCHELASTIC_RESTART_COUNT": "0"}


def test_rank0_shares_a_random_secret_the_others_read(tmp_path, monkeypatch):
    monkeypatch.setattr(secret_share, "directory", lambda: str(tmp_path))
    tag = f"torchrun/{os.getpid()}"
    mine = secret_share.publish(tag)
    path = secret_share.path_for(tag)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert secret_share.receive(tag, 2) == mine and len(mine) == 32
    assert secret_share.publish(tag) != mine  # a fresh job replaces a stale file
    secret_share.forget(tag)
    assert not os.path.exists(path)


def test_a_file_others_can_read_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(secret_share, "directory", lambda: str(tmp_path))
    path = secret_share.path_for("t")
    with open(path, "w") as f:
        f.write("a" * 32)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="readable or writable by other users"):
        secret_share.receive("t", 1)


def test_no_file_times_out_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(secret_share, "directory", lambda: str(tmp_path))
    with pytest.raises(ConfigError, match="did not share the job secret within"):
        secret_share.receive("absent", 0.2)


def test_torchrun_single_host_gets_a_random_authenticated_secret(tmp_path, monkeypatch):
    monkeypatch.setattr(secret_share, "directory", lambda: str(tmp_path))
    topo0, rdzv0 = bootstrap.detect(TORCHRUN)
    topo1, rdzv1 = bootstrap.detect({**TORCHRUN, "RANK": "1", "LOCAL_RANK": "1"})
    assert rdzv0.secret == rdzv1.secret and rdzv0.authenticated
    assert "unit-test-run" not in rdzv0.secret and rdzv0.secret_file_tag
    assert rdzv0.secret not in repr(rdzv0)
    secret_share.forget(rdzv0.secret_file_tag)


def test_torchrun_multi_host_without_secret_is_public_and_says_so():
    env = {**TORCHRUN, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "2",
           "LOCAL_RANK": "0", "GROUP_RANK": "1"}
    _, rdzv = bootstrap.detect(env)
    assert not rdzv.authenticated
    given = {**env, "HVDLIKE_JOB_SECRET": "shared-by-the-user"}
    _, rdzv = bootstrap.detect(given)
    assert rdzv.authenticated and rdzv.secret.startswith("shared-by-the-user")
    # torchrun's store outlives a restart: each attempt keys its own namespace,
    # the same on every rank of the attempt.
    _, peer = bootstrap.detect({**given, "RANK": "0", "GROUP_RANK": "0"})
    _, restarted = bootstrap.detect({**given, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert peer.secret == rdzv.secret != restarted.secret
    # hvdlike-run's secret is per job already and is taken as given
    _, run = bootstrap.detect({"HVDLIKE_RANK": "0", "HVDLIKE_SIZE": "1",
                               "HVDLIKE_JOB_SECRET": "shared-by-the-user"})
    assert run.secret == "shared-by-the-user"


@pytest.mark.parametrize("change,words", [
    ({"LOCAL_WORLD_SIZE": "abc"}, "LOCAL_WORLD_SIZE='abc' is not valid: expected an integer"),
    ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not valid"),
    ({"GROUP_RANK": "x"}, "GROUP_RANK='x' is not valid"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a TCP port"),
    ({"MASTER_PORT": "-5"}, "MASTER_PORT=-5 is not a TCP port"),
    ({"LOCAL_RANK": "2"}, "local rank 2 is outside 0..1"),
])
def test_malformed_torchrun_variables_are_named(change, words):
    with pytest.raises(ConfigError, match=words):
        bootstrap.detect({**TORCHRUN, "HVDLIKE_JOB_SECRET": "s", **change})


def test_env_convention_without_torchrun_has_rank_0_serve_the_store():
    env = {k: v for k, v in TORCHRUN.items() if not k.startswith("TORCHELASTIC")}
    env["HVDLIKE_JOB_SECRET"] = "s"
    assert bootstrap.detect(env)[1].host_store
    assert not bootstrap.detect({**env, "RANK": "1", "LOCAL_RANK": "1"})[1].host_store
    assert not bootstrap.detect({**TORCHRUN, "HVDLIKE_JOB_SECRET": "s"})[1].host_store


def test_a_file_whose_writer_is_gone_is_not_taken(tmp_path, monkeypatch):
    # A rank 0 SIGKILLed during start-up left its file: the next job's ranks
    # wait for their own rank 0 instead of taking a dead job's secret.
    monkeypatch.setattr(secret_share, "directory", lambda: str(tmp_path))
    path = secret_share.path_for("stale")
    with open(path, "w") as f:
        f.write("a" * 32 + f"\n{_ended_pid()}\n")
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="did not share the job secret within"):
        secret_share.receive("stale", 0.3)
    mine = secret_share.publish("stale")  # this job's rank 0 replaces it
    assert secret_share.receive("stale", 1) == mine


def test_a_fifo_at_the_path_is_refused_at_once(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(secret_share, "directory", lambda: str(tmp_path))
    os.mkfifo(secret_share.path_for("fifo"), 0o600)
    outcome = []

    def attempt(call):
        try:
            call()
        except ConfigError as exc:
            outcome.append(str(exc))

    for call in (lambda: secret_share.receive("fifo", 5), lambda: secret_share.publish("fifo")):
        worker = threading.Thread(target=attempt, args=(call,), daemon=True)
        worker.start()
        worker.join(10)  # a blocking open of a FIFO never returns: a hang guard
        assert not worker.is_alive(), "opening a FIFO at the secret path blocked"
    assert len(outcome) == 2 and all("is not a regular file" in m for m in outcome), outcome


def _ended_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_file_left_by_a_killed_rank_0_is_removed_by_the_next_one(tmp_path, monkeypatch):
    # A rank 0 killed during start-up (SIGKILL; SIGTERM from scancel) cannot
    # delete its file; the next rank 0 of this user removes every file whose
    # writer is gone, and nothing else.
    monkeypatch.setattr(secret_share, "directory", lambda: str(tmp_path))
    secret_share.publish("live")  # this process wrote it: it stays
    dead = tmp_path / (secret_share._prefix() + "0" * 20)
    dead.write_text("a" * 32 + f"\n{_ended_pid()}\n")
    os.chmod(dead, 0o600)
    foreign = tmp_path / (secret_share._prefix() + "1" * 20)
    foreign.write_text("not written by hvdlike")  # no writer named: left alone
    os.chmod(foreign, 0o600)
    open_to_all = tmp_path / (secret_share._prefix() + "2" * 20)
    open_to_all.write_text("b" * 32 + f"\n{_ended_pid()}\n")
    os.chmod(open_to_all, 0o644)  # not a file rank 0 wrote (it writes 0600): left alone
    other_user = tmp_path / "hvdlike-secret-99999-abc"
    other_user.write_text("c" * 32 + f"\n{_ended_pid()}\n")
    os.chmod(other_user, 0o600)
    secret_share.publish("next")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert dead.name not in left
    assert {foreign.name, open_to_all.name, other_user.name,
            os.path.basename(secret_share.path_for("live")),
            os.path.basename(secret_share.path_for("next"))} == set(left)
    assert secret_share.receive("live", 1) != secret_share.receive("next", 1)
    assert secret_share.sweep() == 0  # both writers (this process) still run
