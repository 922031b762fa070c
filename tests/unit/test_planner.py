"""The planner's formulas on hand-checked numbers (pure: no process group, no model built).

Multi-process runs that compare the planner with measured bytes and tensors:
tests/multiproc/test_planner_measured.py.
"""

import dataclasses
import os

import pytest

from harness import load_script

from megatron_grpo.comm.analytic import ddp_bucket_numels
from megatron_grpo.grpo.config import GRPOConfig
from megatron_grpo.planner.plan import (ClusterSpec, ModelSpec, format_plan, format_table,
                                   layer_activation_bytes, plan, stage_activation_bytes,
                                   stage_param_numels)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests/harness.py SMALL_MODEL + GRPO_SMALL, as run on 2 gloo ranks in the measured tests.
SMALL = dict(num_layers=2, hidden=96, heads=4, vocab=258, seq_length=64, micro_batch_size=2)
# The three tiers and exact core that GRPO_SMALL pins (the defaults before the quality front).
THREE_TIERS = dict(core_share=0.15, dynamic_share=0.65, stable_share=0.2, max_dynamic_share=0.7,
                   core_compressor="none")
# fp32 residuals (the default before int8): the hand checks below count 4 bytes each.
SMALL_GRPO = GRPOConfig(enabled=True, bucket_mb=0.04, warmup_iters=6, retier_interval=8,
                        stable_interval=4, gvr_interval=4, residual_dtype="fp32", **THREE_TIERS)
TWO_RANKS = ClusterSpec(nodes=1, gpus_per_node=2)


