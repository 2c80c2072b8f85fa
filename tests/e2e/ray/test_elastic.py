"""Elastic ``RayExecutor(min_workers=, max_workers=)`` on the package's local Ray cluster.

One job goes through both directions: it starts with 4 ranks on the two nodes
(2 each), one rank actor on the worker node is SIGKILLed mid-training (its node
is blacklisted, so the job re-forms with the 2 ranks of the head and the killed
rank's node-mate leaves), then a third node with one CPU joins the cluster and
the job grows to 3. The test paces training
through an ``allow`` file (ranks train up to that many committed steps, then
wait, checking for host updates) so each phase happens at a known point.
Every rank logs, per generation it trains in, its rank, size, committed steps
and a parameter checksum; the assertions are on those logs and the values
``run`` returns.
"""

import os
import signal
import threading
import time

import pytest

from .conftest import wait_cpus_back, wait_gone

STEPS = 12


def train(folder, steps):
    """The elastic training function every rank runs (shipped by cloudpickle)."""
    import json

    import ray
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    worker = os.environ["HVDLIKE_ELASTIC_WORKER"]
    node = ray.get_runtime_context().get_node_id()

    def checksum():
        return ",".join(f"{v:.6f}" for v in torch.cat(
            [p.detach().flatten() for p in model.parameters()]).tolist())

    def log(kind, state):
        with open(os.path.join(folder, f"log.{worker}"), "a") as f:
            f.write(json.dumps({"kind": kind, "pid": os.getpid(), "node": node,
                                "rank": hvd.rank(), "size": hvd.size(), "steps": state.steps,
                                "params": checksum()}) + "\n")

    def allowed():
        text = open(os.path.join(folder, "allow")).read().strip() if hvd.rank() == 0 else "0"
        return int(hvd.allreduce(torch.tensor([float(text or 0)]), op=hvd.Max,
                                 name="allow").item())

    def progress(state):
        if hvd.rank() == 0:
            with open(os.path.join(folder, "progress.tmp"), "w") as f:
                f.write(f"{state.steps} {hvd.size()}")
            os.replace(os.path.join(folder, "progress.tmp"), os.path.join(folder, "progress"))

    @hvd.elastic.run
    def loop(state):
        log("gen", state)
        progress(state)
        while state.steps < steps:
            if state.steps >= allowed():
                time.sleep(0.05)
                state.check_host_updates()
                continue
            g = torch.Generator().manual_seed(state.steps)
            x = torch.randn(8, 4, generator=g) + hvd.rank()  # each rank's own shard
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
            optimizer.step()
            state.steps += 1
            state.commit()
            progress(state)

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, steps=0)
    loop(state)
    log("done", state)
    return {"worker": worker, "rank": hvd.rank(), "size": hvd.size(), "steps": state.steps,
            "params": checksum()}


def _logs(folder):
    import json

    logs = {}
    for name in os.listdir(folder):
        if name.startswith("log."):
            with open(os.path.join(folder, name)) as f:
                logs[name[4:]] = [json.loads(line) for line in f]
    return logs


def _wait_progress(folder, done, what, timeout=120.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            steps, size = map(int, open(os.path.join(folder, "progress")).read().split())
        except (OSError, ValueError):
            steps = size = -1
        if done(steps, size):
            return steps, size
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g}s (steps {steps}, size {size}); "
                                 f"logs {_logs(folder)}")
        time.sleep(0.1)


