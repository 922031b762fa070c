"""megatron-core versions GRPO runs on, and every difference between them the glue meets, named once.

GRPO subclasses megatron-core's private classes (the bucket group, DDP, the distributed
optimizer), so a new megatron-core release can change what an override replaces without an
error: a renamed method is simply never called. Each such difference between 0.16.1 and 0.19.x
is named here, once, and the glue asks this module instead of testing versions itself:

* **the gradient-norm list** (``GRAD_NORM_METHODS``): ``get_main_grads_for_grad_norm()`` up to
  0.18; 0.19.0 renamed it ``get_grads_for_grad_norm(grad_norm_group=None)``. The optimizer
  overrides both names; with only the old one, gradients held on host memory or SSD dropped out
  of the norm on 0.19 (a norm of 0.0, clipping silently off: +13.7 % validation loss measured).
* **the skipped update** (``grad_norm_skip_threshold``, 0.18): megatron's chained step may skip
  the update after the gradients were found finite, without calling ``step_with_ready_grads``.
  The controller counts a step as applied only when every GRPO optimizer that prepared it also
  stepped (``GRPOController.note_applied``).
* **the finish flag** (``grad_reduce_finished``, 0.18): ``finish_grad_sync`` became idempotent
  within an iteration, because with ``reduce_scatter_with_fp32_accumulation`` a bucket group
  drains its predecessor from ``start_grad_sync`` and the end-of-step loop finishes it again.
  GRPO's override follows megatron's rule for it (``FINISH_FLAG``): only with
  ``overlap_grad_reduce`` (without, every call dispatches and waits), and set only once the wait
  returned (a finish that raised leaves it unset, so the next one still waits). It keeps the
  flag on 0.16/0.17 too, where a second finish after a successful one is never valid (megatron
  asserts that no call is outstanding, or in the first batch reduces the buffer again).
* **the communication stream** (0.17): with several distributed-optimizer instances megatron's
  finish waits for the communication stream on the *current* stream, not the default one
  (``grad_sync_wait_stream``).
* **the bucket layout** (``full_param_layout``, 0.18): Megatron-LM's ``get_model`` precomputes
  bucket layouts from ``ddp_config.bucket_size`` and hands them to DDP, which would bypass the
  bucket size GRPO keeps (one bucket without overlap, or on later pipeline stages). GRPO's DDP
  drops a handed layout and lets megatron compute it from GRPO's size
  (``LAYOUT_ARGUMENT``); the distributed optimizer reads the layout from DDP's buffers.
* **new options** (fp4 parameter gather, fp32 local accumulation, the layer-wise distributed
  optimizer, GTP weight remat, ``num_buckets``, flextron's router sync) are carried or refused in
  ``options.py`` / ``grad_storage.reads_after_sync``, read with ``getattr`` so one rule serves
  every version.

The version gate (``check_version``) runs when the glue is imported: outside the supported
range it stops with the version found, the range and the pip command.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Optional, Tuple

SUPPORTED_MIN = (0, 16, 1)
"""Oldest megatron-core GRPO is tested on."""
SUPPORTED_BELOW = (0, 20, 0)
"""First megatron-core release GRPO is not tested on (setup.py: ``megatron-core>=0.16.1,<0.20``)."""
SUPPORTED_RANGE = ">=0.16.1,<0.20"
"""The same range as pip writes it (setup.py's install_requires)."""
SKIP_CHECK_ENV = "MEGATRON_GRPO_SKIP_VERSION_CHECK"
"""Set to 1 to run on an untested megatron-core anyway (a WARNING says so; results unverified)."""

GRAD_NORM_METHODS = ("get_main_grads_for_grad_norm", "get_grads_for_grad_norm")
"""The distributed optimizer's gradient list for the norm: its name up to 0.18, and from 0.19."""
FINISH_FLAG = "grad_reduce_finished"
"""The bucket group's 'finish_grad_sync has waited this iteration' flag (megatron 0.18 and later;
used with overlap_grad_reduce only)."""
LAYOUT_ARGUMENT = "full_param_layout"
"""DistributedDataParallel's precomputed bucket layout argument (megatron 0.18 and later)."""


def parse_version(text: str) -> Tuple[int, int, int]:
    """'0.19.2' -> (0, 19, 2); '0.20.0rc1' or '0.19.0+abc' -> their release numbers."""
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if match is None:
        raise ValueError(f"cannot read a megatron-core version from {text!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


@functools.lru_cache(maxsize=None)
def mcore_version() -> Tuple[int, int, int]:
    """The installed megatron-core's release numbers (megatron.core.package_info)."""
    from megatron.core import package_info

    return parse_version(package_info.__version__)


def _text(version: Tuple[int, int, int]) -> str:
    return ".".join(str(v) for v in version)


def version_problem(version: Tuple[int, int, int]) -> Optional[str]:
    """None for a supported version, else the one line that says what to do."""
    if SUPPORTED_MIN <= version < SUPPORTED_BELOW:
        return None
    return (f"megatron-grpo supports megatron-core {SUPPORTED_RANGE}, but megatron-core "
            f"{_text(version)} is installed: pip install 'megatron-core{SUPPORTED_RANGE}' "
            f"(or set {SKIP_CHECK_ENV}=1 to run untested)")


def check_version(version: Optional[Tuple[int, int, int]] = None) -> None:
    """Stop (ImportError) on a megatron-core outside the supported range."""
    version = mcore_version() if version is None else version
    problem = version_problem(version)
    if problem is None:
        return
    if os.environ.get(SKIP_CHECK_ENV) == "1":
        import warnings

        warnings.warn(f"WARNING: {problem}; running anyway ({SKIP_CHECK_ENV}=1), results unverified")
        return
    raise ImportError(problem)


def grad_sync_wait_stream(version: Optional[Tuple[int, int, int]] = None):
    """The CUDA stream megatron's ``finish_grad_sync`` makes wait for the communication stream
    of the hierarchical (several-instance) sync: the default stream up to 0.16, the current
    stream from 0.17 (they differ when a caller runs backward on a stream of its own)."""
    import torch

    version = mcore_version() if version is None else version
    return torch.cuda.current_stream() if version >= (0, 17, 0) else torch.cuda.default_stream()
