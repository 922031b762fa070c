"""Memory tier: chunks of tensors kept on device, in host memory or in a per-rank SSD file.

The chunk store (store.py, slot_file.py), the per-tier placement of optimizer state
(placement.py) and the error-feedback residuals (residuals.py); wired into training by
megatron_grpo/megatron/offload.py. See docs/offload.md.
"""

from .config import OffloadConfig, OffloadConfigError
from .slot_file import (OffloadCapacityError, OffloadDirError, OffloadError, OffloadOpenFilesError,
                        StagingPool, file_name)
from .store import ChunkStore, OffloadChecksumError, OffloadIOError

__all__ = [
    "ChunkStore", "OffloadCapacityError", "OffloadChecksumError", "OffloadConfig",
    "OffloadConfigError", "OffloadDirError", "OffloadError", "OffloadIOError", "OffloadOpenFilesError",
    "StagingPool", "file_name",
]
