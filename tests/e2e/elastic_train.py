"""An elastic training job the e2e tests drive (not a test module).

E epochs x B batches of a tiny regression under ``hvd.elastic.run``, a commit
after every batch. Each rank prints, per generation it trains in,
``GEN worker=.. rank=.. size=.. steps=..`` and at the end
``DONE worker=.. rank=.. size=.. steps=.. params=<checksum>``.

Faults, one-shot, from ``ELASTIC_FAULTS`` (comma separated
``WORKER:STEP:KIND``): when the worker reaches STEP committed steps it raises
(``raise``) or SIGKILLs itself (``kill``). ``ELASTIC_STEP_SECONDS`` slows every
step; with ``ELASTIC_SLOW_GENERATIONS`` (comma-separated generation numbers) only
the steps of those generations, the others taking the default 0.05 s (a job that
waits for a host change is slowed while it waits, not once the change is in).
``ELASTIC_PROGRESS`` names a file the rank 0 writes its step count to.
``ELASTIC_PROCESS_SETS`` (``0,1;2,3``) are static process sets given to
``init()``; the GEN line then shows each set's id and the sum of the global
ranks of its members, computed by an allreduce on the set (``sets=``).
``ELASTIC_DIE_FORMING`` (``WORKER:GENERATION``): that worker SIGKILLs itself
while generation GENERATION is being formed, before it takes part in making
the global set's groups (the others wait for it there).
"""

import os
import signal
import sys
import time

import torch

import hvdlike.torch as hvd

EPOCHS = int(os.environ.get("ELASTIC_EPOCHS", "3"))
BATCHES = int(os.environ.get("ELASTIC_BATCHES", "8"))
DEFAULT_STEP_SECONDS = 0.05
STEP_SECONDS = float(os.environ.get("ELASTIC_STEP_SECONDS", DEFAULT_STEP_SECONDS))
SLOW_GENERATIONS = set(filter(None, os.environ.get("ELASTIC_SLOW_GENERATIONS", "").split(",")))
WORKER = os.environ.get("HVDLIKE_ELASTIC_WORKER", "static")
FAULTS = {}
for spec in filter(None, os.environ.get("ELASTIC_FAULTS", "").split(",")):
    worker, step, kind = spec.split(":")
    FAULTS.setdefault(worker, []).append((int(step), kind))

SETS = [hvd.ProcessSet([int(r) for r in spec.split(",")])
        for spec in filter(None, os.environ.get("ELASTIC_PROCESS_SETS", "").split(";"))]

if os.environ.get("ELASTIC_DIE_FORMING", "").split(":")[0] == WORKER:
    from hvdlike.core import transport

    _DIE_AT = os.environ["ELASTIC_DIE_FORMING"].split(":")[1]
    _make_groups = transport.Groups.__init__

    def _groups_or_die(self, *args, **kwargs):
        if os.environ.get("HVDLIKE_ELASTIC_GENERATION") == _DIE_AT:
            print(f"FAULT worker={WORKER} kind=die-forming gen={_DIE_AT}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        _make_groups(self, *args, **kwargs)

    transport.Groups.__init__ = _groups_or_die

torch.set_num_threads(1)
hvd.init(process_sets=SETS)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters())
dataset = list(range(BATCHES * 4))
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)


def say(text):
    print(text, flush=True)


def inject(steps):
    for step, kind in FAULTS.get(WORKER, []):
        if steps == step:
            say(f"FAULT worker={WORKER} kind={kind} at={time.time():.3f}")
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure of {WORKER} at step {steps}")


def step_seconds():
    """How long a step of the current generation sleeps."""
    if SLOW_GENERATIONS and os.environ.get("HVDLIKE_ELASTIC_GENERATION") not in SLOW_GENERATIONS:
        return DEFAULT_STEP_SECONDS
    return STEP_SECONDS


def checksum():
    return ",".join(f"{v:.6f}" for v in torch.cat([p.detach().flatten()
                                                   for p in model.parameters()]).tolist())


def process_sets():
    """``id:ranks:sum`` per static set (sum over its members by an allreduce on it)."""
    shown = []
    for pset in SETS:
        total = "-"
        if pset.process_set_id is not None and pset.included():
            total = int(hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum,
                                      process_set=pset, name=f"set{pset.process_set_id}").item())
        shown.append(f"{pset.process_set_id}:{'-'.join(map(str, pset.ranks))}:{total}")
    return ",".join(shown)


def optimizer_checksum():
    total = 0.0
    for group in optimizer.state_dict()["state"].values():
        total += float(sum(v.abs().sum() for v in group.values() if torch.is_tensor(v)))
    return f"{total:.6f}"


@hvd.elastic.run
def train(state):
    generation = os.environ.get("HVDLIKE_ELASTIC_GENERATION", "0")
    say(f"GEN worker={WORKER} gen={generation} rank={hvd.rank()} size={hvd.size()} "
        f"steps={state.steps} "
        f"params={checksum()} optimizer={optimizer_checksum()} at={time.time():.3f} "
        f"sets={process_sets()}")
    while state.epoch < EPOCHS:
        while state.batch < BATCHES:
            inject(state.steps)
            g = torch.Generator().manual_seed(1000 * state.epoch + state.batch)
            x = torch.randn(8, 4, generator=g) + hvd.rank()  # each rank's own shard
            y = x.sum(dim=1, keepdim=True)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            pause = step_seconds()
            if pause:
                time.sleep(pause)
            state.steps += 1
            state.batch += 1
            state.commit()
            if hvd.rank() == 0 and os.environ.get("ELASTIC_PROGRESS"):
                with open(os.environ["ELASTIC_PROGRESS"], "w") as f:
                    f.write(f"{state.steps} {hvd.size()}\n")
        state.batch = 0
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                               epoch=0, batch=0, steps=0)
state.register_reset_callbacks([lambda: say(f"RESET worker={WORKER} size={hvd.size()}")])
train(state)
say(f"DONE worker={WORKER} rank={hvd.rank()} size={hvd.size()} steps={state.steps} "
    f"params={checksum()}")
sys.stdout.flush()
