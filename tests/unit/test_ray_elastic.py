"""Elastic RayExecutor's pure parts: hosts from Ray's node records, settings from arguments."""

import pytest

from hvdlike.launcher.hosts import HostSlots
from hvdlike.ray.elastic import ElasticParams, RayHostDiscovery, host_label


def _node(node_id, cpus, gpus=0, alive=True, addr="10.0.0.1"):
    resources = {"CPU": float(cpus)}
    if gpus:
        resources["GPU"] = float(gpus)
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": addr,
            "Resources": resources}


def test_alive_nodes_with_slots_are_hosts_the_driver_node_first():
    nodes = [_node("bbbb" * 14, 4), _node("aaaa" * 14, 3, addr="10.0.0.2"),
             _node("cccc" * 14, 8, alive=False), _node("dddd" * 14, 0.5),
             _node("eeee" * 14, 2, addr="10.0.0.1")]
    found = RayHostDiscovery(1.5, nodes=lambda: nodes, first_node="eeee" * 14)
    hosts = found.find()
    assert hosts == [HostSlots("10.0.0.1/eeeeeeeeeeee", 1), HostSlots("10.0.0.2/aaaaaaaaaaaa", 2),
                     HostSlots("10.0.0.1/bbbbbbbbbbbb", 2)]
    assert found.node_ids["10.0.0.2/aaaaaaaaaaaa"] == "aaaa" * 14
    assert host_label(nodes[0]) == "10.0.0.1/bbbbbbbbbbbb"


def test_gpus_bound_the_slots_of_a_node():
    found = RayHostDiscovery(1, 1, nodes=lambda: [_node("a" * 56, 8, gpus=2), _node("b" * 56, 8)])
    assert found.find() == [HostSlots("10.0.0.1/aaaaaaaaaaaa", 2)]


def test_settings_start_with_every_slot_within_the_bounds():
    assert ElasticParams(2, 4).settings(6).np == 4
    assert ElasticParams(2, 4).settings(3).np == 3
    assert ElasticParams(2, 4).settings(1).np == 2  # the driver waits for the second slot
    unbounded = ElasticParams(1).settings(5)
    assert unbounded.np == 5 and unbounded.max_np > 10 ** 6
    limited = ElasticParams(1, 2, reset_limit=3, cooldown_range=(1, 2), elastic_timeout=9)
    settings = limited.settings(2)
    assert (settings.reset_limit, settings.cooldown_range, settings.elastic_timeout) == (3, (1, 2), 9)
    with pytest.raises(ValueError, match="RayExecutor: elastic_timeout=0 is not valid"):
        ElasticParams(1, elastic_timeout=0).settings(1)
