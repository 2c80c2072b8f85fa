"""An elastic job whose ranks have different amounts of work (not a test module).

Rank 0 commits 3 steps and returns; rank 1 has one step more. Without
``ELASTIC_JOIN`` that step's allreduce fails because rank 0 has shut down, so
rank 1 restores its last commit and waits to re-form. With ``ELASTIC_JOIN=1``
each rank calls ``hvd.join()`` when its work is done: rank 0 takes part in
rank 1's last allreduce (and commit) with zeros. Each rank prints
``GEN``/``STEP``/``DONE`` lines.
"""

import os

import torch

import hvdlike.torch as hvd

WORKER = os.environ.get("HVDLIKE_ELASTIC_WORKER", "static")
JOIN = os.environ.get("ELASTIC_JOIN") == "1"
torch.set_num_threads(1)
hvd.init()
state = hvd.elastic.ObjectState(steps=0)


@hvd.elastic.run
def train(state):
    print(f"GEN worker={WORKER} rank={hvd.rank()} size={hvd.size()} steps={state.steps}",
          flush=True)
    work = 3 + hvd.rank()
    while state.steps < work:
        total = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"step{state.steps}")
        print(f"STEP worker={WORKER} step={state.steps} sum={total[0].item():g}", flush=True)
        state.steps += 1
        state.commit()
    if JOIN:
        print(f"JOINED worker={WORKER} last={hvd.join()}", flush=True)
    return state.steps


print(f"DONE worker={WORKER} steps={train(state)}", flush=True)
