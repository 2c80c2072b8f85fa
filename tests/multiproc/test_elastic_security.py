"""A process removed from an elastic job cannot write into the next generation.

Three real ranks form generation 1; the test's rank 0 plays the launcher and
publishes generation 2 without w2. w2 leaves (as a removed rank does) and then
turns attacker: it still holds the job secret, its own secret and generation
1's key. It forges records under generation 2's prefix -- signed with the job
secret, and with generation 1's key -- and tries to unseal a member's copy of
generation 2's key. The members of generation 2 read both records through
their runtime's store and must refuse them, then go on training. A forged
"the job is finishing" record (which would make members waiting to re-form
leave) is ignored the same way.
"""

import secrets

from tests.multiproc.harness import run_ranks

SECRETS = {f"w{r}": secrets.token_hex(16) for r in range(3)}


def _removed_rank_attacks(worker_secrets):
    import os

    import torch

    import hvdlike.torch as hvd
    from hvdlike.core import api
    from hvdlike.core.elastic import protocol, worker
    from hvdlike.core.store_auth import StoreTamperedError

    torch.set_num_threads(1)
    ctx = worker.context()

    def publish(number, workers):
        table = {w: {"rank": r, "size": len(workers), "local_rank": r,
                     "local_size": len(workers), "cross_rank": 0, "cross_size": 1,
                     "hostname": "localhost"} for r, w in enumerate(workers)}
        protocol.publish(ctx.store, protocol.Generation(number, table, removed_only=True),
                         worker_secrets)
        ctx.store.set(protocol.LATEST_KEY, str(number))

    if os.environ["HVDLIKE_RANK"] == "0":
        publish(1, ["w0", "w1", "w2"])
    else:  # the launcher publishes a generation before it starts its ranks
        ctx.store.wait([protocol.LATEST_KEY])
    hvd.init()
    found = {}

    @hvd.elastic.run
    def train(state):
        if ctx.generation == 1:
            state.step += 1
            if hvd.rank() == 0:
                publish(2, ["w0", "w1"])  # w2 is removed
            state.commit()  # HostsUpdatedInterrupt everywhere; w2 leaves
            return
        ctx.store.wait(["test/attacked"])  # the removed process has done its worst
        for r in (0, 1):
            try:
                found[r] = "accepted: " + api.runtime().store.get(f"health/shutdown/{r}").decode()
            except StoreTamperedError as exc:
                found[r] = "refused: " + str(exc)
        # the job secret alone would have let the first forgery through
        found["job view"] = ctx.store.get("elastic2/health/shutdown/1").decode()
        # "the job is finishing" forged for generation 2: members do not leave for it
        found["finished, job secret"] = ctx.finished()
        hvd.barrier()
        if hvd.rank() == 0:
            ctx.store.set("test/checked", "1")
        ctx.store.wait(["test/attacked again"])
        found["finished, generation 1's key"] = ctx.finished()
        total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after")
        found["size"], found["total"] = hvd.size(), total.item()

    state = hvd.elastic.ObjectState(step=0)
    try:
        train(state)
    except SystemExit:  # removed from the job: now try to write into generation 2
        report = {"seat": ctx.key(2), "left in generation": ctx.generation}
        try:
            protocol.open_key(ctx.worker_secret, 2, "w0",
                              ctx.store.get(protocol.seat_key(2, "w0")))
            report["unsealed w0's key"] = True
        except StoreTamperedError as exc:
            report["unsealed w0's key"] = str(exc)
        ctx.store.set("elastic2/health/shutdown/1", "forged with the job secret")
        ctx.view(1).set("elastic2/health/shutdown/0", "forged with generation 1's key")
        ctx.store.set(protocol.finished_key(2), "w2")
        ctx.store.set("test/attacked", "1")
        ctx.store.wait(["test/checked"])
        ctx.view(1).set(protocol.finished_key(2), "w2")
        ctx.store.set("test/attacked again", "1")
        return report
    hvd.shutdown()
    return found


def test_removed_rank_cannot_write_into_the_next_generation():
    env = {"HVDLIKE_ELASTIC_GENERATION": "1", "HVDLIKE_ELASTIC_TIMEOUT": "60"}
    w0, w1, w2 = run_ranks(
        _removed_rank_attacks, np=3, args=(SECRETS,), timeout=120, env=env,
        per_rank_env=lambda r: {"HVDLIKE_ELASTIC_WORKER": f"w{r}",
                                "HVDLIKE_ELASTIC_WORKER_SECRET": SECRETS[f"w{r}"]})
    print(f"attacker: {w2}\nmember: {w0}")
    assert w2["seat"] is None and w2["left in generation"] == 2  # no key for generation 2
    assert "not sealed for this process" in w2["unsealed w0's key"]
    for found in (w0, w1):
        for r in (0, 1):
            assert found[r].startswith("refused: ") and "signature does not match" in found[r], \
                found
        assert found["job view"] == "forged with the job secret"
        assert found["finished, job secret"] is None
        assert found["finished, generation 1's key"] is None
        assert (found["size"], found["total"]) == (2, 2.0)  # the members trained on
