"""An elastic job whose ranks have different amounts of work (not a test module).

Rank 0 commits 3 steps and returns; rank 1 has one step more, whose allreduce
fails because rank 0 has shut down, so rank 1 restores its last commit and
waits to re-form. Each rank prints ``GEN``/``DONE`` lines.
"""

import os

import torch

import hvdlike.torch as hvd

WORKER = os.environ.get("HVDLIKE_ELASTIC_WORKER", "static")
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
        assert total.tolist() == [2.0, 2.0], total
        state.steps += 1
        state.commit()
    return state.steps


print(f"DONE worker={WORKER} steps={train(state)}", flush=True)