def _load_cli():
    return load_script("launch/plan.py", "plan_cli")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_layer_activations_are_korthikanti_eq2(tp):
    # Their setting: 16-bit activations and softmax, dropout on, f = 4h, no sequence parallel:
    # s b h (10 + 24/t + 5 a s / (h t)) bytes per layer, plus the layernorms' fp32 mean/rstd.
    m = ModelSpec(num_layers=1, hidden=1024, heads=16, seq_length=2048, micro_batch_size=2,
                  bf16=True, dropout=True, softmax_in_fp32=False)
    s, b, h, a = 2048, 2, 1024, 16
    expected = s * b * h * (10 + 24 // tp) + 5 * a * s * s * b // tp + 16 * s * b
    assert layer_activation_bytes(m, tp) == expected


def test_attention_variants_and_fp32():
    base = dict(num_layers=1, hidden=256, heads=8, seq_length=512, micro_batch_size=1)
    s, b, h, a = 512, 1, 256, 8
    flash = layer_activation_bytes(ModelSpec(**base, flash_attention=True), 2)
    unfused = layer_activation_bytes(ModelSpec(**base), 2)
    # megatron's fp32 softmax output (4 B) plus the bf16 probabilities the matmul keeps (2 B),
    # instead of flash attention's fp32 log-sum-exp per row.
    assert unfused - flash == 6 * a * s * s * b // 2 - 4 * a * s * b // 2
    # fp32: every activation 4 bytes; the softmax output doubles as the matmul input.
    fp32 = layer_activation_bytes(ModelSpec(**base, bf16=False), 1)
    assert fp32 == 4 * (8 * s * b * h + 2 * s * b * 4 * h + a * s * s * b) + 16 * s * b


def test_stage_activations_follow_1f1b():
    m = ModelSpec(num_layers=8, hidden=64, heads=4, vocab=100, seq_length=32, micro_batch_size=1,
                  flash_attention=True)
    c = ClusterSpec(nodes=1, gpus_per_node=8, tp=2, pp=4)
    layer = layer_activation_bytes(m, 2)
    s, b, h = 32, 1, 64
    # Stage 0: 4 micro-batches in flight, 2 layers each, plus the embeddings' int64 ids.
    assert stage_activation_bytes(m, c, 0) == 4 * (2 * layer + 16 * s * b)
    assert stage_activation_bytes(m, c, 1) == 3 * 2 * layer
    # Last stage: one in flight, plus final layernorm in/out, stats, fp32 softmax of the logits
    # over this rank's half of the vocabulary padded to 128 x 2 = 256, and the label tensors.
    assert stage_activation_bytes(m, c, 3) == 2 * layer + 2 * s * b * h * 2 + 8 * s * b \
        + 4 * s * b * 128 + 9 * s * b


def test_small_model_bytes_equal_the_counted_run():
    # Counted on 2 gloo ranks (test_planner_measured); hand check of the dynamic tier below.
    p = plan(ModelSpec(**SMALL, bf16=False), TWO_RANKS, SMALL_GRPO, bucket_size=20000,
             tiers="dcdsdddcs")
    assert (p.baseline_grad_bytes, p.baseline_param_bytes) == (608768, 608768)
    assert p.units == [36864, 37248, 37248, 28288, 46592, 37248, 28288, 15744, 36864]
    assert (p.grpo_traffic.core, p.grpo_traffic.dynamic, p.grpo_traffic.stable_update) == \
        (211968, 96040, 260608)
    # int4 payload of a shard of N: 4 ceil(N/256) + round4(ceil(N/2)); sent twice (gradient
    # all_to_all, parameter-delta all-gather), (dp-1) = 1 copy each.
    shards = [36864 // 2, 37248 // 2, 46592 // 2, 37248 // 2, 28288 // 2]
    payloads = [4 * -(-n // 256) + (-(-n // 2) + 3) // 4 * 4 for n in shards]
    assert 2 * sum(payloads) == 96040
    assert p.grpo_memory.error_feedback == 4 * (36864 + 37248 + 46592 + 37248 + 28288)
    bf16 = plan(ModelSpec(**SMALL, bf16=True), TWO_RANKS, SMALL_GRPO, bucket_size=20000,
                tiers=list("dcdsdddcs"))
    assert (bf16.grpo_traffic.core, bf16.grpo_traffic.stable_update, bf16.grpo_warmup_bytes) == \
        (158976, 195456, 913152)
    assert bf16.baseline_param_bytes == 608768 // 2


def test_memory_components():
    fp32 = plan(ModelSpec(**SMALL, bf16=False), TWO_RANKS, SMALL_GRPO, bucket_size=20000)
    unpadded = sum(stage_param_numels(fp32.model, TWO_RANKS, 0))
    b, g = fp32.baseline_memory, fp32.grpo_memory
    assert (b.params, b.grads) == (1217536, 1217536)  # 304384 padded elements x 4 bytes
    assert b.master_params == 0 and g.master_params == 4 * unpadded // 2  # GRPO: own storage
    assert b.optimizer_moments == 8 * unpadded // 2
    assert g.error_feedback == round(0.65 * 4 * sum(fp32.units)) and b.error_feedback == 0
    assert b.offloaded == g.offloaded == 0
    bf16 = plan(ModelSpec(**SMALL), TWO_RANKS, SMALL_GRPO, bucket_size=20000)
    assert bf16.baseline_memory.params == 2 * 304384
    assert bf16.baseline_memory.master_params == 4 * unpadded // 2
    delayed = GRPOConfig(enabled=True, bucket_mb=0.04, stable_mode="delayed", **THREE_TIERS)
    d = plan(ModelSpec(**SMALL), TWO_RANKS, delayed, bucket_size=20000).grpo_memory
    assert d.delayed_accumulators == round(0.2 * 4 * sum(bf16.units))
    one = plan(ModelSpec(**SMALL), ClusterSpec(nodes=1, gpus_per_node=1), delayed)
    assert one.grpo_memory.error_feedback == 0 and one.baseline_bytes == 0 and one.grpo_bytes == 0


def test_pipeline_stages_after_the_first_use_one_baseline_bucket():
    m = ModelSpec(num_layers=4, hidden=96, heads=4, vocab=258, seq_length=64, bf16=False)
    c = ClusterSpec(nodes=1, gpus_per_node=4, pp=2)
    first = plan(m, c, SMALL_GRPO, bucket_size=20000, stage=0)
    last = plan(m, c, SMALL_GRPO, bucket_size=20000, stage=1)
    assert len(first.baseline_buckets) > 1
    assert last.baseline_buckets == ddp_bucket_numels(stage_param_numels(m, c, 1), None, 2)
    assert len(last.units) > 1  # GRPO keeps its units on every stage
    auto = plan(m, c, SMALL_GRPO, bucket_size=20000)
    assert auto.memory_stage == 0  # two micro-batches in flight
    assert auto.baseline_bytes == max(first.baseline_bytes, last.baseline_bytes)


def test_quota_ratio_and_wire_time_at_scale():
    m = ModelSpec(num_layers=32, hidden=4096, heads=32, ffn_hidden=14336, flash_attention=True)
    c = ClusterSpec(nodes=2, gpus_per_node=8, tp=2)
    p = plan(m, c, GRPOConfig(enabled=True, stable_interval=20, **THREE_TIERS))
    # bf16 exact sync: 4 + 2 bytes per element; int4: 2 x (4/256 + 1/2) bytes per element.
    expected = 0.15 + 0.65 * 2 * (4 / 256 + 0.5) / 6 + 0.20 / 20
    assert p.ratio == pytest.approx(expected, abs=2e-3)
    assert c.dp == 8 and c.dp_spans_nodes and c.dp_link_gbps == 400
    assert p.baseline_wire_s == pytest.approx(p.baseline_bytes * 8 / 400e9)
    assert p.grpo_traffic.per_step == pytest.approx(p.grpo_bytes)
    # One node: the DP ring runs over NVLink. TP=1, PP=2 on 2 nodes: each stage's DP group is
    # one node (pipeline is the outermost rank dimension).
    assert ClusterSpec(nodes=1, tp=2).dp_link_gbps == 3600
    assert not ClusterSpec(nodes=2, tp=1, pp=2).dp_spans_nodes
    # TP 2 x PP 2 x DP 3: with 6 GPUs per node each stage's 6 ranks fill one node...
    assert not ClusterSpec(nodes=2, gpus_per_node=6, tp=2, pp=2).dp_spans_nodes
    # ...with 4 GPUs per node stage 0 (ranks 0-5; TP rank 0's DP group 0, 2, 4) straddles two.
    assert ClusterSpec(nodes=3, gpus_per_node=4, tp=2, pp=2).dp_spans_nodes


def test_errors_name_the_field():
    g = GRPOConfig()
    cases = [
        (ModelSpec(num_layers=0, hidden=64, heads=4), TWO_RANKS, {}, "ModelSpec.num_layers"),
        (ModelSpec(num_layers=2, hidden=100, heads=3), TWO_RANKS, {}, "ModelSpec.hidden"),
        (ModelSpec(num_layers=2, hidden=64, heads=4, max_position=8, seq_length=16), TWO_RANKS, {},
         "ModelSpec.max_position"),
        (ModelSpec(num_layers=3, hidden=64, heads=4), ClusterSpec(nodes=1, gpus_per_node=2, pp=2), {},
         "ClusterSpec.pp"),
        (ModelSpec(num_layers=2, hidden=64, heads=4), ClusterSpec(nodes=1, gpus_per_node=8, tp=3), {},
         "tp x pp"),
        (ModelSpec(num_layers=2, hidden=64, heads=4), ClusterSpec(link_gbps=0), {}, "ClusterSpec.link_gbps"),
        (ModelSpec(**SMALL), TWO_RANKS, dict(bucket_size=0), "bucket_size"),
        (ModelSpec(**SMALL), TWO_RANKS, dict(stage=1), "stage"),
        (ModelSpec(**SMALL), TWO_RANKS, dict(tiers="cd"), "tiers"),
        (ModelSpec(**SMALL), TWO_RANKS, dict(tiers=["core", "warm"]), "tiers"),
        (ModelSpec(num_layers=4, hidden=64, heads=4), ClusterSpec(nodes=1, gpus_per_node=4, pp=2),
         dict(tiers="c"), "stage"),
    ]
    for model, cluster, kwargs, needle in cases:
        with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
            plan(model, cluster, g, **kwargs)


def test_formatting():
    p = plan(ModelSpec(num_layers=32, hidden=4096, heads=32, ffn_hidden=14336), ClusterSpec(nodes=2, tp=2),
             GRPOConfig(stable_interval=20))
    text = format_plan(p, "8b")
    assert "fits in 80 GB" in text and f"ratio {p.ratio:.3f}" in text and "GB (pipeline stage 0)" in text
    small = format_plan(plan(ModelSpec(**SMALL), TWO_RANKS, SMALL_GRPO, bucket_size=20000))
    assert "MB (pipeline stage 0)" in small  # small models are not printed as 0.00 GB
    table = format_table([p, p], ["a", "b"]).splitlines()
    assert len(table) == 2 + 2 + 1 + 2 + 2 and table[2].startswith("| a | 16 (2 x 8) | 2 x 1 x 8 |")
    with pytest.raises(ValueError, match="names"):
        format_table([p], ["a", "b"])


def test_docs_carry_the_cli_table(capsys):
    cli = _load_cli()
    assert cli.main(["--all-presets"]) == 0
    table = capsys.readouterr().out.strip()
    assert len(table.splitlines()) == 2 + 4 + 1 + 2 + 4
    with open(os.path.join(REPO, "docs", "planner.md")) as fh:
        assert table in fh.read(), "docs/planner.md is stale: paste `python launch/plan.py --all-presets`"
    # Bad world size: the training parser's own message, exit code 2.
    assert cli.main(["--config", os.path.join(REPO, "launch/configs/gpt_70b.yaml"), "--nodes", "3"]) == 2
    assert "--tensor-model-parallel-size" in capsys.readouterr().err


def test_offload_moves_the_streamed_state_less_two_units_or_the_stable_state_between_updates():
    from megatron_grpo.offload import OffloadConfig

    m = ModelSpec(**SMALL)
    tiers_p = plan(m, TWO_RANKS, SMALL_GRPO)
    units = tiers_p.units
    tiers = (["core"] + ["dynamic"] * (len(units) - 3) + ["stable", "stable"])
    base = plan(m, TWO_RANKS, SMALL_GRPO, tiers=tiers)
    on = plan(m, TWO_RANKS, SMALL_GRPO, tiers=tiers, offload=OffloadConfig(target="ssd", offload_dir="/x"))
    off = plan(m, TWO_RANKS, SMALL_GRPO, tiers=tiers,
               offload=OffloadConfig(target="cpu", stream=False, residuals=False))
    shard = sum(stage_param_numels(m, TWO_RANKS, 0)) / 2
    el = on.tier_elements
    share = {t: el[t] / sum(el.values()) for t in el}
    window = 2 * 12 * max(units) / 2
    ef = base.grpo_memory.error_feedback
    assert ef > 0
    assert on.grpo_memory.offloaded == (round(12 * shard * (share["dynamic"] + share["stable"]) - window)
                                        + max(0, ef - 3 * 4 * max(units)))
    assert on.grpo_memory.offloaded_between_updates == 0
    assert on.grpo_memory.total == base.grpo_memory.total - on.grpo_memory.offloaded
    # Without streaming only the stable tier moves, and only between its updates: the peak (an
    # update step) is unchanged.
    assert off.grpo_memory.offloaded == 0
    assert off.grpo_memory.offloaded_between_updates == round(12 * shard * share["stable"])
    assert off.grpo_memory.total == base.grpo_memory.total
    assert on.baseline_memory.total == base.baseline_memory.total  # the baseline has no tier
    assert "offloaded at the peak (--grpo-offload)" in format_plan(on)



def test_delayed_accumulators_are_away_with_the_tier_but_for_three_units():
    """the delayed stable tier's gradient sums leave with the memory tier (read
    back a few at a time, comm/accumulators.py), streamed or not."""
    import dataclasses

    from megatron_grpo.offload import OffloadConfig

    m = ModelSpec(**SMALL)
    delayed = dataclasses.replace(SMALL_GRPO, stable_mode="delayed")
    frozen_cfg = dataclasses.replace(SMALL_GRPO, stable_mode="frozen")
    units = plan(m, TWO_RANKS, delayed).units
    tiers = ["core"] + ["dynamic"] * (len(units) - 5) + ["stable"] * 4
    frozen = plan(m, TWO_RANKS, frozen_cfg, tiers=tiers)
    resident = plan(m, TWO_RANKS, delayed, tiers=tiers)
    accum = resident.grpo_memory.delayed_accumulators
    assert accum == 4 * sum(units[-4:]) > 0
    largest = 4 * max(units[-4:])
    for off in (OffloadConfig(target="ssd", offload_dir="/x"),
                OffloadConfig(target="cpu", stream=False, residuals=False)):
        with_tier = plan(m, TWO_RANKS, delayed, tiers=tiers, offload=off).grpo_memory
        same_frozen = plan(m, TWO_RANKS, frozen_cfg, tiers=tiers, offload=off).grpo_memory
        assert with_tier.offloaded - same_frozen.offloaded == accum - 3 * largest
    assert frozen.grpo_memory.delayed_accumulators == 0

# ------------------------------------------------------------ gradient release
from megatron_grpo.planner.grads import GradMoment, UnitGrads, grad_timeline, residual_bytes  # noqa: E402

# Four units reached in this order, 100..400 elements, 2 ranks (fp32 shard = 2 bytes per
# element), every one synced and compressed with an fp32 residual (4 bytes per element).
HAND = [UnitGrads(n, 4 * n, 2 * n, 0, 4 * n, 1.0, 0.0, 1.0) for n in (100, 200, 300, 400)]


def _moment(m: GradMoment):
    return (m.total, m.full, m.shards, m.staged, m.freed)


def test_release_timeline_by_hand():
    # Window 1: each sync stages its residual, then waits for the previous one. The peak comes
    # when unit 3 has staged: units 2 and 3 full (1200 + 1600), shards of 0-1 (200 + 400),
    # every residual staged (4000).
    best, grads = grad_timeline(HAND, 0, 1, prefilled=False)
    assert (_moment(best), grads) == ((7400, 2800, 600, 4000, 0), 3400)
    # Window 2: three units full at once (800 + 1200 + 1600), shards of unit 0 only.
    best, grads = grad_timeline(HAND, 0, 2, prefilled=False)
    assert (_moment(best), grads) == ((7800, 3600, 200, 4000, 0), 3800)
    # No overlap (or megatron's first batch): all full at the end of backward (4000), then each
    # sync stages before it releases: the last one's stage is the peak.
    best, grads = grad_timeline(HAND, 0, None, prefilled=False)
    assert (_moment(best), grads) == ((6800, 1600, 1200, 4000, 0), 4000)
    # Accumulated micro-batches: every unit full from the start.
    best, grads = grad_timeline(HAND, 0, 2, prefilled=True)
    assert (_moment(best), grads) == ((7800, 3600, 200, 4000, 0), 4000)
    # With pipeline parallelism the end of forward holds several micro-batches (3000 bytes),
    # the last backward, where the syncs happen, one (1000): the busier moment wins.
    best, _ = grad_timeline(HAND, 3000, 2, prefilled=True, last_activations=1000)
    assert _moment(best) == (7800, 3600, 200, 4000, 3000)
    best, _ = grad_timeline(HAND, 5000, 2, prefilled=True, last_activations=1000)
    assert _moment(best) == (9000, 4000, 0, 0, 0)
    # megatron's one buffer: 4000 all the time, residuals staged on top.
    best, grads = grad_timeline(HAND, 0, float("inf"), prefilled=True, release=False)
    assert (_moment(best), grads) == ((8000, 4000, 0, 4000, 0), 4000)


def test_shards_the_memory_tier_moves_keep_only_its_last_writes():
    # Five units, every sync after backward, each staging a 1000-byte residual: the peak is the
    # last sync's stage, with unit 4 still full (400). Without the tier the four earlier shards
    # are resident (800); with --grpo-offload-grads (away = 1) only its last three writes (600).
    for away, shards in ((0.0, 800), (1.0, 600)):
        units = [UnitGrads(100, 400, 200, 0, 1000, 1.0, 0.0, 1.0, away) for _ in range(5)]
        best, grads = grad_timeline(units, 0, None, prefilled=False)
        assert (_moment(best), grads) == ((5400 + shards, 400, shards, 5000, 0), 2000)


def test_release_timeline_follows_parameters_and_frees_activations():
    # Unit 1's first gradient comes before unit 0's last (as linear_proj's bias does), and 500
    # bytes of activations go with unit 1's last parameter.
    events = [(0, 0.0), (1, 0.0), (0, 0.0), (1, 500.0), (2, 500.0), (3, 500.0)]
    best, grads = grad_timeline(HAND, 500, 1, prefilled=False, events=events)
    assert (_moment(best), grads) == ((7400, 2800, 600, 4000, 500), 3400)
    # What is not freed by then counts in full: with 10 kB of activations, 9.5 kB more.
    best, _ = grad_timeline(HAND, 10_000, 1, prefilled=False, events=events)
    assert _moment(best) == (16_900, 2800, 600, 4000, 500)
    # A parameter read after the sync keeps an own copy from its unit's release to the end:
    # 50 bytes of unit 2's, in the moment unit 3 has staged (window 1: unit 2 released).
    late = [dataclasses.replace(u, late=50 * (i == 2)) for i, u in enumerate(HAND)]
    best, grads = grad_timeline(late, 0, 1, prefilled=False)
    assert (best.total, best.late, grads) == (7400, 0, 3400)  # the peak came first
    best, grads = grad_timeline(late, 0, None, prefilled=False)
    assert (_moment(best), best.late, grads) == ((6850, 1600, 1200, 4000, 0), 50, 4000)


def test_backward_order_is_the_measured_one():
    from megatron_grpo.planner.grads import backward_order

    names = ["word", "pos", "ln1.w", "ln1.b", "proj.w", "proj.b", "qkv.w", "qkv.b", "ln2.w", "ln2.b",
             "fc1.w", "fc1.b", "fc2.w", "fc2.b", "fln.w", "fln.b", "out.w"]
    # As the gradient hooks of a GPT-2-style layer fire on megatron's local spec (planner_probe).
    order = backward_order(1, True, True, True, True, True)
    assert [names[i] for i, _ in order] == [
        "out.w", "fln.w", "fln.b", "fc2.b", "fc2.w", "fc1.b", "fc1.w", "ln2.w", "ln2.b", "proj.b",
        "proj.w", "qkv.w", "qkv.b", "ln1.w", "ln1.b", "pos", "word"]
    assert [p for _, parts in order for p in parts] == ["head", "fc2", "act", "fc1", "ln2", "proj",
                                                        "attention", "ln1", "embedding"]
    llama = backward_order(1, True, True, False, False, False)  # word, ln1, proj, qkv, ln2, fc1, fc2, fln, out
    assert [i for i, _ in llama] == [8, 7, 6, 5, 4, 2, 3, 1, 0]
    # Delayed stable units between updates stay full and stage nothing; frozen ones hold nothing.
    held = [UnitGrads(n, 4 * n, 2 * n, 0, 4 * n, *roles) for n, roles in
            zip((100, 200, 300, 400), [(1, 0, 1), (0, 1, 0), (0, 0, 0), (1, 0, 1)])]
    best, grads = grad_timeline(held, 0, 1, prefilled=False)
    # When unit 3 has staged, before unit 0's sync is waited for: units 0 and 3 full (400 +
    # 1600), unit 1 held (800), the residuals of units 0 and 3 (400 + 1600).
    assert (_moment(best), best.held, grads) == ((4800, 2000, 0, 2000, 0), 800, 2800)


def test_residual_bytes_by_dtype():
    assert [residual_bytes(1000, d, 256) for d in ("fp32", "bf16", "int8")] == [4000, 2000, 4 * 260]
    assert residual_bytes(256, "int8", 256) == 260 and residual_bytes(257, "int8", 64) == 5 * 68


RUN_TIERS = "dcdsddscd"  # what the 2-rank runs of tests/multiproc/test_planner_measured.py tier


def _release_plan(**grpo):
    cfg = dict(enabled=True, bucket_mb=0.04, warmup_iters=6, retier_interval=8, stable_interval=4,
               **{**THREE_TIERS, **grpo})
    # Tiny activations (sequence 4, one sample), so that the gradient window decides the peak.
    m = ModelSpec(**{**SMALL, "seq_length": 4, "micro_batch_size": 1, "max_position": 64, "bf16": False})
    return plan(m, TWO_RANKS, GRPOConfig(**cfg), bucket_size=20000, tiers=RUN_TIERS)


def test_release_plan_by_hand_frozen_and_delayed_windows_and_dtypes():
    units = [36864, 37248, 37248, 28288, 46592, 37248, 28288, 15744, 36864]
    dyn = [n for n, t in zip(units, RUN_TIERS) if t == "d"]
    # Frozen, window 2, between updates: when the word embedding's unit (8) is allocated,
    # units 5 and 7 are in flight and 8 is filling; 0, 1, 2, 4 have kept their shards; the
    # stable units 3 and 6 hold nothing (measured: tests/multiproc/test_planner_measured.py).
    frozen = _release_plan(stable_mode="frozen").grpo_memory
    assert frozen.grad_peaks["between"] == 4 * (37248 + 15744 + 36864) + 2 * (36864 + 37248 + 37248 + 46592) \
        == 675328
    # On an update step the stable units sync too: a unit more in flight at that moment.
    assert frozen.grad_peaks["update"] == 790784
    # Delayed, window 1: units 7 and 8 full, the stable ones held to the step's end.
    delayed = _release_plan(stable_mode="delayed", grad_units_in_flight=1).grpo_memory
    assert delayed.grad_peaks["between"] == 4 * (15744 + 36864) + 2 * (36864 + 37248 + 37248 + 46592 + 37248) \
        + 4 * (28288 + 28288) == 827136
    assert delayed.grad_peaks["update"] == 713984
    # The first iteration (megatron's first batch): every unit syncs as it is ready, as on an
    # update step (--grpo-first-batch-overlap); without it megatron syncs after backward then,
    # and every unit is full at the end of backward.
    assert frozen.grad_peaks["first"] == frozen.grad_peaks["update"] == 790784
    assert delayed.grad_peaks["first"] == delayed.grad_peaks["update"] == 713984
    late = _release_plan(stable_mode="frozen", first_batch_overlap=False).grpo_memory
    assert late.grad_peaks["first"] == 4 * sum(units) == 1217536
    # Residuals of the dynamic units, committed, and the same again staged by the step's end.
    for dtype, expected in (("fp32", 4 * sum(dyn)), ("bf16", 2 * sum(dyn)),
                            ("int8", 260 * sum(-(-n // 256) for n in dyn))):
        g = _release_plan(stable_mode="frozen", residual_dtype=dtype).grpo_memory
        assert (g.residual_dtype, g.error_feedback) == (dtype, expected)
        assert g.residuals_by_dtype[dtype] == expected
    assert (4 * sum(dyn), 260 * sum(-(-n // 256) for n in dyn)) == (779264, 198120)


def test_the_memory_tier_moves_the_first_iterations_masters_and_the_shards():
    from megatron_grpo.offload import OffloadConfig

    cfg = dict(enabled=True, bucket_mb=0.04, warmup_iters=6, retier_interval=8, stable_interval=4,
               stable_mode="frozen", **THREE_TIERS)
    m = ModelSpec(**{**SMALL, "seq_length": 4, "micro_batch_size": 1, "max_position": 64, "bf16": False})
    units = [36864, 37248, 37248, 28288, 46592, 37248, 28288, 15744, 36864]

    def first(**offload):
        off = OffloadConfig(target="cpu", **offload) if offload else None
        g = plan(m, TWO_RANKS, GRPOConfig(**cfg), bucket_size=20000, tiers=RUN_TIERS, offload=off).grpo_memory
        return g.step_peaks["first"], g.grad_peaks["first"], g.master_params

    resident, grads, masters = first()
    # Streamed (the warm-up streams every unit): the masters leave before step 1's forward, but
    # for the two units the step streams; the shards keep their last three writes.
    streamed, streamed_grads, _ = first(stream=True, grads=False)
    assert streamed_grads == grads
    assert resident - streamed == masters - 8 * max(units) // 2 > 0
    _, shard_grads, _ = first(stream=True, grads=True)
    assert shard_grads < grads
    # Without streaming neither moves in the first iteration.
    assert first(stream=False)[:2] == (resident, grads)


def test_release_off_keeps_the_buffer_and_the_baseline_is_unchanged():
    on, off = _release_plan(stable_mode="frozen"), _release_plan(stable_mode="frozen", release_grads=False)
    g = off.grpo_memory
    assert g.grads == g.grad_peaks["between"] == 4 * 304384 and g.grads_full == g.grad_shards == 0
    assert g.first_iteration == 0 and g.total == g.steady == g.step_peaks["update"]
    assert g.total == g.model_state + g.activations - g.activations_freed
    assert on.grpo_memory.total < g.total
    assert on.baseline_memory == off.baseline_memory
    b = on.baseline_memory
    assert (b.grads, b.error_feedback_staged, b.first_iteration, b.activations_freed) == (4 * 304384, 0, 0, 0)
    assert b.total == b.model_state + b.activations


def test_release_peak_is_the_larger_of_the_first_iteration_and_the_steady_step():
    g = _release_plan(stable_mode="frozen").grpo_memory
    assert g.total == max(g.steady, g.first_iteration) == max(g.step_peaks.values())
    # The first iteration: parameters, masters and all gradients, nothing else.
    assert g.first_iteration - g.params - g.master_params - 4 * 304384 < g.activations
    bf16 = plan(ModelSpec(**SMALL), TWO_RANKS,
                GRPOConfig(enabled=True, bucket_mb=0.04, residual_dtype="int8", **THREE_TIERS),
                bucket_size=20000)
    assert bf16.grpo_memory.peak_phase in ("steady", "first iteration")
    # Two micro-batches per step: every unit full while they accumulate, in every step.
    acc = plan(ModelSpec(**SMALL, global_batch_size=8), TWO_RANKS, GRPOConfig(enabled=True, bucket_mb=0.04,
               **THREE_TIERS), bucket_size=20000, tiers=RUN_TIERS).grpo_memory
    assert acc.grad_peaks["update"] == 4 * 304384
    with pytest.raises(ValueError, match="ModelSpec.global_batch_size"):
        plan(ModelSpec(**SMALL, global_batch_size=6), TWO_RANKS, GRPOConfig())


def test_late_copies_with_pipeline_parallelism():
    from megatron_grpo.planner.grads import late_bytes

    from megatron_grpo.planner.grads import param_units

    # PP 2: stage 0's position embedding (the second parameter) is read after the sync. The
    # word embedding (36864 elements) fills the last unit alone; the table closes the one before.
    m = ModelSpec(num_layers=2, hidden=96, heads=4, vocab=258, seq_length=64, bf16=False)
    c = ClusterSpec(nodes=1, gpus_per_node=4, pp=2)
    numels = stage_param_numels(m, c, 0)
    units = ddp_bucket_numels(numels, 10485, 2)
    assert units == [36992, 37248, 28288, 15744, 36864] and param_units(numels, 10485, 2)[:2] == [4, 3]
    assert late_bytes(2, 0, False, numels, 10485, 2, len(units)) == [0, 0, 0, 4 * 64 * 96, 0]
    assert late_bytes(2, 1, False, numels, 10485, 2, len(units)) == [0] * len(units)
    assert late_bytes(1, 0, False, numels, 10485, 2, len(units)) == [0] * len(units)
    assert late_bytes(2, 0, True, numels, 10485, 2, len(units)) == [0] * len(units)


def test_plan_prints_the_release_breakdown():
    text = format_plan(_release_plan(stable_mode="delayed"))
    for row in ("full units (filling, in flight)", "own shards, to the step's end",
                "new residuals staged at the syncs", "first iteration peak",
                "GRPO gradient release: 2 units in flight, 1 micro-batches per step",
                "residuals, one copy, by --grpo-residual-dtype: fp32 0.78, bf16 0.39, int8 0.20"):
        assert row in text, row
    off = format_plan(_release_plan(release_grads=False))
    assert "own shards" not in off and "staged at the syncs" in off