def test_a_killed_actor_re_forms_the_job_and_a_new_node_grows_it(ray_cluster, tmp_path):
    from hvdlike.ray import RayExecutor

    folder = str(tmp_path)
    allow = os.path.join(folder, "allow")
    with open(allow, "w") as f:
        f.write("6")
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=2,
                           max_workers=4, cpus_per_worker=1, elastic_timeout=60)
    executor.start()
    head = ray_cluster.ray.get_runtime_context().get_node_id()
    phases, outcome, added = {}, {}, []

    def run():
        try:
            outcome["results"] = executor.run(train, args=[folder, STEPS])
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            outcome["error"] = exc

    # The job runs in a thread: Ray adds a node only from the main thread.
    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        _wait_progress(folder, lambda steps, size: steps >= 3 and size == 4,
                       "4 ranks training")
        victim = next(entries[0] for entries in _logs(folder).values()
                      if entries[0]["node"] != head)
        os.kill(victim["pid"], signal.SIGKILL)
        phases["killed"] = victim
        _wait_progress(folder, lambda steps, size: size == 2, "the job re-formed to 2 ranks")
        with open(allow, "w") as f:
            f.write("9")
        added.append(ray_cluster.add_node(cpus=1))
        _wait_progress(folder, lambda steps, size: size == 3, "the job grown to 3 ranks")
    finally:
        with open(allow, "w") as f:
            f.write(str(STEPS))  # let the job end whatever happened
        runner.join(timeout=150)
        pids = [entry["pid"] for entries in _logs(folder).values() for entry in entries]
        executor.shutdown()
        wait_gone(pids)
        for node in added:
            ray_cluster.remove_node(node)
        wait_cpus_back(ray_cluster)
    assert not runner.is_alive(), "the elastic job did not end within 150s of its last phase"
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    logs = _logs(folder)

    # The job ends with 3 ranks (2 survivors of the head, 1 new on the new node), every
    # committed step done once, equal parameters everywhere.
    assert sorted(r["rank"] for r in results) == [0, 1, 2], results
    assert {r["size"] for r in results} == {3}
    assert {r["steps"] for r in results} == {STEPS}, results
    assert len({r["params"] for r in results}) == 1, results
    assert executor.elastic.last_result.sizes == [4, 2, 3]

    # Every generation starts from one state: same steps and parameters on all members.
    starts = {}
    for entries in logs.values():
        for entry in entries:
            if entry["kind"] == "gen":
                starts.setdefault(entry["size"], []).append(entry)
    for size, entries in starts.items():
        by_steps = {}
        for entry in entries:
            by_steps.setdefault(entry["steps"], set()).add(entry["params"])
        assert all(len(params) == 1 for params in by_steps.values()), (size, entries)

    # Survivors on the head trained at 4, 2, then 3 ranks; the killed rank's node-mate left.
    killed = phases["killed"]
    sizes = {w: [e["size"] for e in entries if e["kind"] == "gen"] for w, entries in logs.items()}
    survivors = [w for w, entries in logs.items() if entries[0]["node"] == head]
    assert len(survivors) == 2 and all(sizes[w] == [4, 2, 3] for w in survivors), sizes
    newcomers = [w for w in logs if sizes[w] == [3] and logs[w][0]["node"] not in (
        head, killed["node"])]
    assert len(newcomers) == 1, sizes
    mate = [w for w, entries in logs.items() if entries[0]["node"] == killed["node"]
            and entries[0]["pid"] != killed["pid"]]
    assert len(mate) == 1 and sizes[mate[0]] == [4], sizes  # left without training at 2
    finished = {r["worker"] for r in results}
    assert finished == set(survivors) | set(newcomers)
    lost = executor.elastic.last_result.lost
    assert [(item.rank, item.generation) for item in lost] == [(killed["rank"], 1)], lost
    assert "lost its Ray actor" in lost[0].reason, lost[0].reason
    # The re-formed job picked up at the last commit before the kill: never restarted.
    assert min(e["steps"] for w in survivors for e in logs[w][1:] if e["kind"] == "gen") >= 3


def test_elastic_arguments_are_checked_before_anything_starts():
    from hvdlike.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=5)
    with pytest.raises(ValueError, match="min_workers=0 must be a positive integer"):
        RayExecutor(settings, min_workers=0)
    with pytest.raises(ValueError, match="max_workers=1 must be an integer >= min_workers"):
        RayExecutor(settings, min_workers=2, max_workers=1)
    with pytest.raises(ValueError, match="max_workers needs min_workers"):
        RayExecutor(settings, max_workers=2)
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(settings, num_workers=2, min_workers=2)
    with pytest.raises(ValueError, match="reset_limit=-1 must be an integer >= 0"):
        RayExecutor(settings, min_workers=1, reset_limit=-1)
    with pytest.raises(ValueError, match="cooldown_range"):
        RayExecutor(settings, min_workers=1, cooldown_range=(5, 1))
