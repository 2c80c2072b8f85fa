"""hvdlike.ray's argument checks and pure helpers: no Ray cluster is started.

Each check refuses a value at once with the parameter named, where it used to
pass it on to fail later with Python's own error or a launcher flag's name.
"""

import threading

import pytest

from hvdlike.core.errors import ConfigError, HvdlikeError
from hvdlike.ray import ElasticRayExecutor, RayExecutor, RaySettings
from hvdlike.ray import checks
from hvdlike.ray.callbacks import check as check_callbacks
from hvdlike.ray.executor import visible_devices
from hvdlike.ray.worker import UNPICKLABLE, outcome_of

NAN = float("nan")


@pytest.mark.parametrize("kwargs, named", [
    (dict(timeout_s="30"), "timeout_s='30'"), (dict(timeout_s=NAN), "timeout_s=nan"),
    (dict(timeout_s=True), "timeout_s=True"), (dict(timeout_s=-1), "timeout_s=-1"),
    (dict(placement_group_timeout_s=float("inf")), "placement_group_timeout_s=inf"),
    (dict(nics=["lo", "eth0"]), "exactly one"), (dict(nics=3), "nics=3"),
])
def test_create_settings_refuses_bad_values_naming_them(kwargs, named):
    with pytest.raises(ConfigError, match=f"create_settings: {named}" if "=" in named else named):
        RayExecutor.create_settings(**kwargs)


def test_a_string_nics_is_one_interface_not_its_letters():
    assert RayExecutor.create_settings(nics="eth0").nics == ["eth0"]
    assert RayExecutor.create_settings(nics={"lo"}).nics == ["lo"]
    assert RaySettings(timeout_s=5).timeout_s == 5.0
    with pytest.raises(ConfigError, match="RaySettings: timeout_s=0"):
        RaySettings(timeout_s=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_workers=True), "num_workers=True must be a positive integer"),
    (dict(num_workers=2.0), "num_workers=2.0 must be a positive integer"),
    (dict(num_workers=1, cpus_per_worker="1"), "cpus_per_worker='1' must be a finite number"),
    (dict(num_workers=1, cpus_per_worker=NAN), "cpus_per_worker=nan"),
    (dict(num_workers=1, use_gpu=True, gpus_per_worker=-1), "gpus_per_worker=-1"),
    (dict(num_workers=1, gpus_per_worker=1), "gpus_per_worker needs use_gpu"),
    (dict(num_workers=2, num_workers_per_host=3), "num_workers, or num_hosts"),
    (dict(min_workers=True), "min_workers=True must be a positive integer"),
    (dict(min_workers=1, cpus_per_worker="x"), "cpus_per_worker='x'"),
    (dict(min_workers=1, reset_limit="a"), "reset_limit='a' must be an integer >= 0"),
    (dict(min_workers=1, reset_limit=-1), "reset_limit=-1"),
    (dict(min_workers=1, cooldown_range=(1, "a")), r"cooldown_range=\(1, 'a'\)"),
    (dict(min_workers=1, cooldown_range=(2, 1)), "0 <= low <= high"),
    (dict(min_workers=1, elastic_timeout=NAN), "elastic_timeout=nan"),
    (dict(min_workers=2, max_workers=1), "max_workers=1 must be an integer >= min_workers"),
    (dict(min_workers=1, num_workers_per_host=3), "not both"),
])
def test_executor_refuses_bad_arguments_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message) as caught:
        RayExecutor(RayExecutor.create_settings(timeout_s=5), **kwargs)
    assert "not supported between" not in str(caught.value)


def test_gpus_per_worker_zero_or_none_means_one_as_in_horovod():
    settings = RayExecutor.create_settings()
    assert RayExecutor(settings, num_workers=1, use_gpu=True).gpus_per_worker == 1
    assert RayExecutor(settings, num_workers=1, use_gpu=True, gpus_per_worker=0).gpus_per_worker == 1
    assert RayExecutor(settings, num_workers=1, use_current_placement_group=False) \
        .use_current_placement_group is False


