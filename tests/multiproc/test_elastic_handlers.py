"""A learning-rate scheduler in TorchState syncs rank 0's schedule on real ranks."""

from .harness import run_ranks


def _sync_scheduler():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(1 + 2 * hvd.rank()):  # rank 0 one step in, rank 1 three
        opt.step()
        sched.step()
    state = hvd.elastic.TorchState(model=model, optimizer=opt, scheduler=sched)
    state.sync()
    out = (sched.last_epoch, opt.param_groups[0]["lr"], state.scheduler is sched,
           sched.optimizer is opt)
    hvd.shutdown()
    return out


def test_sync_gives_every_rank_rank0s_schedule_on_the_optimizer_it_trains_with():
    for out in run_ranks(_sync_scheduler, np=2, timeout=60):
        assert out == (1, 0.5, True, True), out
