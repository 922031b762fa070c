"""GRPODistributedDataParallel: megatron DDP that keeps bucketing on every pipeline stage.

megatron-core turns bucketing off on pipeline stages after the first (one bucket per stage:
their data-parallel communication is off the critical path). A tier needs several units per
stage, so this subclass keeps ``ddp_config.bucket_size`` on every stage. It replaces only the
assignment ``self.bucket_size = None`` made in ``DistributedDataParallel.__init__`` (0.16.1),
through a property, before the buffers are built; nothing else changes.
"""

from megatron.core.distributed import DistributedDataParallel


class GRPODistributedDataParallel(DistributedDataParallel):
    @property
    def bucket_size(self):
        return self.__dict__.get("_grpo_bucket_size")

    @bucket_size.setter
    def bucket_size(self, value):
        if value is None and self.ddp_config.overlap_grad_reduce:
            value = self.ddp_config.bucket_size
        self.__dict__["_grpo_bucket_size"] = value
