"""The last rank to close a generation deletes its keys without waiting on anyone."""

import json

from hvdlike.core import generation_keys
from tests.local_store import DictStore


class _Log:
    def __init__(self, keys):
        self._keys = keys

    def written(self):
        return list(self._keys)


def test_a_list_removed_by_someone_else_does_not_hold_up_the_last_closer():
    store = DictStore()
    store.set("gen1/a0", "x")
    store.set("gen1/a1", "y")
    assert not generation_keys.forget(store, "gen1/", [_Log(["gen1/a1"])], rank=1, size=2)
    assert json.loads(store.data["gen1/closed/keys/1"]) == ["gen1/a1"]
    del store.data["gen1/closed/keys/1"]  # a process without the secret deleted it
    assert generation_keys.forget(store, "gen1/", [_Log(["gen1/a0"])], rank=0, size=2)
    # what could be found is gone; the key only the removed list named stays
    assert store.data == {"gen1/a1": b"y"}


def test_the_last_closer_deletes_every_ranks_keys():
    store = DictStore()
    for key in ("gen2/a0", "gen2/a1", "gen2/a2"):
        store.set(key, "v")
    assert not generation_keys.forget(store, "gen2/", [_Log(["gen2/a2"])], rank=2, size=3)
    assert not generation_keys.forget(store, "gen2/", [_Log(["gen2/a0"])], rank=0, size=3)
    assert generation_keys.forget(store, "gen2/", [_Log(["gen2/a1"])], rank=1, size=3)
    assert store.data == {}


def test_the_host_waits_until_the_last_closer_is_done_and_no_longer():
    store = DictStore()
    store.set("gen3/a1", "v")
    # rank 0 (hosting the server) counts in first: rank 1 is still to close
    assert not generation_keys.forget(store, "gen3/", [_Log([])], rank=0, size=2)
    assert not generation_keys.wait_closed(store, "gen3/", seconds=0.05)
    deleted = []
    real_delete = store.delete_key
    store.delete_key = lambda key: deleted.append(key) or real_delete(key)
    assert generation_keys.forget(store, "gen3/", [_Log(["gen3/a1"])], rank=1, size=2)
    assert deleted[-1] == "gen3/closed/count"  # its last word: done with the store
    assert generation_keys.wait_closed(store, "gen3/", seconds=0.05)
