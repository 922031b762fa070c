"""OffloadConfig: the settings of the memory tier: what is offloaded, where, and how
the chunk store moves it. One section of the training config: ``--grpo-offload {none,cpu,ssd}``,
``--grpo-offload-dir``, ``--grpo-offload-chunk-mb`` ... (YAML keys without the dashes).
``validate()`` names the field, the accepted values and the value it got.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MB = 1 << 20
ALIGN = 4096  # file slot / O_DIRECT alignment in bytes: a page, and the usual logical block size
FALLBACKS = ("error", "cpu")
TARGETS = ("none", "cpu", "ssd")
IO_MODES = ("direct", "buffered")


class OffloadConfigError(ValueError):
    """An offload setting is out of range; the message names the field and the accepted values."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class OffloadConfig:
    """Memory tier: GRPO's optimizer state and residuals kept in host memory or on SSD in
    chunks, moved by background threads (docs/offload.md)."""

    FLAG_PREFIX = "grpo-offload-"
    FLAG_NAMES = {"target": "--grpo-offload", "offload_dir": "--grpo-offload-dir",
                  "memory_budget_gb": "--grpo-memory-budget-gb"}

    target: str = "none"
    """Where GRPO's offloadable state lives between uses (with --grpo): none (device memory);
    cpu (host memory); ssd (one file per rank in --grpo-offload-dir). What moves: the optimizer
    state of the dynamic and stable tiers (see --grpo-offload-stream) and the error-feedback
    residuals (--grpo-offload-residuals); core units stay resident after warm-up."""
    chunk_mb: float = 128.0
    """Chunk size in MB (2**20 bytes). A registered tensor is cut into chunks of this many bytes;
    its last chunk may be shorter. Must come to a whole multiple of 4096 bytes (0.25 is fine)."""
    stream: bool = True
    """With --grpo-offload cpu|ssd: the dynamic tier's Adam moments and fp32 masters (the stable
    tier's at its updates; every unit's during the exact warm-up) pass through the optimizer step
    one tier unit at a time, three allocated at most. Off: only the stable tier's state moves,
    between its updates, prefetched one step ahead (the peak, an update step, holds all)."""
    core: bool = False
    """With --grpo-offload cpu|ssd and --grpo-offload-stream: the core tier's masters and Adam
    moments (and, with --grpo-offload-grads, its gradient shards) stream through the optimizer
    step too, as every unit's do in the warm-up, instead of staying on the device. For the
    largest models, where the core tier's 12 bytes per element are what the device runs out
    of; it costs their transfer every step."""
    residuals: bool = True
    """With --grpo-offload cpu|ssd: the dynamic tier's error-feedback residuals (one fp32 copy
    of each dynamic bucket on every rank) also live away between their read in backward and
    their write after the optimizer step; a few are resident at a time."""
    grads: bool = True
    """With --grpo-offload cpu|ssd, --grpo-offload-stream and gradient release: the gradient
    shard of every unit the optimizer step streams goes to host memory or SSD right after its
    sync and comes back just before its unit's update, instead of every shard staying resident
    from its sync to the step (the gradient norm and clipping use norms taken at release)."""
    offload_dir: Optional[str] = None
    """Directory for the SSD tier: one preallocated file per rank, grpo-offload-rankNNNNN.bin.
    Use a local disk; None means no SSD tier (needed with --grpo-offload ssd)."""
    fallback: str = "error"
    """What happens when the SSD file cannot be created (missing, unwritable or too small
    directory): error raises at construction; cpu warns and keeps SSD-bound chunks in host
    memory."""
    io_workers: int = 2
    """Background threads doing the copies and file I/O. Two keep a read and a write in flight."""
    staging_buffers: int = 2
    """Reusable host buffers of one chunk each used for file I/O; host memory for staging is at
    most staging_buffers x chunk size, whatever the number of chunks in flight."""
    capacity: int = 0
    """Bytes of the SSD file, allocated up front (rounded up to 4096); each chunk on SSD takes
    its length rounded up to 4096. 0 in a training run: the planned bytes (every offloadable
    state tensor of the rank at once), so a too-small disk fails before step 1."""
    memory_budget_gb: float = 0.0
    """Per-rank memory budget in GB (10**9 bytes): device memory on CUDA, the resident set on
    CPU; 0 = off. With --grpo-offload cpu|ssd (where state may go), the training entry asks the
    planner for the peak of each placement in tier order -- everything resident; the dynamic and
    stable tiers' optimizer state streamed (--grpo-offload-stream); their error-feedback
    residuals away too (--grpo-offload-residuals) -- and takes the first that fits, overriding
    those two flags; none fitting is an error before step 1. Core state stays resident."""
    io_mode: str = "direct"
    """File I/O: direct (O_DIRECT, no page cache; falls back to buffered where the filesystem
    refuses it) or buffered (page cache, no fsync). The default is the faster one measured in
    docs/offload.md."""

    @property
    def chunk_bytes(self) -> int:
        return int(round(self.chunk_mb * MB))

    def flag(self, field: str) -> str:
        return self.FLAG_NAMES.get(field, "--" + self.FLAG_PREFIX + field.replace("_", "-"))

    def validate(self, planned: bool = False) -> "OffloadConfig":
        """Check every field. planned=True (a training run): capacity 0 means "the planned
        bytes", and target ssd needs offload_dir. Errors name the field and, with planned, its
        flag."""
        def fail(field: str, accepted: str, value) -> None:
            name = f"{self.flag(field)} (OffloadConfig.{field})" if planned else f"OffloadConfig.{field}"
            raise OffloadConfigError(f"{name} must be {accepted}, got {value!r}")

        if self.target not in TARGETS:
            fail("target", "one of " + ", ".join(TARGETS), self.target)
        if planned and self.target == "ssd" and not self.offload_dir:
            fail("offload_dir", "a local directory with --grpo-offload ssd", self.offload_dir)

        if isinstance(self.chunk_mb, bool) or not isinstance(self.chunk_mb, (int, float)) \
                or not self.chunk_mb > 0:
            fail("chunk_mb", "a positive number of MB", self.chunk_mb)
        if self.chunk_bytes % ALIGN or abs(self.chunk_mb * MB - self.chunk_bytes) > 0.5:
            fail("chunk_mb", f"a whole multiple of {ALIGN} bytes ({ALIGN / MB:g} MB)",
                 self.chunk_mb)
        if self.offload_dir is not None and (not isinstance(self.offload_dir, str)
                                             or not self.offload_dir):
            fail("offload_dir", "a directory path or None", self.offload_dir)
        if self.fallback not in FALLBACKS:
            fail("fallback", "one of " + ", ".join(FALLBACKS), self.fallback)
        if self.io_mode not in IO_MODES:
            fail("io_mode", "one of " + ", ".join(IO_MODES), self.io_mode)
        for name in ("io_workers", "staging_buffers"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                fail(name, "an integer >= 1", value)
        if isinstance(self.memory_budget_gb, bool) or not isinstance(self.memory_budget_gb, (int, float)) \
                or not self.memory_budget_gb >= 0:
            fail("memory_budget_gb", "a number of GB >= 0 (0: no budget)", self.memory_budget_gb)
        if planned and self.memory_budget_gb and self.target == "none":
            fail("target", "cpu or ssd with --grpo-memory-budget-gb (where state may move)",
                 self.target)
        if self.core and not self.stream:
            fail("core", "off without --grpo-offload-stream (the core tier's state can only "
                 "leave the device streamed)", self.core)
        if not _is_int(self.capacity) or self.capacity < 0:
            fail("capacity", "an integer number of bytes >= 0", self.capacity)
        if self.offload_dir is not None and self.capacity == 0 and not planned:
            fail("capacity", "> 0 bytes when offload_dir is set (the SSD file is allocated up "
                 "front)", self.capacity)
        return self
