"""hvdlike.run payloads: HMAC under the job secret, refused when forged or replayed."""

import pytest

from hvdlike.launcher.payload import PayloadError, seal, unseal


def test_round_trip_with_closure():
    k = 3
    blob = seal("secret-a", "payload", (lambda x: x * k, (2,), {}))
    fn, args, kwargs = unseal("secret-a", "payload", blob)
    assert fn(*args, **kwargs) == 6


def test_tampered_payload_is_refused():
    blob = bytearray(seal("secret-a", "payload", ("data",)))
    blob[-2] ^= 0xFF
    with pytest.raises(PayloadError, match="authentication failed"):
        unseal("secret-a", "payload", bytes(blob))


def test_forged_payload_without_the_secret_is_refused():
    with pytest.raises(PayloadError):
        unseal("secret-a", "payload", seal("guess", "payload", ("evil",)))


def test_payload_replayed_into_another_job_is_refused():
    old_job = seal("secret-of-job-1", "payload", ("fn",))
    with pytest.raises(PayloadError):
        unseal("secret-of-job-2", "payload", old_job)


def test_result_cannot_pose_as_another_rank_or_as_payload():
    result = seal("s", "result/0", {"ok": True, "value": 1})
    with pytest.raises(PayloadError):
        unseal("s", "result/1", result)
    with pytest.raises(PayloadError):
        unseal("s", "payload", result)


def test_no_secret_no_unpickling():
    with pytest.raises(PayloadError, match="no job secret"):
        unseal("", "payload", b"x" * 64)
    with pytest.raises(PayloadError, match="truncated"):
        unseal("s", "payload", b"short")
