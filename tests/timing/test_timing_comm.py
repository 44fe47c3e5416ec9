"""timer.CommWait on a real DDP model (gloo, one process): comm_wait counts the collectives a
step ran, and nothing for a step that ran none."""

from __future__ import annotations

import pytest


@pytest.fixture
def ddp():
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        yield DistributedDataParallel(torch.nn.Linear(8, 8))  # no buffers: no broadcast
    finally:
        dist.destroy_process_group()


def test_comm_wait_is_zero_for_a_step_with_no_collective_and_take_resets(ddp):
    import torch

    from diag.timing.timer import CommWait

    comm = CommWait(ddp)
    x = torch.ones(4, 8)
    ddp(x).sum().backward()  # the gradient all-reduce runs
    assert comm.take() > 0
    assert comm.take() == 0.0  # nothing ran since the last take
    with ddp.no_sync():  # an accumulation micro-step: no all-reduce
        ddp(x).sum().backward()
    assert comm.take() == 0.0
    ddp(x).sum().backward()
    assert comm.take() > 0 and len(comm.all_reduce_s) == 2
