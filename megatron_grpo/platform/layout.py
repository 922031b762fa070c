"""The run's parallel layout, as megatron-core's parallel state gives it (its public API): read
by the checkpoint code (written into each manifest, checked at load) and by GRPO's glue."""

from __future__ import annotations

from typing import List


def parallel_layout() -> List[int]:
    """[tensor-parallel size, pipeline-parallel size] of this run."""
    from megatron.core import parallel_state as ps

    return [ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()]
