"""Shared pytest fixtures."""

import socket

import pytest
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_group():
    """A 1-rank gloo default process group for the test, destroyed afterwards.

    megatron's dataset builders call torch.distributed.get_rank() and barrier() once a group
    exists (and BlendedDataset needs one even in a single process). If a group is already
    initialized it is reused and left alone.
    """
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", world_size=1, rank=0)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
