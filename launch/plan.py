"""Predict per-GPU memory and per-step data-parallel traffic, megatron baseline vs GRPO.

    python launch/plan.py --config launch/configs/gpt_70b.yaml --nodes 16 --gpus-per-node 8 \
        --gpu-memory-gb 80 --link-gbps 400 [any training flag, e.g. --micro-batch-size 2]
    python launch/plan.py --all-presets          # the table in docs/planner.md
    python launch/plan.py --config launch/configs/gpt_70b.yaml --nodes 16 \
        --num-distributed-optimizer-instances 16  # + inter-node bytes, flat vs hierarchical
    python launch/plan.py --step-time             # modelled step time, megatron vs GRPO
    python launch/plan.py --config launch/configs/gpt_8b.yaml --largest-model --search \
        --host-memory-gb 2000 --nvme-gb 30000 [--json]   # megatron's and GRPO's best on one node

Model and GRPO settings are read exactly as launch/pretrain_gpt.py reads them (same YAML, same
flags, same validation against the world size). Nothing is built and no GPU is needed.
Formulas and assumptions: docs/planner.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_grpo.training.memory_budget import spec_from_flags  # noqa: E402  (after the path)

# The docs table: H100 80 GB nodes of 8 GPUs with one 400 Gb/s NIC per GPU, transformer-engine
# (flash) attention, a 128,256-token vocabulary (Llama 3 size). Node counts: the smallest that
# give each preset's TP x PP layout a data-parallel size of at least 4 across nodes (8B: 8).
PRESETS: Tuple[Tuple[str, str, int], ...] = (
    ("GPT 8B", "launch/configs/gpt_8b.yaml", 2),
    ("GPT 70B", "launch/configs/gpt_70b.yaml", 16),
    ("GPT 200B", "launch/configs/gpt_200b.yaml", 32),
    ("GPT 405B", "launch/configs/gpt_405b.yaml", 56),
)
PRESET_CLUSTER = dict(gpus_per_node=8, gpu_memory_gb=80.0, link_gbps=400.0)
DEFAULT_VOCAB = 128256
# The step-time table (docs/planner.md, "Step time (modelled, not measured)"): 8B, 70B, 200B;
# 405B needs a multiple of 112 GPUs, which none of the three clusters has.
STEP_TIME_PRESETS = PRESETS[:3]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Any launch/pretrain_gpt.py flag (--config FILE.yaml, --micro-batch-size, --bf16, "
               "--grpo-*, ...) sets the model and GRPO settings; --data-path is not needed.")
    p.add_argument("--all-presets", action="store_true",
                   help="print the docs table for the four launch/configs/gpt_*.yaml presets")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the job")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU, GB (10^9 bytes)")
    p.add_argument("--link-gbps", type=float, default=400.0,
                   help="inter-node bandwidth per GPU, Gbit/s (one NIC per GPU)")
    p.add_argument("--nvlink-gbps", type=float, default=3600.0,
                   help="intra-node bandwidth per GPU, Gbit/s (used when a DP group fits in a node)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                   help="tokenizer vocabulary before padding (the data decides it in training; "
                        "byte tokenizer: 258)")
    p.add_argument("--largest-model", action="store_true",
                   help="also search the largest --num-layers (the rest of the config kept) whose "
                        "peak per GPU fits --gpu-memory-gb, baseline and GRPO (with the --grpo-offload "
                        "flags given), and megatron's optimizer_cpu_offload and Megatron-FSDP "
                        "(predictions); docs/planner.md")
    p.add_argument("--reserve-gb", type=float, default=0.0,
                   help="with --largest-model: memory per GPU held outside model state and "
                        "activations (CUDA context, NCCL buffers, fragmentation; on CPU the "
                        "process's runtime), GB")
    p.add_argument("--search", action="store_true",
                   help="with --largest-model on one node: search TP, PP, sequence parallelism, "
                        "recompute, megatron's memory options (DistributedOptimizer, Megatron-FSDP, "
                        "optimizer_cpu_offload with its fraction; fp32 or bf16 gradients) and GRPO's "
                        "(memory tier off, on host RAM or NVMe, core tier streamed or not, gradients "
                        "accumulated on the device or the host) for the largest model of the "
                        "config's shape, each with a predicted step time; docs/planner.md")
    p.add_argument("--host-memory-gb", type=float, default=2000.0,
                   help="with --search: host RAM of the node, GB")
    p.add_argument("--host-reserve-gb", type=float, default=100.0,
                   help="with --search: host RAM kept for the OS, data loaders and the ranks' "
                        "processes, GB per node")
    p.add_argument("--nvme-gb", type=float, default=30000.0,
                   help="with --search: NVMe of the node for offloaded state, GB")
    p.add_argument("--pcie-gbs", type=float, default=25.0,
                   help="with --search: host <-> GPU copy rate per GPU and direction, GB/s")
    p.add_argument("--nvme-gbs", type=float, default=12.0,
                   help="with --search: NVMe read or write rate of the node, GB/s")
    p.add_argument("--host-adam-rate", type=float, default=2.0e9,
                   help="with --search: parameters the node's CPUs update with Adam per second")
    p.add_argument("--mfu", type=float, default=0.40,
                   help="with --search: model FLOPs utilisation of the compute")
    p.add_argument("--json", action="store_true",
                   help="with --search: print the result as JSON ({\"megatron\": {\"params\", "
                        "\"config\", \"step_s\"}, \"grpo\": {...}, ...})")
    p.add_argument("--step-time", action="store_true",
                   help="print the modelled step time of megatron and GRPO (eager and fused codec, "
                        "with the link-aware decision) on one NVLink node, 16 nodes of 400 Gb/s IB "
                        "and 16 nodes of 100 Gb/s Ethernet: the gpt_8b/70b/200b presets, or the "
                        "--config given; docs/planner.md")
    p.add_argument("--step-time-grad-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="with --step-time: gradients on the exact path's wire (bf16: megatron's "
                        "bf16 reduce-scatter; fp32: grad_reduce_in_fp32)")
    p.add_argument("--attention", choices=("flash", "unfused"), default="flash",
                   help="flash: transformer-engine attention on CUDA; unfused: megatron's local "
                        "spec (CPU mode), which keeps the s x s scores")
    return p


def preset_plans():
    from megatron_grpo.planner.plan import plan

    out = []
    for name, config, nodes in PRESETS:
        model, cluster, grpo, bucket, _ = spec_from_flags(
            ["--config", os.path.join(REPO, config)], nodes, **PRESET_CLUSTER)
        out.append((name, plan(model, cluster, grpo, bucket_size=bucket)))
    return out


def presets_table() -> str:
    from megatron_grpo.planner.plan import format_table

    plans = preset_plans()
    return format_table([p for _, p in plans], [n for n, _ in plans])


def step_time_table(train_argv: List[str], grad_dtype: str = "bf16", vocab: int = DEFAULT_VOCAB,
                    attention: str = "flash") -> str:
    """--step-time: the presets (or the --config in ``train_argv``) on the three clusters."""
    from megatron_grpo.planner.steptime import CLUSTERS, StepTimeConfig, format_break_even, \
        format_steptime, predict
    from megatron_grpo.training.arguments import ConfigError

    cfg = StepTimeConfig(grad_bytes=2 if grad_dtype == "bf16" else 4)
    if "--config" in train_argv:
        name = os.path.basename(train_argv[train_argv.index("--config") + 1])
        configs = [(name, list(train_argv))]
    else:
        configs = [(n, ["--config", os.path.join(REPO, c), *train_argv]) for n, c, _ in STEP_TIME_PRESETS]
    rows, units = [], None
    for name, argv in configs:
        spec, errors = None, []
        # Read once, on a cluster the layout fits (the parser checks TP x PP against the world);
        # the memory and link figures it also takes do not enter the step time.
        for c in sorted(CLUSTERS, key=lambda c: -c.nodes):
            try:
                spec = spec_from_flags(argv, c.nodes, c.gpus_per_node, 80.0, 400.0, vocab, attention)
                break
            except (ConfigError, ValueError) as exc:
                errors.append(str(exc))
        if spec is None:
            raise ValueError(f"{name}: fits none of the step-time clusters: {errors[0]}")
        model, cluster, grpo, bucket, _ = spec
        units = units or grpo.bucket_elements
        rows += [predict(model, cluster.tp, cluster.pp, grpo, c, cfg, bucket, name) for c in CLUSTERS]
    return format_steptime(rows, cfg) + "\n\n" + format_break_even(units, cfg)


def largest_models(model, cluster, grpo, bucket, offload, memory_gb: float, reserve_gb: float) -> str:
    """--largest-model: the largest layer count under memory_gb per GPU of the baseline, GRPO and
    megatron-core's own memory options (CPU optimizer offload, Megatron-FSDP: predictions)."""
    from megatron_grpo.planner.capacity import WHICH, format_capacity, largest_model

    if reserve_gb < 0 or reserve_gb >= memory_gb:
        raise ValueError(f"--reserve-gb must be >= 0 and below --gpu-memory-gb ({memory_gb:g}), "
                         f"got {reserve_gb:g}")
    caps = [largest_model(model, cluster, grpo, int(memory_gb * 1e9), which,
                          reserve_bytes=int(reserve_gb * 1e9), bucket_size=bucket, offload=offload)
            for which in WHICH]
    return format_capacity(caps, memory_gb, reserve_gb)


