"""Megatron-LM's CUDA-only start-up, replaced for a CPU/gloo run.

megatron_grpo.platform's CPU mode already covers what megatron-core assumes (device arguments,
``.cuda()``, streams, events, the CUDA RNG, tensor type names). Megatron-LM's training package
adds start-up code of its own that asks for CUDA outright; each replacement below names the
call it stands in for. Installed only in CPU mode, before the script runs.
"""

from __future__ import annotations

import functools
import os
from typing import List


def install(argv: List[str]) -> List[str]:
    """Patch Megatron-LM's start-up for CPU; returns argv with the CPU flags added (cpu_flags)."""
    from megatron.training import training

    original = training.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        # initialize.py asserts torch.cuda.is_available() unless told the run is CPU-only.
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    training.initialize_megatron = initialize_megatron
    from megatron.training import arguments

    if hasattr(arguments, "get_device_arch_version"):
        # validate_args reads the GPU's architecture (torch.cuda.get_device_properties) for
        # TP/CP > 1, only to require CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell: there is no
        # GPU, so no architecture, and the stream setting it wants is moot; it is set to pass.
        arguments.get_device_arch_version = lambda: 0
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    try:  # Megatron-LM 0.16.1 builds its legacy fused kernels with nvcc at start-up
        from megatron.legacy import fused_kernels
    except ImportError:
        fused_kernels = None
    if fused_kernels is not None and hasattr(fused_kernels, "load"):
        # Nothing on CPU calls them: the flags below switch every fusion off.
        fused_kernels.load = lambda *args, **kwargs: None
    return cpu_flags(argv)


# What a CPU run must be told, where the user did not say: gloo (no NCCL), megatron's local
# layers (transformer-engine is a CUDA package), and none of the fused kernels (CUDA or apex).
CPU_FLAGS = (("--distributed-backend", "gloo"), ("--transformer-impl", "local"),
             ("--no-persist-layer-norm", None), ("--no-gradient-accumulation-fusion", None),
             ("--no-masked-softmax-fusion", None), ("--no-bias-gelu-fusion", None),
             ("--no-bias-swiglu-fusion", None), ("--no-bias-dropout-fusion", None),
             ("--no-rope-fusion", None))


def cpu_flags(argv: List[str]) -> List[str]:
    """argv with each CPU_FLAGS entry the user did not give (as ``--flag value`` or
    ``--flag=value``) appended."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    out = list(argv)
    for flag, value in CPU_FLAGS:
        if flag not in given:
            out += [flag] if value is None else [flag, value]
    return out
