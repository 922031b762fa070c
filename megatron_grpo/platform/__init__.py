"""Where training runs: CUDA + NCCL on clusters, or CPU + gloo through CPU mode."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_grpo.platform.cpu import cpu_mode_active, cuda_usable, enable_cpu_mode


@dataclass(frozen=True)
class Platform:
    """The device and collective backend chosen for this process."""

    device: torch.device
    """torch device tensors live on (cuda:<local rank> or cpu)."""
    backend: str
    """torch.distributed backend: 'nccl' on CUDA, 'gloo' in CPU mode."""
    cpu_mode: bool
    """True when megatron-core runs under the CUDA->CPU emulation."""


def select_platform(force_cpu: bool = False, local_rank: int = 0) -> Platform:
    """Pick CUDA when usable, else enable CPU mode. Call before building anything megatron."""
    if not force_cpu and cuda_usable():
        torch.cuda.set_device(local_rank)
        return Platform(torch.device("cuda", local_rank), "nccl", False)
    enable_cpu_mode(force=True)
    return Platform(torch.device("cpu"), "gloo", True)


__all__ = ["Platform", "select_platform", "enable_cpu_mode", "cpu_mode_active", "cuda_usable"]
