"""RayExecutor's start/shutdown bookkeeping with Ray's functions replaced: no cluster.

What matters here is what the executor does NOT call: Ray after ``ray.shutdown()``
(it would start a new local cluster), or reservation before a bad argument is refused.
"""

import pytest

ray = pytest.importorskip("ray")

from hvdlike.core.errors import ConfigError, HvdlikeError  # noqa: E402
from hvdlike.launcher.api import RankError  # noqa: E402
from hvdlike.launcher.hosts import RankPlacement  # noqa: E402
from hvdlike.ray import RayExecutor  # noqa: E402


class _Store:
    closed = False

    def __exit__(self, *exc):
        self.closed = True


def _no_ray_calls(monkeypatch, initialized):
    def refuse(*args, **kwargs):
        raise AssertionError("Ray was called")

    monkeypatch.setattr(ray, "is_initialized", lambda: initialized)
    monkeypatch.setattr(ray, "kill", refuse)
    monkeypatch.setattr(ray, "init", refuse)
    import importlib

    monkeypatch.setattr(importlib.import_module("ray.util.placement_group"),
                        "remove_placement_group", refuse)


def test_shutdown_after_ray_shutdown_only_drops_handles(monkeypatch):
    _no_ray_calls(monkeypatch, initialized=False)
    executor = RayExecutor(RayExecutor.create_settings(), num_workers=2)
    store = _Store()
    executor.workers, executor._pg, executor._own_pg, executor._store = ["a", "b"], "pg", True, store
    executor.shutdown()
    assert (executor.workers, executor._pg, executor._store, store.closed) == ([], None, None, True)

    elastic = RayExecutor(RayExecutor.create_settings(), min_workers=1)
    elastic.elastic.ranks, elastic.elastic.discovery = {"w0": object()}, object()
    elastic.shutdown()
    assert elastic.elastic.ranks == {} and not elastic.elastic.started


def test_start_refuses_before_reserving_anything(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    executor = RayExecutor(RayExecutor.create_settings(nics=["nope0"]), num_workers=1)
    monkeypatch.setattr(executor, "_reserve", lambda ray: pytest.fail("reserved"))
    with pytest.raises(ConfigError, match="nics: interface 'nope0' does not exist"):
        executor.start()
    with pytest.raises(ConfigError, match="extra_env_vars"):
        executor.start(extra_env_vars="NUM=1")

    elastic = RayExecutor(RayExecutor.create_settings(), min_workers=1)
    elastic.elastic.discovery = object()  # as after a successful start()
    with pytest.raises(HvdlikeError, match="already started; call shutdown"):
        elastic.start(extra_env_vars={"FOO": "bar"})


def test_a_ray_error_of_a_rank_is_a_rank_error_naming_it(monkeypatch):
    executor = RayExecutor(RayExecutor.create_settings(), num_workers=2)
    executor.placements = [RankPlacement("h0", None), RankPlacement("h1", None)]

    def get(ref):
        if ref == "r1":
            raise ray.exceptions.RaySystemError("cannot serialize\nray's stack")
        return {"ok": True, "value": 0}

    monkeypatch.setattr(ray, "wait", lambda pending, num_returns: (
        [pending[-1]], pending[:-1]))
    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(RankError, match=r"^rank 1 \(host h1\) failed in Ray: RaySystemError: "
                                        r"System error: cannot serialize$") as caught:
        executor._check_all(["r0", "r1"])
    assert caught.value.rank == 1
