"""The sampled backward inside megatron's linear layers (local spec).

megatron's ``ColumnParallelLinear`` and ``RowParallelLinear`` call ``self._forward_impl`` with
keyword arguments (0.16.1 through 0.19.x); ``install`` wraps it on each layer whose weight sits in
a GRPO tier unit. A call from a unit whose keep ratio is 1 (core, the warm-up, a frozen weight, a
deferred embedding wgrad, an option this module does not carry) goes to megatron's own function
unchanged, so core gradients are megatron's, bit for bit. Otherwise ``_SampledLinear`` runs: its
forward is megatron's (the sequence-parallel all-gather, then x W^T + b); its backward computes

* the data gradient exactly (or, with --grpo-sample-dgrad, from rows sampled by |dy_i|), then
  megatron's tensor-parallel all-reduce or sequence-parallel reduce-scatter;
* the weight gradient from the rows ``megatron_grpo.compute.sampler`` keeps, reweighted by 1/p;
  under gradient-accumulation fusion it is added to ``main_grad`` (the fused kernel when
  present) and a dummy ``grad_weight`` returned with ``grad_added_to_main_grad`` set, exactly
  as megatron does, so DDP's backward hook sees the parameter ready;
* the bias gradient exactly (a column sum: nothing to save).

Tensor parallelism: a column-parallel layer holds all of x but a slice of dy's features, a
row-parallel one the reverse, so the sliced side's squared row norms are summed over the
tensor-parallel group first (N floats): every TP rank computes the same probabilities and, from
the same generator seed (``SampledBackward.generator``), keeps the same rows.

TE layers (``--transformer-impl transformer_engine``) keep their GEMMs in TE's own autograd
functions (``_Linear``; a delayed wgrad only with ``overlap_moe_expert_parallel_comm`` in 0.16.1):
--grpo-sampled-backward refuses them, naming the layer and the way out.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from megatron_grpo.compute import sampler
from megatron_grpo.compute.plan import SampledBackward
from megatron_grpo.grpo.config import ConfigError

NEUTRAL_KWARGS = {"gtp_remat_size": 1}
"""Arguments newer megatron releases pass to ``_forward_impl`` that this module carries only at
these values (0.19's GTP re-materialisation shards the weight): any other value runs exact."""


class Site:
    """One linear layer: its tier unit, which side of its GEMM tensor parallelism slices, and
    the plan it asks for its keep ratio."""

    def __init__(self, plan: SampledBackward, unit: int, column: bool, tp_group) -> None:
        self.plan = plan
        self.unit = unit
        self.column = column
        """Column-parallel: dy's features are sliced over TP; row-parallel: x's are."""
        self.tp_group = tp_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
        self.position: Optional[int] = None
        """Where the first forward called this layer with this unit's weight (its latest such
        call: the most below it); the plan's data-gradient rule reads it."""

    def keep(self) -> float:
        return self.plan.keep(self.unit)

    def tier(self) -> str:
        return self.plan.tier(self.unit)

    def count(self, rows: int, fan_in: int, fan_out: int, wgrad_rows: int, dgrad_rows: int,
              wgrad: bool = True) -> None:
        self.plan.flops.linear(self.tier(), rows, fan_in, fan_out, wgrad_rows, dgrad_rows, wgrad)

    def sync_norms(self, sq: torch.Tensor) -> torch.Tensor:
        """The full row norms of the sliced side: a sum over the tensor-parallel group."""
        if self.tp > 1:
            dist.all_reduce(sq, group=self.tp_group)
        return sq


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[s, b, h] -> [s*b, h] (contiguous, as megatron's prepare_input_tensors_for_wgrad_compute)."""
    t = t.contiguous()
    return t.view(-1, t.shape[-1])


def _gather_sequence(input: torch.Tensor, tp_group) -> torch.Tensor:
    """Sequence parallelism: the whole sequence from every TP rank's slice (dimension 0)."""
    world = dist.get_world_size(tp_group)
    out = torch.empty((input.shape[0] * world,) + tuple(input.shape[1:]), dtype=input.dtype,
                      device=input.device)
    dist.all_gather_into_tensor(out, input.contiguous(), group=tp_group)
    return out


def _probabilities(site: Site, a: torch.Tensor, keep: float) -> torch.Tensor:
    if site.plan.config.sample_policy == "uniform":
        return sampler.uniform_probabilities(a, keep)
    return sampler.probabilities(a, keep)


class _SampledLinear(torch.autograd.Function):
    """megatron's linear forward; a backward whose weight gradient (and optionally data
    gradient) is computed from sampled rows. See the module docstring."""

    @staticmethod
    def forward(ctx, input, weight, bias, fusion, allreduce_dgrad, sequence_parallel, tp_group, site):
        ctx.save_for_backward(input, weight)
        # main_grad is kept on ctx, not saved: megatron's reason (a module reused across layers).
        ctx.main_grad = weight.main_grad if fusion and hasattr(weight, "main_grad") else None
        ctx.fusion, ctx.use_bias = fusion, bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        ctx.site = site
        total = _gather_sequence(input, tp_group) if sequence_parallel else input
        output = torch.matmul(total, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        site: Site = ctx.site
        plan = site.plan
        if ctx.fusion:
            weight.main_grad = ctx.main_grad
        total = _gather_sequence(input, ctx.tp_group) if ctx.sequence_parallel else input
        dy, x = _flat(grad_output), _flat(total)
        rows, fan_out, fan_in = dy.shape[0], weight.shape[0], weight.shape[1]
        keep = site.keep()
        dy_sq, x_sq = sampler.row_norms_sq(dy), sampler.row_norms_sq(x)
        if site.column:
            dy_sq = site.sync_norms(dy_sq)
        else:
            x_sq = site.sync_norms(x_sq)
        leverage = (dy_sq * x_sq).sqrt()
        if plan.measuring:
            # Device tensors, summed on the device: the host never waits on the backward here.
            plan.record(site.unit, sampler.keep_ratio_for_budget(leverage, plan.config.sample_variance_budget),
                        (leverage > 0).sum())
        generator = plan.generator(dy.device)
        count = sampler.draw_count(rows, keep)  # fixed before the draw: no data-dependent shape

        # Data gradient: every row (megatron's), or the rows kept by |dy_i|.
        if plan.samples_dgrad(site.unit, site.position):
            d_kept, d_weight = sampler.draw(_probabilities(site, dy_sq.sqrt(), keep), generator, count)
            plan.note_rows(d_kept)
            grad_flat = torch.zeros((rows, fan_in), dtype=dy.dtype, device=dy.device)
            part = (dy.index_select(0, d_kept) * d_weight.to(dy.dtype).unsqueeze(1)).matmul(weight)
            # index_add_: a phantom draw lands on row N-1 with weight 0, possibly beside a real
            # draw of that row; adding keeps the real one.
            grad_flat.index_add_(0, d_kept, part)
            dgrad_rows = count
        else:
            grad_flat = dy.matmul(weight)
            dgrad_rows = rows
        grad_input = grad_flat.view(tuple(total.shape[:-1]) + (fan_in,))
        handle, sub_grad_input = None, None
        if ctx.allreduce_dgrad:
            # Overlapped with the weight-gradient GEMM below, as megatron does.
            handle = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        if ctx.sequence_parallel:
            sub_grad_input = torch.empty(tuple(input.shape), dtype=input.dtype, device=input.device)
            handle = dist.reduce_scatter_tensor(sub_grad_input, grad_input.contiguous(),
                                                group=ctx.tp_group, async_op=True)

        # Weight gradient from the rows kept by leverage |dy_i| |x_i|, reweighted by 1/p.
        kept, w = sampler.draw(_probabilities(site, leverage, keep), generator, count)
        plan.note_rows(kept)
        dy_s = dy.index_select(0, kept) * w.to(dy.dtype).unsqueeze(1)
        x_s = x.index_select(0, kept)
        grad_weight = _weight_gradient(ctx, weight, dy_s, x_s, input.dtype)
        grad_bias = dy.sum(dim=0) if ctx.use_bias else None
        site.count(rows, fan_in, fan_out, count, dgrad_rows)
        if handle is not None:
            handle.wait()
        grad = sub_grad_input if ctx.sequence_parallel else grad_input
        return grad, grad_weight, grad_bias, None, None, None, None, None


def _weight_gradient(ctx, weight, dy_s, x_s, dtype):
    """The sampled weight gradient, returned or, under gradient-accumulation fusion, added to
    ``main_grad`` with megatron's dummy-gradient protocol (layers.py, 0.16.1)."""
    if not ctx.fusion:
        return dy_s.t().matmul(x_s)
    from megatron.core.tensor_parallel import layers as mlayers

    fused = getattr(mlayers, "fused_weight_gradient_mlp_cuda", None)
    main_grad = weight.main_grad
    if fused is not None and main_grad.dtype == torch.float32:
        fused.wgrad_gemm_accum_fp32(x_s, dy_s, main_grad)
    elif fused is not None and main_grad.dtype in (torch.float16, torch.bfloat16):
        fused.wgrad_gemm_accum_fp16(x_s, dy_s, main_grad)
    else:
        main_grad.add_(dy_s.t().matmul(x_s).to(main_grad.dtype))
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # A dummy gradient keeps DDP's hook on the main thread (megatron's reason); its values are
    # never read, except as zeros under zero_out_wgrad.
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(tuple(main_grad.shape), dtype=dtype, device=main_grad.device)


def _wrap(original, sites: dict, unit_of: dict, plan: SampledBackward, column: bool, tp_group):
    """The replacement ``_forward_impl`` of one layer. Its weight may come per call (the output
    layer given the tied word embedding), so the unit is looked up from the weight each time."""

    def forward_impl(input, weight, bias=None, gradient_accumulation_fusion=False,
                     allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=None,
                     wgrad_deferral_limit=None, tp_group=None, **rest):
        args = dict(bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                    allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                    grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit,
                    tp_group=tp_group, **rest)
        unit = unit_of.get(id(weight))
        if unit is None:
            return original(input, weight, **args)
        site = sites.get(unit)
        if site is None:
            site = sites[unit] = Site(plan, unit, column, tp_group_default)
        if not plan.order_recorded:
            # Its data gradient flows into every use recorded so far (its own module's included).
            site.position = plan.position()
            plan.record_use([unit] + ([unit_of[id(bias)]] if id(bias) in unit_of else []))
        exact = (not plan.samples(unit) or not weight.requires_grad or grad_output_buffer is not None
                 or any(rest.get(k, v) != v for k, v in NEUTRAL_KWARGS.items()))
        if exact:
            if torch.is_grad_enabled():
                rows = math.prod(input.shape[:-1]) * (site.tp if sequence_parallel else 1)
                # No data gradient below the frozen prefix's cut (frozen_prefix.py): an input
                # that needs none gets none from autograd.
                site.count(rows, weight.shape[1], weight.shape[0], rows,
                           rows if input.requires_grad else 0, weight.requires_grad)
            return original(input, weight, **args)
        group = tp_group if tp_group is not None else site.tp_group
        return _SampledLinear.apply(input, weight, bias, gradient_accumulation_fusion,
                                    allreduce_dgrad, sequence_parallel, group, site)

    tp_group_default = tp_group
    return forward_impl


def refuse_te(modules) -> None:
    """--grpo-sampled-backward with TE linear layers: a clear stop at build."""
    for name, module in modules:
        if type(module).__name__.startswith("TE") and getattr(module, "weight", None) is not None:
            raise ConfigError(
                f"rank {dist.get_rank() if dist.is_initialized() else 0}: --grpo-sampled-backward "
                f"samples the weight gradients of megatron's local-spec linear layers; {name} is "
                f"{type(module).__name__} (transformer-engine), whose GEMMs run inside TE's own "
                f"autograd functions. Build with --transformer-impl local, or drop "
                f"--grpo-sampled-backward")


def install(ddp_chunks: list, units: list, plan: SampledBackward) -> int:
    """Wrap every local-spec linear layer (``units``: the controller's TierUnits, whose
    ``params`` say which unit a weight is in); returns how many were wrapped (0: a TE model,
    whose FLOPs are then not counted)."""
    from megatron.core.parallel_state import get_tensor_model_parallel_group
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    unit_of = {id(p): u.index for u in units for p in u.params}
    wrapped = 0
    _record_forward_order(ddp_chunks, unit_of, plan)
    for chunk in ddp_chunks:
        named = list(chunk.module.named_modules())
        if plan.config.sampled_backward:
            refuse_te(named)
        for name, module in named:
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            group = getattr(module, "tp_group", None) or get_tensor_model_parallel_group()
            module._forward_impl = _wrap(module._forward_impl, {}, unit_of, plan,
                                         isinstance(module, ColumnParallelLinear), group)
            wrapped += 1
    return wrapped


def _record_forward_order(ddp_chunks: list, unit_of: dict, plan: SampledBackward) -> None:
    """Hooks that record, in the first forward, which units' parameters each module uses in
    turn (a module's own parameters, before it runs; the wrapped layers add the weight they are
    called with), then remove themselves. One model chunk per rank (no virtual pipeline here),
    so the recorded order is this stage's forward."""
    handles = []

    def before(module, args):
        units = [unit_of[id(p)] for p in module.parameters(recurse=False) if id(p) in unit_of]
        if units:
            plan.record_use(units)

    def after(module, args, output):
        plan.end_recording()
        for h in handles:
            h.remove()

    for chunk in ddp_chunks:
        for module in chunk.module.modules():
            if any(id(p) in unit_of for p in module.parameters(recurse=False)):
                handles.append(module.register_forward_pre_hook(before))
        handles.append(chunk.module.register_forward_hook(after))
