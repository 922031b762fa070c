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

With ``release_grads`` (the default) and the distributed optimizer it also cuts the gradient
buffer into storage per bucket that comes and goes within a step (megatron/grad_storage.py):
DDP's gradient-accumulation hook first makes its bucket's storage resident
(``_make_backward_post_hook``), and with ``gradient_accumulation_fusion`` a hook on each
module's output gradient does so before the module's wgrad GEMM writes ``main_grad``. megatron's
whole-model gradient buffer is then never allocated: while megatron builds its buffers it is made
on the meta device (``_GradBufferOnMeta``), so setup holds the parameters and their buffer copy,
not the gradients too (measured: that was the peak of a run with the memory tier, bench memcap).

Without ``grpo_config``, or with GRPO disabled, it is megatron's class in every configuration
(bucket layout, later stages, ``disable_bucketing``): code that swaps it in for megatron's, such
as megatron-core's own unit tests, sees megatron's behaviour.
"""

import contextlib
import inspect
import sys

import torch
from torch.overrides import TorchFunctionMode

from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

from megatron_grpo.grpo.config import default_bucket_elements
from megatron_grpo.megatron import compat
from megatron_grpo.megatron.grad_storage import GradStorage, cut_buffer
from megatron_grpo.megatron.grad_accum import HostAccumulator


class _GradBufferOnMeta(TorchFunctionMode):
    """While megatron's DDP builds its buffers: the ``torch.zeros`` that
    ``_ParamAndGradBuffer.__init__`` (0.16.1) makes the whole-model gradient buffer with (the one
    after ``param_data``, which the distributed optimizer has) goes to the meta device. Its views
    (``main_grad``, each bucket's ``grad_data``) are meta tensors until ``cut_buffer`` gives
    every bucket storage of its own, before anything reads them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and self._grad_buffer():
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)

    @staticmethod
    def _grad_buffer() -> bool:
        frame = sys._getframe(1)
        for _ in range(4):  # the caller, past any dispatch frames
            if frame is None:
                return False
            if frame.f_code is _ParamAndGradBuffer.__init__.__code__:
                return getattr(frame.f_locals.get("self"), "param_data", None) is not None
            frame = frame.f_back
        return False


def _takes_weight(module: torch.nn.Module) -> bool:
    """Can ``module`` be called with a weight it does not own (megatron's
    ``ColumnParallelLinear.forward(input_, weight=None, ...)``, 0.16.1 through 0.19)?"""
    try:
        return "weight" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a builtin or C forward: it reads only its own parameters
        return False


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

                requested = default_bucket_elements(ps.get_data_parallel_world_size())
        self.__dict__["_grpo_requested_bucket_size"] = requested
        self.__dict__["grpo_grad_storage"] = None
        release = requested is not None and grpo_config.release_grads and ddp_config.use_distributed_optimizer
        if requested is not None and kwargs.get(compat.LAYOUT_ARGUMENT) is not None:
            # megatron >= 0.18: a layout precomputed from ddp_config.bucket_size (Megatron-LM's
            # get_model) would bypass the bucket size kept here (one bucket without overlap or
            # on later pipeline stages). Without it megatron computes the layout from
            # self.bucket_size, which is GRPO's; its distributed optimizer reads DDP's buffers.
            kwargs[compat.LAYOUT_ARGUMENT] = None
        with _GradBufferOnMeta() if release else contextlib.nullcontext():
            super().__init__(config, ddp_config, module, *args, **kwargs)
        if release:
            storage = GradStorage(grpo_config.grad_units_in_flight)
            if grpo_config.grad_accumulation == "host":
                storage.host_accum = HostAccumulator()
            cut_buffer(self, storage)
            self.__dict__["grpo_grad_storage"] = storage
            if getattr(config, "gradient_accumulation_fusion", False):
                self._grpo_pre_backward_hooks(storage)

    # -- extends DistributedDataParallel._make_backward_post_hook ------------------------------------
    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        hook = super()._make_backward_post_hook(param)

        def allocate_then_hook(*args):
            storage = self.__dict__.get("grpo_grad_storage")
            if storage is not None and param.requires_grad:
                storage.ensure_param(param)  # before megatron adds param.grad into main_grad
            return hook(*args)

        return allocate_then_hook

    def _grpo_pre_backward_hooks(self, storage: GradStorage) -> None:
        """The fused wgrad GEMM accumulates into ``main_grad`` inside the module's backward,
        before the gradient-accumulation hook runs: allocate when the gradient of the module's
        output arrives, which is before that backward starts.

        A module may also write the ``main_grad`` of a weight it does not own: with tied
        embeddings megatron builds the output layer (and multi-token-prediction heads) with
        ``skip_weight_param_allocation`` and passes the word embedding's weight in as
        ``weight=``. That layer's backward is the first of the pass, long before the
        embedding's own, so the parameters a module is *called with* count as its own here."""
        def on_output_grad(params):
            def hook(grad):
                for p in params:
                    if p.requires_grad:
                        storage.ensure_param(p)
                return grad
            return hook

        def forward_hook(module, args, kwargs, output):
            params = list(module.__dict__.get("_grpo_direct_params", ()))
            for a in (*args, *kwargs.values()):
                # By identity: a list's ``in`` compares tensors with ``==``, which raises for two
                # parameters of different shapes (a tied head called with its weight and a bias).
                if isinstance(a, torch.nn.Parameter) and a in storage.of_param \
                        and all(a is not q for q in params):
                    params.append(a)
            if not params:
                return None
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outputs:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(on_output_grad(params))
            return None

        for m in self.module.modules():
            direct = [p for p in m.parameters(recurse=False) if p in storage.of_param]
            if direct or _takes_weight(m):
                m.__dict__["_grpo_direct_params"] = direct
                m.register_forward_hook(forward_hook, with_kwargs=True)

    @property
    def bucket_size(self):
        return self.__dict__.get("_grpo_bucket_size")

    @bucket_size.setter
    def bucket_size(self, value):
        if value is None:
            value = self.__dict__.get("_grpo_requested_bucket_size")
        self.__dict__["_grpo_bucket_size"] = value
