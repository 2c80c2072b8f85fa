"""The authenticated store view: derived prefixes, signed values, fail-closed reads."""

import torch.distributed as dist
import pytest

from hvdlike.core.job_secret import derive, job_tag, key_prefix
from hvdlike.core.store_auth import AuthenticatedStore, StoreTamperedError

SECRET = "0123456789abcdef0123456789abcdef"


def _raw_keys(store, auth):
    return [k for k in store.list_keys()] if hasattr(store, "list_keys") else None


@pytest.fixture
def tcp():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    yield store


def test_the_secret_never_reaches_the_store(tcp):
    auth = AuthenticatedStore(tcp, SECRET)
    scoped = dist.PrefixStore("gen1/", auth)
    scoped.set("health/abort", "stop")
    scoped.add("health/hb/0", 3)
    for key in tcp.list_keys():
        assert SECRET not in key
        assert SECRET.encode() not in tcp.get(key)
    assert all(k.startswith(key_prefix(SECRET)) for k in tcp.list_keys())


def test_derivations_are_distinct_and_depend_on_the_secret():
    assert key_prefix(SECRET) != key_prefix(SECRET[::-1])
    assert derive(SECRET, "a") != derive(SECRET, "b")
    assert job_tag(SECRET) not in key_prefix(SECRET)


def test_round_trip_and_counters(tcp):
    auth = AuthenticatedStore(tcp, SECRET)
    auth.set("k", b"\x00\xffvalue")
    assert auth.get("k") == b"\x00\xffvalue"
    assert [auth.add("c", 1), auth.add("c", 5), auth.add("c", 0)] == [1, 6, 6]


def test_unsigned_value_is_refused_naming_the_key(tcp):
    auth = AuthenticatedStore(tcp, SECRET)
    tcp.set(key_prefix(SECRET) + "health/abort", "attacker says stop")
    with pytest.raises(StoreTamperedError, match="'health/abort'.*did not write"):
        auth.get("health/abort")


def test_value_signed_with_another_secret_is_refused(tcp):
    mine = AuthenticatedStore(tcp, SECRET)
    other = AuthenticatedStore(tcp, "guessed-secret")
    blob = other.seal("health/abort", "stop")
    tcp.set(key_prefix(SECRET) + "health/abort", blob)
    with pytest.raises(StoreTamperedError, match="does not match"):
        mine.get("health/abort")


def test_replay_into_another_key_or_generation_is_refused(tcp):
    auth = AuthenticatedStore(tcp, SECRET)
    gen1, gen2 = dist.PrefixStore("gen1/", auth), dist.PrefixStore("gen2/", auth)
    gen1.set("health/abort", "stalled")
    prefix = key_prefix(SECRET)
    valid = tcp.get(prefix + "gen1//health/abort")
    tcp.set(prefix + "gen2//health/abort", valid)     # same record, next generation
    tcp.set(prefix + "gen1//health/host/1", valid)    # same generation, another key
    with pytest.raises(StoreTamperedError):
        gen2.get("health/abort")
    with pytest.raises(StoreTamperedError):
        gen1.get("health/host/1")
    assert gen1.get("health/abort") == b"stalled"


def test_truncated_and_altered_values_are_refused(tcp):
    auth = AuthenticatedStore(tcp, SECRET)
    auth.set("k", b"abcdef")
    full = key_prefix(SECRET) + "k"
    blob = tcp.get(full)
    tcp.set(full, blob[:10])
    with pytest.raises(StoreTamperedError):
        auth.get("k")
    tcp.set(full, blob[:-1] + b"X")
    with pytest.raises(StoreTamperedError):
        auth.get("k")


def test_forged_counter_is_refused(tcp):
    auth = AuthenticatedStore(tcp, SECRET)
    auth.add("hb", 1)
    tcp.set(key_prefix(SECRET) + "hb", "999")
    with pytest.raises(StoreTamperedError, match="'hb'"):
        auth.add("hb", 0)
    tcp.set(key_prefix(SECRET) + "hb", "")  # a blank must not reset it either
    with pytest.raises(StoreTamperedError, match="'hb'"):
        auth.add("hb", 1)


def test_oversized_value_is_refused_before_use(tcp):
    auth = AuthenticatedStore(tcp, SECRET, max_value_bytes=1024)
    auth.set("big", b"x" * 4096)  # even a value we signed ourselves
    with pytest.raises(StoreTamperedError, match="more than the 1024"):
        auth.get("big")
    assert len(auth.get_limited("big", 8192)) == 4096


def test_gloo_address_records_go_through_the_view(tcp):
    auth = AuthenticatedStore(tcp, SECRET)
    group = dist.ProcessGroupGloo(dist.PrefixStore("g/", auth), 0, 1,
                                  __import__("datetime").timedelta(seconds=10))
    import torch

    t = torch.ones(2)
    group.allreduce([t]).wait()
    assert t.tolist() == [1.0, 1.0]
    assert all(k.startswith(key_prefix(SECRET)) for k in tcp.list_keys())


def test_concurrent_increments_from_an_absent_counter_are_not_lost(tcp):
    class StaleOnce:
        """A connection whose first look at the counter predates the other client's write."""

        def __init__(self, inner):
            self.inner, self.stale = inner, True

        def check(self, keys):
            if self.stale:
                self.stale = False
                return False
            return self.inner.check(keys)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    first = AuthenticatedStore(tcp, SECRET)
    second = AuthenticatedStore(StaleOnce(tcp), SECRET)
    assert first.add("n", 1) == 1
    assert second.add("n", 1) == 2  # its compare-and-set lost, it retried
    assert first.add("n", 0) == 2
