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