def searched(args, model, grpo, bucket, offload) -> str:
    """--largest-model --search: megatron's and GRPO's best on one node (planner/search.py)."""
    import json

    from megatron_grpo.planner.search import Node, search
    from megatron_grpo.planner.search_format import format_search

    if args.nodes != 1:
        raise ValueError(f"--search sizes one node; got --nodes {args.nodes}")
    node = Node(gpus=args.gpus_per_node, gpu_memory_gb=args.gpu_memory_gb,
                host_memory_gb=args.host_memory_gb, nvme_gb=args.nvme_gb, reserve_gb=args.reserve_gb,
                host_reserve_gb=args.host_reserve_gb, mfu=args.mfu, pcie_gbs=args.pcie_gbs,
                nvme_gbs=args.nvme_gbs, host_adam_per_s=args.host_adam_rate)
    result = search(model, node, grpo, offload, bucket)
    return json.dumps(result.as_json(), indent=1) if args.json else format_search(result)


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_grpo.planner.plan import format_plan, plan
    from megatron_grpo.training.arguments import ConfigError

    args, train_argv = build_parser().parse_known_args(argv)
    try:
        if args.all_presets:
            print(presets_table())
            return 0
        if args.step_time:
            print(step_time_table(train_argv, args.step_time_grad_dtype, args.vocab_size, args.attention))
            return 0
        if args.search and not args.largest_model:
            raise ValueError("--search goes with --largest-model")
        model, cluster, grpo, bucket, offload = spec_from_flags(
            train_argv, args.nodes, args.gpus_per_node, args.gpu_memory_gb, args.link_gbps,
            args.vocab_size, args.attention, args.nvlink_gbps)
        if args.search:
            print(searched(args, model, grpo, bucket, offload))
            return 0
        name = next((a for a in train_argv if a.endswith((".yaml", ".yml"))), "model")
        p = plan(model, cluster, grpo, bucket_size=bucket, offload=offload)
        print(format_plan(p, os.path.basename(name)))
        if args.largest_model:
            print(largest_models(model, cluster, grpo, bucket, offload, args.gpu_memory_gb,
                                 args.reserve_gb))
        if cluster.nodes > 1 or cluster.instances > 1:
            from megatron_grpo.planner.internode import format_internode, internode

            print(format_internode(internode(model, cluster, grpo, bucket_size=bucket, stage=p.traffic_stage),
                                   flat_grpo=p.grpo_bytes if cluster.dp_spans_nodes else 0.0))
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
