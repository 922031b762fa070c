"""How ``launch/plan.py --largest-model --search`` prints a search (planner/search.py)."""

from __future__ import annotations

from typing import List

from megatron_grpo.planner.search import SearchResult, Winner


def _setting(w: Winner) -> str:
    s = w.setting
    text = f"TP {s.tp} PP {s.pp}{' SP' if s.sequence_parallel else ''}, " \
           f"recompute {s.recompute or 'none'}, {s.option}"
    if s.option == "cpu-offload":
        text += f" (fraction {w.usage.offload_fraction:.2f})"
    if s.system == "megatron":
        text += ", bf16 grads" if s.grad_bytes == 2 else ", fp32 grads"
    return text


def _parts(w: Winner) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in w.step_parts.items() if k != "step" and v > 0.05)


def _line(label: str, w: Winner) -> List[str]:
    return [f"  {label:9s} {w.params / 1e9:8.2f} B parameters ({w.layers} layers)  step "
            f"{w.step_s:8.1f} s ({_parts(w)})",
            f"            {_setting(w)}; GPU {w.usage.gpu / 1e9:.1f} GB, host "
            f"{w.usage.host / 1e9:.0f} GB, NVMe {w.usage.nvme / 1e9:.0f} GB; one layer step more "
            f"exceeds the {w.bound}",
            f"            flags: {' '.join(w.setting.flags())}"]


def format_search(r: SearchResult, top: int = 5) -> str:
    n = r.node
    lines = [f"largest model on one node of {n.gpus} x {n.gpu_memory_gb:g} GB GPUs, "
             f"{n.host_memory_gb:g} GB host RAM ({n.host_reserve_gb:g} GB kept for the system), "
             f"{n.nvme_gb:g} GB NVMe; searched over {len(r.winners)} settings "
             f"(TP, PP, sequence parallelism, recompute, memory option, gradient dtype):"]
    for label, w in (("megatron", r.megatron), ("grpo", r.grpo)):
        lines += _line(label, w) if w else [f"  {label:9s} nothing fits"]
    if r.megatron and r.grpo:
        lines.append(f"  ratio     {r.ratio:.2f}x megatron's searched best")
    if r.both.get("megatron"):
        size = r.both["megatron"]
        lines.append(f"at megatron's largest ({size.params / 1e9:.2f} B), each side's fastest setting:")
        for side in ("megatron", "grpo"):
            w = r.both.get(side)
            lines.append(f"  {side:9s} " + (f"step {w.step_s:.1f} s ({_setting(w)})" if w else "does not fit"))
    for side in ("megatron", "grpo"):
        ranked = sorted((w for w in r.winners if w.layers and w.setting.system == side),
                        key=lambda w: (-w.params, w.step_s))[:top]
        if ranked:
            lines.append(f"{side}'s {len(ranked)} largest settings:")
            lines += [f"  {w.params / 1e9:8.2f} B  step {w.step_s:8.1f} s  bound {w.bound:4s}  "
                      f"{_setting(w)}" for w in ranked]
    lines.append(f"step time: a model at {n.mfu:.0%} MFU of {n.peak_tflops:g} TFLOP/s, PCIe "
                 f"{n.pcie_gbs:g} GB/s per GPU, NVMe {n.nvme_gbs:g} GB/s per node, host Adam "
                 f"{n.host_adam_per_s / 1e9:g} G parameters/s per node (docs/planner.md)")
    return "\n".join(lines)