def test_extra_env_vars_become_strings_and_bad_names_are_refused():
    assert checks.env_strings("w", {"NUM": 1, 2: None}) == {"NUM": "1", "2": "None"}
    assert checks.env_strings("w", None) == {}
    with pytest.raises(ConfigError, match="extra_env_vars"):
        checks.env_strings("w", ["NUM=1"])
    with pytest.raises(ConfigError, match="'A=B' is not a variable name"):
        checks.env_strings("w", {"A=B": 1})


def test_a_missing_interface_is_named_as_nics_not_a_cli_flag():
    with pytest.raises(ConfigError, match="RayExecutor.start: nics: interface 'nope0' does "
                                          "not exist on this host") as caught:
        checks.nic_address("RayExecutor.start", "nope0")
    assert isinstance(caught.value, HvdlikeError)
    assert "--network-interface" not in str(caught.value)
    assert checks.nic_address("x", "lo") == "127.0.0.1"


def test_elastic_driver_messages_use_the_python_parameter_names():
    text = checks.flag_names("fewer than --min-np 2 slots usable (1) for more than "
                             "--elastic-timeout 600s; the job would re-form more than "
                             "--reset-limit 3 time(s); --max-np 4 (seen by hvdlike-run)")
    assert text == ("fewer than min_workers=2 slots usable (1) for more than "
                    "elastic_timeout=600s; the job would re-form more than "
                    "reset_limit=3 time(s); max_workers=4 (seen by hvdlike.ray)")


def test_an_unpicklable_result_is_a_failure_outcome_saying_so():
    outcome = outcome_of(lambda: threading.Lock(), (), {})
    assert not outcome["ok"] and outcome["type"] == UNPICKLABLE
    assert "result (_thread.lock) cannot be pickled" in outcome["message"]
    assert outcome_of(lambda x: {"x": x}, (1,), {}) == {"ok": True, "value": {"x": 1}}
    # The executable object stays in its actor: it need not be picklable.
    assert outcome_of(threading.Lock, (), {}, sent=False)["ok"]


def test_each_rank_sees_the_union_of_its_nodes_gpus():
    assert visible_devices(["a", "a", "b", "a"], [["1"], ["0"], ["3"], ["10"]]) == [
        "0,1,10", "0,1,10", "3", "0,1,10"]
    assert visible_devices(["a"], [[]]) == [""]


def test_callbacks_must_be_a_list_of_callables():
    def show(item):
        return item

    assert check_callbacks("run", None) == []
    assert check_callbacks("run", [show]) == [show]
    with pytest.raises(ConfigError, match="callbacks=<function .*show.*> must be a list"):
        check_callbacks("run", show)
    with pytest.raises(ConfigError, match="callbacks: 3 is not callable"):
        check_callbacks("run", [3])


def test_elastic_ray_executor_takes_horovods_settings():
    settings = ElasticRayExecutor.create_settings(min_np=2, max_np=4, reset_limit=1, nics="lo")
    executor = ElasticRayExecutor(settings, cpus_per_slot=2, env_vars={"N": 1})
    inner = executor._executor
    assert (inner.elastic.params.min_workers, inner.elastic.params.max_workers) == (2, 4)
    assert (inner.cpus_per_worker, inner.elastic.nic, executor.env_vars) == (2, "lo", {"N": "1"})
    with pytest.raises(ConfigError, match="min_workers=0"):
        ElasticRayExecutor.create_settings(min_num_proc=0)
    with pytest.raises(ConfigError, match="override_discovery=False is not supported"):
        ElasticRayExecutor(settings, override_discovery=False)


def test_hvdlike_config_checks_its_values():
    pytest.importorskip("ray.train")
    from hvdlike.ray import HvdlikeConfig

    for bad in (0, -1, "x", NAN):
        with pytest.raises(ConfigError, match="HvdlikeConfig: timeout_s="):
            HvdlikeConfig(timeout_s=bad)
    with pytest.raises(ConfigError, match="placement_group_timeout_s=0"):
        HvdlikeConfig(placement_group_timeout_s=0)
    assert HvdlikeConfig(nics={"lo"}).nic == "lo"
    assert HvdlikeConfig(nic="lo", nics={"lo"}).nic == "lo"
    with pytest.raises(ConfigError, match="different interfaces"):
        HvdlikeConfig(nic="lo", nics={"eth0"})
    with pytest.raises(ConfigError, match="exactly one"):
        HvdlikeConfig(nics={"lo", "eth0"})
