"""--grpo-memory-budget-gb: the first placement in tier order whose planned peak fits."""

import pytest

from harness import GRPO_SMALL, SMALL_MODEL

from megatron_grpo.planner.plan import ClusterSpec, plan
from megatron_grpo.training import memory_budget as mb
from megatron_grpo.training.arguments import ConfigError, parse_args


def _cfg(budget_gb, *extra):
    return parse_args([*SMALL_MODEL, *GRPO_SMALL, "--data-path", "x", "--grpo-offload", "ssd",
                       "--grpo-offload-dir", "/tmp", "--grpo-memory-budget-gb", str(budget_gb), *extra],
                      world_size=2)


def _peaks(base):
    _, choice = mb.choose(_cfg(1000), 258, "unfused", 2, base)
    return dict(choice.predicted)


def test_each_level_is_the_planner_total_plus_what_is_held_before_the_model():
    base = 300_000_000
    peaks = _peaks(base)
    assert list(peaks) == ["resident", "stable", "stream", "stream+residuals", "stream+residuals+grads"]
    cfg = _cfg(1000)
    model = mb.model_spec(cfg, 258, "unfused")
    cluster = ClusterSpec(nodes=1, gpus_per_node=2)
    resident = plan(model, cluster, cfg.grpo, bucket_size=cfg.parallel.ddp_bucket_size).grpo_memory
    assert peaks["resident"] == base + resident.total
    streamed = plan(model, cluster, cfg.grpo, bucket_size=cfg.parallel.ddp_bucket_size,
                    offload=cfg.offload).grpo_memory  # ssd, stream, residuals, grads: the last level
    assert peaks["stream+residuals+grads"] == base + streamed.total
    assert peaks["resident"] > peaks["stream"] > peaks["stream+residuals"] > base
    # Gradient shards leave after their sync; this model's peak comes before any sync (the
    # first iteration, every unit full), so moving them does not lower it.
    assert peaks["stream+residuals+grads"] == peaks["stream+residuals"]
    # GRPO_SMALL's stable units are frozen: moving the stable tier alone keeps the update
    # step's peak; delayed ones hold gradient sums that leave with it.
    assert peaks["stable"] == peaks["resident"]
    _, choice = mb.choose(_cfg(1000, "--grpo-stable-mode", "delayed", "--grpo-bucket-mb", "0.01"),
                          258, "unfused", 2, base)  # more than three stable units
    delayed = dict(choice.predicted)
    assert delayed["resident"] > delayed["stable"] > delayed["stream"]


@pytest.mark.parametrize("level", ["resident", "stable", "stream", "stream+residuals"])
def test_the_first_level_that_fits_is_taken(level):
    base = 300_000_000
    delayed = ("--grpo-stable-mode", "delayed", "--grpo-bucket-mb", "0.01")  # 4+ stable units
    _, choice = mb.choose(_cfg(1000, *delayed), 258, "unfused", 2, base)
    peaks = dict(choice.predicted)
    budget = peaks[level]  # exactly at the planned peak: fits
    off, choice = mb.choose(_cfg(budget / 1e9, *delayed), 258, "unfused", 2, base)
    assert choice.level == level and choice.planned_bytes == peaks[level]
    assert choice.metrics() == {"grpo_memory_budget_bytes": round(budget), "grpo_memory_level": level,
                                "grpo_memory_planned_bytes": peaks[level]}
    expected = {"resident": ("none", True, True, True), "stable": ("ssd", False, False, False),
                "stream": ("ssd", True, False, False),
                "stream+residuals": ("ssd", True, True, False)}[level]
    assert (off.target, off.stream, off.residuals, off.grads) == expected
    assert off.offload_dir == "/tmp" and off.memory_budget_gb == budget / 1e9


def test_no_level_fits_names_the_flag_the_rank_and_the_levels():
    base = 300_000_000
    peaks = _peaks(base)
    with pytest.raises(ConfigError) as err:
        mb.choose(_cfg((peaks["stream+residuals"] - 1) / 1e9), 258, "unfused", 2, base, rank=3)
    msg = str(err.value)
    assert msg.startswith("rank 3: --grpo-memory-budget-gb ")
    assert "(OffloadConfig.memory_budget_gb): no placement fits (planned peaks per rank: resident " in msg
    assert "300.0 MB held before the model" in msg and "Raise --grpo-memory-budget-gb" in msg


def test_a_budget_needs_somewhere_to_move_state():
    with pytest.raises(ConfigError, match=r"--grpo-offload \(OffloadConfig.target\) must be cpu or ssd "
                                          r"with --grpo-memory-budget-gb"):
        parse_args([*SMALL_MODEL, *GRPO_SMALL, "--data-path", "x", "--grpo-memory-budget-gb", "2"],
                   world_size=2)


def test_the_levels_follow_gradient_release_and_the_residual_dtype():
    """The planned peaks are the planner's (the larger of the first iteration and the
    steady step), so releasing gradients and storing residuals in int8 lower every level."""
    base = 300_000_000

    def peaks(*extra):
        _, choice = mb.choose(_cfg(1000, "--global-batch-size", "4", *extra), 258, "unfused", 2, base)
        return dict(choice.predicted)

    cfg = _cfg(1000, "--global-batch-size", "4", "--no-overlap-grad-reduce")
    spec = mb.model_spec(cfg, 258, "unfused")
    assert (spec.global_batch_size, spec.overlap_grad_reduce) == (4, False)
    fp32 = ("--grpo-residual-dtype", "fp32")
    on, off, int8 = peaks(*fp32), peaks(*fp32, "--no-grpo-release-grads"), peaks()  # int8: the default
    for level in on:
        assert on[level] < off[level] and int8[level] < on[level], level
    # Each is the planner's total for that level's placement, first iteration included.
    cfg = _cfg(1000, "--global-batch-size", "4")
    memory = plan(mb.model_spec(cfg, 258, "unfused"), ClusterSpec(nodes=1, gpus_per_node=2), cfg.grpo,
                  bucket_size=cfg.parallel.ddp_bucket_size).grpo_memory
    assert int8["resident"] == base + memory.total == base + max(memory.steady, memory.first_iteration)
