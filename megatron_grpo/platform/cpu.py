"""CPU mode: let real megatron-core (0.16.1) run on CPU with the gloo backend.

megatron-core assumes CUDA in about a dozen places: tensors created with ``device='cuda'`` or
``torch.cuda.current_device()``, ``.cuda()`` calls, CUDA streams/events around gradient
communication, the CUDA RNG tracker used for tensor-parallel initialisation and dropout, and the
distributed optimizer checking ``param.type()`` against ``'torch.cuda.FloatTensor'`` strings.

This module emulates exactly those pieces, nothing more, so the *same* megatron-core code paths
(GPTModel, DDP bucket groups, DistributedOptimizer, pipeline schedules, dist_checkpointing) run
unchanged on a CPU-only machine (developers, CI) and unchanged on CUDA clusters:

* a global ``TorchFunctionMode`` rewrites any ``device='cuda'``/``device=<int>`` argument and
  ``Tensor.to('cuda')`` to CPU, and makes ``Tensor.cuda()`` a no-op;
* ``torch.cuda.Stream``/``Event``/``stream()``/``synchronize`` become no-op stand-ins (CPU ops are
  synchronous, so ordering is already guaranteed);
* the "CUDA" RNG is the CPU default generator: ``torch.cuda.manual_seed`` reseeds it (a no-op
  seed here would leave replicated weights different across tensor-parallel ranks: silent and
  wrong), and megatron's CUDA RNG tracker saves/restores CPU generator state;
* ``Tensor.type()`` without arguments reports ``torch.cuda.*`` type strings.

It is active only when CUDA is unavailable, or when forced (``MEGATRON_GRPO_FORCE_CPU=1`` or
``enable_cpu_mode(force=True)``). On a CUDA machine without force it changes nothing.
Enabling is idempotent. It must be enabled before megatron-core builds models or process groups
(the training entry does this first).

Without transformer-engine and apex (always the case on CPU) megatron-core warns at import time,
once per module, that it falls back to its local implementations ("Transformer Engine and Apex
are not installed. Falling back to ...", "Apex is not installed. Falling back to Torch Norm"):
several lines per rank that say nothing a CPU user can act on. On the CPU path those exact
messages are filtered (``silence_fallback_warnings``; installed when this module is imported on a
machine without CUDA or with ``MEGATRON_GRPO_FORCE_CPU`` set, i.e. before megatron is imported,
and again by ``enable_cpu_mode``), and ``enable_cpu_mode`` prints one line instead. Every other
warning is left alone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import threading
import warnings

import torch
from torch.overrides import TorchFunctionMode

FORCE_ENV = "MEGATRON_GRPO_FORCE_CPU"

_lock = threading.Lock()
_active = False
_mode: "_CudaToCpuMode | None" = None

# megatron-core 0.16.1's import-time notices that transformer-engine / apex are missing (grep
# "not installed. Falling back" in megatron/core: optimizer/__init__.py, optimizer/optimizer.py,
# optimizer/clip_grads.py, models/backends.py, models/gpt/gpt_layer_specs.py,
# distributed/fsdp/.../mixed_precision.py and the other model specs). Matched from the start of
# the message, only for UserWarnings attributed to megatron.core modules.
FALLBACK_WARNING_PATTERNS = (
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    r"Apex is not installed\. Falling back to Torch Norm",
)
_FALLBACK_WARNING_MODULE = r"megatron\.core(\.|$)"
_fallback_filters_installed = False
_fallback_notice_printed = False


def _to_cpu_device(device):
    """Map a CUDA device spec (str, torch.device or bare ordinal) to the CPU device."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, int) and not isinstance(device, bool):
        # megatron passes torch.cuda.current_device() (an int ordinal) as device=.
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch function call to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":  # Tensor.cuda(): already on the only device we have.
            return args[0]
        if name == "to" and args:
            args = tuple(
                _to_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args
            )
        return func(*args, **kwargs)


class _NoOpStream:
    """Stand-in for torch.cuda.Stream: CPU kernels run synchronously in issue order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpEvent()

    def query(self):
        return True


class _NoOpEvent:
    """Stand-in for torch.cuda.Event."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def cuda_usable() -> bool:
    """True when real CUDA is present and CPU mode is neither active nor forced."""
    if _active:
        return False
    if os.environ.get(FORCE_ENV, "") not in ("", "0"):
        return False
    return torch.cuda.is_available()


def cpu_mode_active() -> bool:
    return _active


