"""hvdlike.run tells a rank that refused its payload from a function's own exit status.

A refusing rank exits with status 3, which any function can produce too
(``os._exit(3)``): the refusal is reported only when the rank recorded it in the
job's store, sealed under the job secret like a result.
"""

import types

import pytest

from hvdlike.launcher import api, task
from hvdlike.launcher.payload import refusal_key, refusal_purpose, seal


class _Store:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = bytes(value)

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def _job(secret, ranks):
    placements = [types.SimpleNamespace(rank=r, host="localhost") for r in range(ranks)]
    return types.SimpleNamespace(secret=secret, placements=placements)


def _exited(rank, code):
    return types.SimpleNamespace(rank=rank, host="localhost", exit_code=code, remote=False,
                                 stderr_tail=[])


def test_a_recorded_refusal_is_reported_as_one(monkeypatch):
    store = _Store()
    monkeypatch.delenv("HVDLIKE_ELASTIC_GENERATION", raising=False)
    task._record_refusal(store, "s3cret", 1, "payload: authentication failed")
    job = _job("s3cret", 2)
    outcomes = api.gather(job, store, [0, 1], None, lambda r: "localhost")
    result = types.SimpleNamespace(failure=_exited(1, task.REFUSED), workers=[_exited(1, 3)])
    with pytest.raises(api.RankError, match=r"^rank 1 \(host localhost\) refused its payload: "
                                            r"it failed authentication.*authentication failed"):
        api._collect(job, result, outcomes)


def test_status_three_without_a_record_is_a_plain_exit():
    job = _job("s3cret", 2)
    outcomes = api.gather(job, _Store(), [0, 1], None, lambda r: "localhost")
    assert outcomes == {}
    result = types.SimpleNamespace(failure=_exited(1, 3), workers=[_exited(1, 3)])
    with pytest.raises(api.RankError) as info:
        api._collect(job, result, outcomes)
    assert str(info.value) == "rank 1 (host localhost) exited with code 3 without a result"


def test_a_refusal_record_sealed_with_another_secret_is_not_believed():
    store = _Store()
    store.set(refusal_key(0), seal("not-the-secret", refusal_purpose(0), "forged"))
    with pytest.raises(api.RankError, match="recorded a refusal that failed authentication"):
        api.gather(_job("s3cret", 1), store, [0], None, lambda r: "localhost")
