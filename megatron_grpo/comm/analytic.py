"""Analytic data-parallel traffic of megatron-core's DDP + distributed optimizer.

Independent of the counting wrappers (megatron_grpo.comm.wire): this re-derives, from the
model's parameter shapes, how megatron-core 0.16.1 lays parameters into grad-buffer buckets
and what each step's reduce-scatter + all-gather must send. Tests compare it with the counted
bytes; the planner uses it for large models.

Megatron's layout rules (distributed/param_and_grad_buffer.py):
* parameters are taken in reverse ``named_parameters()`` order;
* with the distributed optimizer each parameter starts at a multiple of 64 elements, and each
  bucket's end is padded to a multiple of lcm(dp, 128);
* a bucket closes once it holds >= bucket_size elements (a parameter is never split);
  without a bucket size (no overlap) everything is one bucket.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple


def _pad(n: int, divisor: int) -> int:
    return int(math.ceil(n / divisor) * divisor)


def gpt_param_numels(num_layers: int, hidden: int, ffn_hidden: int, vocab_padded: int,
                     max_position: int, tp: int = 1, pre_process: bool = True,
                     post_process: bool = True, heads: int = 1, groups: int = 0,
                     swiglu: bool = False, norm_bias: bool = True, bias: bool = True) -> List[int]:
    """Parameter sizes of megatron-core's GPTModel (local spec, untied output layer) on one
    tensor-parallel rank, in ``named_parameters()`` order. GPT-2 style by default; Llama-style
    with ``max_position`` 0 (rotary: no position table), ``groups`` key/value groups of ``heads``
    (0: one per head), ``swiglu`` (fc1 2f wide), ``norm_bias`` False (RMSNorm) and ``bias``
    False (no linear biases)."""
    h, f = hidden, ffn_hidden
    qkv = h + 2 * (groups or heads) * (h // heads) if groups else 3 * h
    fc1 = 2 * f if swiglu else f
    norm = [h, h] if norm_bias else [h]

    def linear(out_per_rank: int, inp: int, row_parallel_bias: bool = False) -> List[int]:
        # Column-parallel biases are split like the output; row-parallel ones are whole.
        return [out_per_rank * inp] + ([h if row_parallel_bias else out_per_rank] if bias else [])

    out: List[int] = []
    if pre_process:
        out += [vocab_padded // tp * h] + ([max_position * h] if max_position else [])
    layer = (norm                                 # input_layernorm
             + linear(h, h // tp, True)           # linear_proj (row parallel)
             + linear(qkv // tp, h)               # linear_qkv (column parallel)
             + norm                               # pre_mlp_layernorm
             + linear(fc1 // tp, h)               # linear_fc1 (column parallel)
             + linear(h, f // tp, True))          # linear_fc2 (row parallel)
    out += layer * num_layers
    if post_process:
        out += norm + [vocab_padded // tp * h]  # final_layernorm; output_layer
    return out


def ddp_bucket_numels(param_numels: Sequence[int], bucket_size: Optional[int], dp: int,
                      distributed_optimizer: bool = True) -> List[int]:
    """Padded element count of every DDP bucket, in buffer order."""
    buckets: List[int] = []
    bucket_start = 0
    start = 0
    end = 0
    open_bucket = False
    for numel in reversed(list(param_numels)):
        if distributed_optimizer:
            start = _pad(start, 64)
        end = start + numel
        open_bucket = True
        if bucket_size is not None and end - bucket_start >= bucket_size:
            closed = _pad(end, math.lcm(dp, 128)) if distributed_optimizer else end
            buckets.append(closed - bucket_start)
            bucket_start = start = closed
            open_bucket = False
        else:
            start = end
    if open_bucket:
        closed = _pad(end, math.lcm(dp, 128)) if distributed_optimizer else end
        buckets.append(closed - bucket_start)
    return buckets


def baseline_step_bytes(bucket_numels: Sequence[int], dp: int, grad_bytes: int = 4,
                        param_bytes: int = 4, distributed_optimizer: bool = True) -> Tuple[int, int]:
    """(gradient bytes, parameter bytes) one rank sends per step under the ring model.

    Distributed optimizer: reduce-scatter of each gradient bucket, (dp-1)/dp of it, and the
    all-gather of updated parameters, the same share of the parameter bucket. Without it: one
    all-reduce of each gradient bucket, 2 (dp-1)/dp, and no parameter traffic.
    """
    if dp <= 1:
        return 0, 0
    if distributed_optimizer:
        grads = sum((dp - 1) * (n // dp) * grad_bytes for n in bucket_numels)
        params = sum((dp - 1) * (n // dp) * param_bytes for n in bucket_numels)
        return grads, params
    return sum((2 * (dp - 1) * n * grad_bytes) // dp for n in bucket_numels), 0


def fp32_accumulation_step_bytes(bucket_numels: Sequence[int], dp: int,
                                 param_bytes: int = 2) -> Tuple[int, int]:
    """(gradient bytes, parameter bytes) one rank sends per step with megatron-core's
    ``DistributedDataParallelConfig.reduce_scatter_with_fp32_accumulation`` (0.16.1,
    distributed/reduce_scatter_with_fp32_accumulation.py), a benchmark peer that is not run here.

    That reduce-scatter is one ``all_to_all_single`` of each bucket's gradient in the buffer's
    dtype, then a local fp32 sum of the dp chunks received. It needs a bf16 gradient buffer
    (bf16 parameters with ``grad_reduce_in_fp32=False``), so 2 bytes per element, and a rank
    keeps its own chunk: (dp-1) * (n/dp) * 2 per bucket, the ring reduce-scatter's share at
    half the fp32 bytes (``comm/wire.py`` counts the all-to-all the same way). The parameter
    all-gather is megatron's own, in the parameter dtype (``param_bytes``: 2 for bf16).
    """
    return baseline_step_bytes(bucket_numels, dp, grad_bytes=2, param_bytes=param_bytes)
