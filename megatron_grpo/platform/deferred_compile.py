"""torch.compile deferred to a function's first call, on the CPU path.

megatron-core decorates ~40 fusion functions with ``jit_fuser`` (``torch.compile`` on torch >=
2.2) at import time. Each decoration imports and configures torch._dynamo and inductor: about
2 s per process on a 2-core CPU, although a CPU run calls few or none of those functions
(torch.compile only compiles at the first call anyway). Every rank of every CPU run, and every
test launch, paid it.

``install()`` replaces ``torch.compile`` with a wrapper that records the arguments and calls the
real ``torch.compile`` at the function's first call, so a function that runs is compiled
exactly as before, with the same options, and one that never runs costs nothing. Modules
(``torch.compile(nn.Module)``) and anything not a plain function go straight to the real one.
Only the CPU path installs it (megatron_grpo.platform.cpu); CUDA runs keep torch's own.
"""

from __future__ import annotations

import functools
import threading

import torch

_real_compile = None
_lock = threading.Lock()


def deferred_compile(model=None, **kwargs):
    """``torch.compile``'s signature; plain functions are compiled at their first call."""
    if model is None:  # @torch.compile(mode=...) form
        return lambda fn: deferred_compile(fn, **kwargs)
    if isinstance(model, torch.nn.Module) or not callable(model):
        return _real_compile(model, **kwargs)
    compiled = []

    @functools.wraps(model)
    def first_call_compiles(*args, **kw):
        if not compiled:
            with _lock:
                if not compiled:
                    compiled.append(_real_compile(model, **kwargs))
        return compiled[0](*args, **kw)

    first_call_compiles.deferred_compile_of = model
    return first_call_compiles


def install() -> bool:
    """Put ``deferred_compile`` in place of ``torch.compile`` (idempotent). Returns True when
    it is installed. Must run before megatron-core is imported to save its import time."""
    global _real_compile
    with _lock:
        if _real_compile is None:
            _real_compile = torch.compile
            torch.compile = deferred_compile
    return True


def installed() -> bool:
    return torch.compile is deferred_compile