def silence_fallback_warnings() -> None:
    """Filter megatron-core's "transformer-engine/apex not installed, falling back" import
    warnings (exactly ``FALLBACK_WARNING_PATTERNS``). Idempotent. Must run before megatron-core
    is imported to have an effect (the warnings are issued at import time)."""
    global _fallback_filters_installed
    if _fallback_filters_installed:
        return
    for pattern in FALLBACK_WARNING_PATTERNS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning,
                                module=_FALLBACK_WARNING_MODULE)
    _fallback_filters_installed = True


def _missing_accelerator_packages() -> list:
    return [name for module, name in (("transformer_engine", "transformer-engine"), ("apex", "apex"))
            if importlib.util.find_spec(module) is None]


def _fallback_notice() -> None:
    """The one line that replaces the filtered warnings (once per process)."""
    global _fallback_notice_printed
    if _fallback_notice_printed:
        return
    _fallback_notice_printed = True
    missing = _missing_accelerator_packages()
    if not missing:
        return
    print(f"megatron-grpo CPU mode: {' and '.join(missing)} not installed; megatron-core's local "
          f"torch fallbacks are in use (norms, optimizers, multi-tensor ops)", file=sys.stderr,
          flush=True)


def _cpu_path_expected() -> bool:
    """Whether CPU mode will be the platform: forced, or no CUDA (checked without patching)."""
    if os.environ.get(FORCE_ENV, "") not in ("", "0"):
        return True
    try:
        return not torch.cuda.is_available()
    except Exception:  # a broken CUDA install: CPU mode is what select_platform will pick
        return True


def enable_cpu_mode(force: bool = False) -> bool:
    """Install the CUDA->CPU emulation. Returns True if CPU mode is (now) active.

    Does nothing and returns False when CUDA is available and neither ``force`` nor
    ``MEGATRON_GRPO_FORCE_CPU`` asks for CPU mode. Safe to call many times.
    """
    global _active, _mode
    with _lock:
        if _active:
            return True
        forced = force or os.environ.get(FORCE_ENV, "") not in ("", "0")
        if torch.cuda.is_available() and not forced:
            return False
        silence_fallback_warnings()   # before _patch_megatron_rng imports megatron
        _fallback_notice()
        _patch_torch_cuda()
        _patch_megatron_rng()
        _mode = _CudaToCpuMode()
        # Entered for the life of the process: megatron creates CUDA tensors from anywhere.
        _mode.__enter__()
        _active = True
        return True


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.is_available = lambda: False
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpEvent
    cuda.current_stream = lambda *a, **k: _NoOpStream()
    cuda.default_stream = lambda *a, **k: _NoOpStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    # Memory statistics: there is no device memory; report zero rather than raise.
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self

    # The CUDA RNG is the CPU default generator. Seeding must reseed it directly:
    # torch.manual_seed itself calls torch.cuda.manual_seed_all (infinite recursion).
    def _seed(seed, *a, **k):
        torch.default_generator.manual_seed(int(seed))

    cuda.manual_seed = _seed
    cuda.manual_seed_all = _seed
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    import torch.cuda.random as cuda_random

    cuda_random.get_rng_state = cuda.get_rng_state
    cuda_random.set_rng_state = cuda.set_rng_state
    cuda_random.manual_seed = _seed
    cuda_random.manual_seed_all = _seed

    # megatron's DistributedOptimizer only accepts params whose type() is a CUDA type string.
    original_type = torch.Tensor.type
    if not getattr(original_type, "_megatron_grpo_cpu", False):
        def _type(self, *args, **kwargs):
            if not args and not kwargs:
                t = original_type(self)
                if t.startswith("torch.") and not t.startswith("torch.cuda."):
                    return t.replace("torch.", "torch.cuda.", 1)
                return t
            return original_type(self, *args, **kwargs)

        _type._megatron_grpo_cpu = True
        torch.Tensor.type = _type


def _patch_megatron_rng() -> None:
    """megatron's CUDA RNG tracker reads/writes CUDA generator state: use the CPU one."""
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    # Every random op inside tracker.fork() "changes the CPU RNG" here because the CUDA and CPU
    # generators are the same object; megatron warns about it on each op. Expected, so silence it.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)


# On the CPU path, install the filters as soon as this module is imported: the training entry and
# examples import megatron_grpo.platform before anything imports megatron-core. The deferred
# torch.compile too: megatron's import-time decorations cost ~2 s per process otherwise.
if _cpu_path_expected():
    silence_fallback_warnings()
    from megatron_grpo.platform import deferred_compile

    deferred_compile.install()
