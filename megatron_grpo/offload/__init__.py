"""Memory tier: chunks of tensors kept on device, in host memory or in a per-rank SSD file.

Only the chunk store exists so far (issue 10, item 1); it is not wired into training yet.
See docs/offload.md.
"""

from .config import OffloadConfig, OffloadConfigError
from .slot_file import (OffloadCapacityError, OffloadDirError, OffloadError, StagingPool,
                        file_name)
from .store import ChunkStore, OffloadChecksumError, OffloadIOError

__all__ = [
    "ChunkStore", "OffloadCapacityError", "OffloadChecksumError", "OffloadConfig",
    "OffloadConfigError", "OffloadDirError", "OffloadError", "OffloadIOError", "StagingPool",
    "file_name",
]
