"""GRPODistributedDataParallel: megatron DDP that keeps its buckets (GRPO's tier units) when GRPO is on.

megatron-core builds one bucket per buffer in two cases: on pipeline stages after the first
(their data-parallel communication is off the critical path) and whenever
``overlap_grad_reduce`` is False (``ddp_config.bucket_size = None``). A tier needs several units,
and with one bucket GRPO would run all-core. So, given ``grpo_config`` with GRPO enabled
(grpo_hooks passes it), this subclass keeps the requested ``ddp_config.bucket_size`` in both
cases. It replaces only the assignment ``self.bucket_size = ...`` made in
``DistributedDataParallel.__init__`` (0.16.1), through a property, before the buffers are built.
Without overlap, megatron still issues every bucket's sync from ``finish_grad_sync``
(synchronously, after backward), so GRPO's per-bucket paths apply there too; importance is then
measured after backward rather than during it.

Without ``grpo_config``, or with GRPO disabled, it is megatron's class in every configuration
(bucket layout, later stages, ``disable_bucketing``): code that swaps it in for megatron's, such
as megatron-core's own unit tests, sees megatron's behaviour.
"""

from megatron.core.distributed import DistributedDataParallel


def default_bucket_size(dp: int) -> int:
    """megatron's bucket size when none is given (distributed_data_parallel.py, 0.16.1)."""
    return max(40000000, 1000000 * dp)


class GRPODistributedDataParallel(DistributedDataParallel):
    """megatron's DistributedDataParallel; ``grpo_config`` (a GRPOConfig) with ``enabled``
    keeps one bucket per ``ddp_config.bucket_size`` elements on every stage, with or without
    overlap. Other arguments are megatron's."""

    def __init__(self, config, ddp_config, module, *args, grpo_config=None, **kwargs):
        # None: megatron's own assignments stand (see the setter).
        requested = None
        if grpo_config is not None and grpo_config.enabled:
            # Read before megatron resets it to None for --no-overlap-grad-reduce; unset, it is
            # megatron's own default (distributed_data_parallel.py, 0.16.1).
            requested = ddp_config.bucket_size
            if requested is None:
                from megatron.core import parallel_state as ps

                requested = default_bucket_size(ps.get_data_parallel_world_size())
        self.__dict__["_grpo_requested_bucket_size"] = requested
        super().__init__(config, ddp_config, module, *args, **kwargs)

    @property
    def bucket_size(self):
        return self.__dict__.get("_grpo_bucket_size")

    @bucket_size.setter
    def bucket_size(self, value):
        if value is None:
            value = self.__dict__.get("_grpo_requested_bucket_size")
        self.__dict__["_grpo_bucket_size"] = value
