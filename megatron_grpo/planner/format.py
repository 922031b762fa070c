"""Plain-text and markdown renderings of a planner ``Plan`` (launch/plan.py, docs/planner.md)."""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_grpo.comm.analytic import fp32_accumulation_step_bytes

GB = 10 ** 9


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f}"


def format_plan(p, name: str = "") -> str:
    """A plain-text breakdown, baseline beside GRPO (what launch/plan.py prints)."""
    m, c = p.model, p.cluster
    # GB for cluster-sized models; MB (10^6) so that small CPU models do not print 0.00.
    unit, scale = ("GB", GB) if p.baseline_memory.total >= GB else ("MB", 10 ** 6)

    def fmt(nbytes: float) -> str:
        return f"{nbytes / scale:.2f}"

    ring = "inter-node links" if c.dp_spans_nodes else "NVLink"
    style = ", ".join(x for x, on in ((f"{m.groups} query groups", m.groups != m.heads),
                                      ("SwiGLU", m.swiglu), ("RMSNorm", m.rmsnorm), ("RoPE", m.rope),
                                      ("no biases", not m.bias_linear)) if on)
    lines = [f"{name or 'model'}: {m.num_layers} layers, hidden {m.hidden}, {m.heads} heads, "
             f"{style + ', ' if style else ''}ffn {m.ffn}, vocab {m.vocab} (padded {m.padded_vocab(c.tp)}), seq {m.seq_length}, "
             f"micro-batch {m.micro_batch_size}, {'bf16' if m.bf16 else 'fp32'}, "
             f"{'flash' if m.flash_attention else 'unfused'} attention",
             f"cluster: {c.nodes} x {c.gpus_per_node} GPUs, {c.gpu_memory_gb:g} GB each, "
             f"TP {c.tp} x PP {c.pp} x DP {c.dp}; DP ring over {ring} at {c.dp_link_gbps:g} Gb/s per GPU",
             f"{'memory per GPU, ' + unit + ' (pipeline stage ' + str(p.memory_stage) + '):':<42}"
             f"{'baseline':>10}{'GRPO':>10}"]
    g = p.grpo_memory
    release = p.grpo.release_grads
    rows = [("parameters", "params"), ("gradients (fp32)", "grads")]
    if release:  # the gradient bytes at the steady peak's moment, by what holds them
        rows += [("  full units (filling, in flight)", "grads_full"),
                 ("  own shards, to the step's end", "grad_shards"),
                 ("  late copies (read after the sync)", "grad_late_copies"),
                 ("  delayed stable, to the step's end", "grads_held")]
    rows += [("fp32 master params", "master_params"), ("Adam moments", "optimizer_moments"),
             ("activations", "activations")]
    rows += [("  freed by backward at the peak", "activations_freed"),
             (f"error feedback ({g.residual_dtype}, committed)", "error_feedback"),
             ("  new residuals staged at the syncs", "error_feedback_staged")]
    rows += [("delayed accumulators", "delayed_accumulators"),
             ("outer state (periodic tiers)", "outer_state"),
             ("offloaded at the peak (--grpo-offload)", "offloaded"),
             ("  also away between stable updates", "offloaded_between_updates"),
             ("model state", "model_state")]
    rows += [("steady peak", "steady"), ("first iteration peak", "first_iteration")] if release else []
    rows += [("total", "total")]
    for label, attr in rows:
        # No first-iteration figure where every gradient stays resident: it is below the steady.
        cells = [fmt(getattr(x, attr)) if attr != "first_iteration" or x.first_iteration else "-"
                 for x in (p.baseline_memory, g)]
        lines.append(f"  {label:<40}{cells[0]:>10}{cells[1]:>10}")
    fits = ["yes" if p.fits(x) else "NO" for x in (p.baseline_memory, p.grpo_memory)]
    lines.append(f"  {'fits in ' + format(c.gpu_memory_gb, 'g') + ' GB':<40}{fits[0]:>10}{fits[1]:>10}")
    if release:
        window = (f"{p.grpo.grad_units_in_flight} units in flight" if m.overlap_grad_reduce
                  else "syncs after backward")
        lines.append(f"  GRPO gradient release: {window}, {m.micro_batches(c.dp, c.pp)} micro-batches "
                     f"per step{' (all units full while they accumulate)' if m.micro_batches(c.dp, c.pp) > 1 else ''}"
                     f"; GRPO's peak: {g.peak_phase}")
    if g.residuals_by_dtype:
        lines.append("  residuals, one copy, by --grpo-residual-dtype: " + ", ".join(
            f"{d} {fmt(x)}" for d, x in g.residuals_by_dtype.items()))
    t = p.grpo_traffic
    total = sum(p.tier_elements.values()) or 1.0
    shares = ", ".join(f"{k} {v / total:.1%}" for k, v in p.tier_elements.items())
    lines += [f"DP traffic per rank per step, {unit} (pipeline stage {p.traffic_stage}; "
              f"{len(p.baseline_buckets)} baseline buckets, {len(p.units)} GRPO units; tiers "
              f"{'as given' if p.tiers else 'at quota'}: {shares})",
              f"  baseline: {fmt(p.baseline_bytes)} (reduce-scatter {fmt(p.baseline_grad_bytes)} + "
              f"all-gather {fmt(p.baseline_param_bytes)}), wire {p.baseline_wire_s * 1e3:.3g} ms",
              f"  GRPO:     {fmt(p.grpo_bytes)} (core {fmt(t.core)} + dynamic {fmt(t.dynamic)} + "
              f"stable {fmt(t.stable_update)}/{t.stable_interval}), wire {p.grpo_wire_s * 1e3:.3g} ms, "
              f"ratio {p.ratio:.3f}; warm-up steps {fmt(p.grpo_warmup_bytes)}"]
    if m.bf16 and c.dp > 1:
        # megatron's best bf16 setting for bytes, which needs bf16 gradient buffers (GRPO refuses
        # them): GRPO's saving is also stated against it (docs/grpo.md, "Known limits").
        best = sum(fp32_accumulation_step_bytes(p.baseline_buckets, c.dp, m.param_bytes))
        lines.append(f"  megatron with bf16 gradients (reduce_scatter_with_fp32_accumulation, "
                     f"analytic): {fmt(best)}; GRPO ratio against it {p.grpo_bytes / best:.3f}")
    return "\n".join(lines)


