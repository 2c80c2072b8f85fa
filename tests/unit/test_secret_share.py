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
    _, rdzv = bootstrap.detect({**env, "HVDLIKE_JOB_SECRET": "shared-by-the-user"})
    assert rdzv.authenticated and rdzv.secret == "shared-by-the-user"


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