def format_table(plans: Sequence, names: Optional[Sequence[str]] = None) -> str:
    """Markdown tables (memory, then traffic) with one row per plan, for docs/planner.md."""
    if names is None:
        names = [f"{p.model.num_layers}L-{p.model.hidden}h" for p in plans]
    names = list(names)
    if len(names) != len(plans):
        raise ValueError(f"names must have one entry per plan ({len(plans)}), got {len(names)}")
    out = ["| preset (GB per GPU) | GPUs (nodes x per node) | TP x PP x DP | params | grads | "
           "master + Adam, base / GRPO | activations | EF (GRPO) | total, base / GRPO | "
           "fits, base / GRPO |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in zip(names, plans):
        c, b, g = p.cluster, p.baseline_memory, p.grpo_memory
        fit = "/".join("yes" if p.fits(x) else "no" for x in (b, g))
        out.append(f"| {name} | {c.world} ({c.nodes} x {c.gpus_per_node}) | {c.tp} x {c.pp} x {c.dp} "
                   f"| {_gb(b.params)} | {_gb(b.grads)} | {_gb(b.optimizer)} / {_gb(g.optimizer)} "
                   f"| {_gb(b.activations)} | {_gb(g.error_feedback)} | {_gb(b.total)} / {_gb(g.total)} "
                   f"| {fit} |")
    out += ["", "| preset (per DP rank) | DP link, Gb/s per GPU | baseline GB/step | GRPO GB/step "
            "(core + dynamic + stable avg) | ratio | wire time base / GRPO, ms |",
            "|---|---|---|---|---|---|"]
    for name, p in zip(names, plans):
        t = p.grpo_traffic
        out.append(f"| {name} | {p.cluster.dp_link_gbps:g} | {_gb(p.baseline_bytes)} "
                   f"| {_gb(p.grpo_bytes)} ({_gb(t.core)} + {_gb(t.dynamic)} + "
                   f"{_gb(t.stable_average)}) | {p.ratio:.3f} | "
                   f"{p.baseline_wire_s * 1e3:.0f} / {p.grpo_wire_s * 1e3:.0f} |")
    return "\n".join(out)
