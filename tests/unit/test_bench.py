"""The evidence suite's pieces without training: figures from records, the steady window, run
reuse, plots and the docs regeneration."""

import json
import os

import pytest

from megatron_grpo.bench import figures as F
from megatron_grpo.bench import plots, report, runner
from megatron_grpo.bench.suite import SuiteResult


def _records(n, wire, tiered_from=None, val_every=5, val_base=3.0, step=0.1, tier_map=None):
    out = []
    for i in range(1, n + 1):
        r = {"iteration": i, "loss": 5.0 - 0.1 * i, "step_time_s": step, "optimizer_time_s": step / 4,
             "tokens_per_s": 100.0, "wire_bytes": wire(i), "peak_rss_bytes": 2**20 * (100 + i)}
        if tiered_from is not None:
            r["grpo_tiered"] = i >= tiered_from
            r["grpo_tier_map"] = tier_map if i >= tiered_from else "ccc"
            for t, share in zip(F.TIERS, (0.2, 0.6, 0.2)):
                r[f"grpo_share_{t}"] = share
                r[f"wire_bytes_{t}"] = wire(i) // 3
        if i % val_every == 0:
            r["val_loss"] = val_base + 0.01 * i
        out.append(r)
    return out


def test_steady_window_and_ratios_are_exact():
    base = _records(20, lambda i: 1000)
    grpo = _records(20, lambda i: 1000 if i < 8 else 250, tiered_from=8, val_base=3.03, step=0.2,
                    tier_map="cds")
    start = F.steady_start([base, grpo], default=3)
    assert start == 7  # the last exact iteration before GRPO's first tiered one, not the default
    b, g = F.summarize(base, start), F.summarize(grpo, start)
    cmp = F.compare(g, b)
    assert g["steady_wire_bytes_per_step"] == 250 and b["steady_wire_bytes_per_step"] == 1000
    assert cmp["steady_wire_ratio"] == 0.25
    # whole run: iterations 2..20 (first left out): 6 x 1000 + 13 x 250
    assert cmp["wire_ratio"] == pytest.approx((6 * 1000 + 13 * 250) / 19 / 1000)
    assert cmp["val_loss_diff_pct"] == pytest.approx(100 * (3.23 / 3.2 - 1))
    assert [i for i, _ in cmp["val_diff_curve"]] == [5, 10, 15, 20]
    assert cmp["step_time_ratio"] == pytest.approx(2.0)
    assert g["mean_shares"]["stable"] == pytest.approx(0.2)
    assert g["peak_rss_mb"] == 120
    assert F.steady_start([base], default=3) == 3  # no GRPO run: the configured warm-up


def test_device_bytes_by_kind_are_the_steady_windows_most():
    grpo = _records(12, lambda i: 100, tiered_from=8, tier_map="cds")
    for r in grpo:  # the warm-up keeps everything; tiered steps move the dynamic masters out
        i = r["iteration"]
        r["mem_masters_dynamic"] = 2**20 * (8 if i < 8 else 0)
        r["mem_moments_core"] = 2**20 * (i % 3)
    g = F.summarize(grpo, 7)
    assert g["steady_device_mb_by_kind"] == {"masters_dynamic": 0.0, "moments_core": 2.0}
    assert "steady_device_mb_by_kind" not in F.summarize(_records(12, lambda i: 100), 7)


def test_reuse_needs_same_command_same_code_and_a_complete_run(tmp_path):
    metrics, cmd_file = tmp_path / "a.jsonl", tmp_path / "a.cmd.json"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _records(10, lambda i: 1)))
    cmd = ["python", "x", "--seed", "1"]
    cmd_file.write_text(json.dumps({"command": cmd, "code": runner.code_fingerprint()}))
    assert runner.Runner._complete(str(metrics), str(cmd_file), cmd, 10)
    assert not runner.Runner._complete(str(metrics), str(cmd_file), cmd, 12)         # incomplete
    assert not runner.Runner._complete(str(metrics), str(cmd_file), cmd[:-1] + ["2"], 10)  # flags
    cmd_file.write_text(json.dumps({"command": cmd, "code": "other"}))
    assert not runner.Runner._complete(str(metrics), str(cmd_file), cmd, 10)         # code changed
    # A torn last line (killed run) is dropped, not an error.
    with open(metrics, "a") as fh:
        fh.write('{"iteration": 11, "lo')
    assert runner.read_records(str(metrics))[-1]["iteration"] == 10


def test_config_value_prefers_the_last_flag(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train-iters: 300\nseed: 5\n")
    assert runner.config_value(str(cfg), "train-iters") == 300
    assert runner.config_value(str(cfg), "train-iters", ["--train-iters", "7", "--train-iters", "9"]) == "9"
    assert runner.config_value(str(cfg), "missing") is None


def test_plots_write_pngs_and_tier_map_refuses_a_baseline(tmp_path):
    base = _records(20, lambda i: 1000)
    grpo = _records(20, lambda i: 250, tiered_from=8, tier_map="cds")
    paths = [plots.loss_curves({"b": base, "g": grpo}, str(tmp_path / "l.png"), "t"),
             plots.wire_per_step({"b": base, "g": grpo}, str(tmp_path / "w.png"), "t"),
             plots.tier_map(grpo, str(tmp_path / "m.png"), "t"),
             plots.val_diff({"g": [[5, 0.1], [10, 0.5]]}, str(tmp_path / "d.png"), "t"),
             plots.step_breakdown({"b": F.summarize(base)}, str(tmp_path / "s.png"), "t"),
             plots.memory_by_location({"b": {"host": 1.0}}, str(tmp_path / "mem.png"), "t"),
             plots.bytes_vs_quality({"g": (0.25, 0.3), "none": (None, 1)}, str(tmp_path / "f.png"), "t")]
    for p in paths:
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n", p
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]
    with pytest.raises(ValueError, match="not a GRPO run"):
        plots.tier_map(base, str(tmp_path / "x.png"), "t")


def test_docs_sections_are_replaced_between_markers_and_plots_copied(tmp_path):
    docs = tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    docs.write_text("# Benchmarks\n\nhand-written text\n\n<!-- bench:comm -->\nOLD\n<!-- /bench:comm -->\n\ntail\n")
    png = tmp_path / "run" / "p.png"
    png.parent.mkdir()
    png.write_bytes(b"\x89PNG\r\n\x1a\nfake")
    comm = SuiteResult("comm", "Comm", "python -m megatron_grpo.bench comm", ["a", "b"], [["x", "1"]],
                       ["a note"], {"bytes": str(png)})
    quality = SuiteResult("quality", "Quality", "cmd", ["a"], skipped="no reason")
    report.update_docs(str(docs), [comm, quality])
    text = docs.read_text()
    assert "OLD" not in text and "hand-written text" in text and "tail" in text
    assert "| x | 1 |" in text and "- a note" in text
    assert "![bytes](figures/bench/comm/p.png)" in text
    assert (docs.parent / "figures" / "bench" / "comm" / "p.png").read_bytes().startswith(b"\x89PNG")
    assert text.count("<!-- bench:quality -->") == 1 and "Not run here: no reason" in text
    report.update_docs(str(docs), [comm])   # again: replaced in place, not appended twice
    assert docs.read_text().count("<!-- bench:comm -->") == 1


def test_shown_command_leaves_out_where_results_go():
    from megatron_grpo.bench.suite import command_line

    assert command_line(["comm", "--out", "/x", "--update-docs", "--docs", "d.md", "--seeds", "1",
                         "--", "--out", "kept"]) == \
        "python -m megatron_grpo.bench comm --seeds 1 -- --out kept"


def test_all_runs_every_suite_with_its_own_command_and_regenerates_the_docs(tmp_path, monkeypatch):
    import types

    from megatron_grpo.bench import __main__ as cli

    seen = []

    def fake_module(name):
        def run(args, command):
            seen.append((name, command, args.extra))
            return SuiteResult(name, name.title(), command, ["x"], [["1"]])
        return types.SimpleNamespace(run=run)

    monkeypatch.setattr(cli.importlib, "import_module", lambda mod: fake_module(mod.rsplit(".", 1)[1]))
    monkeypatch.setattr(cli, "ensure_data", lambda path: None)
    docs = tmp_path / "benchmarks.md"
    assert cli.main(["all", "--out", str(tmp_path / "o"), "--docs", str(docs), "--", "--seed", "3"]) == 0
    assert [s for s, _, _ in seen] == list(cli.SUITES)
    assert seen[1][1] == "python -m megatron_grpo.bench quality -- --seed 3"
    assert all(extra == ["--seed", "3"] for _, _, extra in seen)
    text = docs.read_text()
    assert all(f"<!-- bench:{s} -->" in text for s in cli.SUITES)
    assert (tmp_path / "o" / "slowlink" / "slowlink.json").exists()


def test_pareto_front_keeps_only_undominated_points():
    from megatron_grpo.bench.front import pareto

    pts = {"a": (0.2, 0.5), "b": (0.3, 0.1), "c": (0.3, 0.6), "d": (0.1, 2.0), "e": (None, 0.0)}
    assert sorted(pareto(pts)) == ["a", "b", "d"]   # c is beaten by a on both; e has no bytes


def test_only_trains_the_named_contenders_under_the_suite_run_names(tmp_path, monkeypatch):
    from megatron_grpo.bench import __main__ as cli

    ran = []
    monkeypatch.setattr(runner.Runner, "run", lambda self, name, c, extra=(), env=None:
                        ran.append((self.suite, name, c.flags, list(extra))))
    monkeypatch.setattr(cli, "ensure_data", lambda path: None)
    assert cli.main(["quality", "--out", str(tmp_path), "--seeds", "7", "8", "--only", "grpo"]) == 0
    from megatron_grpo.bench.comm import FORMER_FROZEN

    assert ran == [("quality", "grpo-s7", ["--grpo", *FORMER_FROZEN], ["--seed", "7"]),
                   ("quality", "grpo-s8", ["--grpo", *FORMER_FROZEN], ["--seed", "8"])]
    assert cli.main(["comm", "--out", str(tmp_path), "--only", "nope"]) == 1
    assert cli.main(["all", "--out", str(tmp_path), "--only", "grpo"]) == 2


def test_slowlink_reads_the_slow_link_summary_and_reports_a_missing_cluster(tmp_path, monkeypatch):
    import argparse
    import subprocess

    from megatron_grpo.bench import slowlink

    row = {"rate": "100mbit", "ratio_mean": 0.377,
           "baseline": {"step_mean_s": 1.0, "counted_bytes_per_step": 4e6, "val_loss": 2.75},
           "grpo": {"step_mean_s": 0.377, "counted_bytes_per_step": 1e6, "val_loss": 2.74}}

    def fake_run(cmd, cwd=None):
        out = cmd[cmd.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "summary.json"), "w") as fh:
            json.dump({"rows": [row]}, fh)
        assert cmd[cmd.index("--rate") + 1] == "100mbit"
        return subprocess.CompletedProcess(cmd, rc[0])

    rc = [0]
    monkeypatch.setattr(slowlink.subprocess, "run", fake_run)
    args = argparse.Namespace(out=str(tmp_path), rates=None, config=None, data_path="d",
                              train_iters=None, seeds=None)
    res = slowlink.run(args, "cmd")
    assert res.rows == [["100mbit", "1.000", "0.377", "0.377", "0.250", "2.7500", "2.7400"]]
    assert res.plots and res.skipped is None
    rc[0] = 2   # bench_slow_link.py: the local cluster cannot be built here
    assert "cannot be built" in slowlink.run(args, "cmd").skipped


def test_a_run_of_the_same_training_is_copied_across_suites_not_retrained(tmp_path):
    spec_a = runner.RunSpec(out=str(tmp_path / "a"), config="c.yaml", data_path="d")
    spec_b = runner.RunSpec(out=str(tmp_path / "b"), config="c.yaml", data_path="d")
    base = runner.Contender("baseline", [])
    ra, rb = runner.Runner("a", spec_a, 1), runner.Runner("b", spec_b, 1)
    cmd_a = ra.command("baseline-s1", base, ["--seed", "1"])
    cmd_b = rb.command("base-s1", base, ["--seed", "1"])
    assert cmd_a != cmd_b and runner.training_key(cmd_a) == runner.training_key(cmd_b)
    assert runner.training_key(cmd_a) != runner.training_key(ra.command("x", base, ["--seed", "2"]))
    metrics = tmp_path / "a" / "baseline-s1.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _records(10, lambda i: 1)))
    cmd_file = tmp_path / "a" / "baseline-s1.cmd.json"
    cmd_file.write_text(json.dumps({"command": cmd_a, "code": runner.code_fingerprint(), "load": [1, 2, 3]}))
    ra._add_to_index(cmd_a, str(metrics), str(cmd_file))
    dst, dst_cmd = str(tmp_path / "b" / "base-s1.jsonl"), str(tmp_path / "b" / "base-s1.cmd.json")
    assert not rb._copy_from_index("base-s1", cmd_b, dst, dst_cmd, 12)  # another length: not the same run
    assert rb._copy_from_index("base-s1", cmd_b, dst, dst_cmd, 10)
    assert runner.read_records(dst) == runner.read_records(str(metrics))
    assert rb.loads == {"base-s1": [1, 2, 3]}  # the source run's machine load, under this run's name
    assert runner.Runner._complete(dst, dst_cmd, cmd_b, 10)  # now this suite's own complete run
    # A source that no longer matches (retrained by other code, or torn) is not copied.
    cmd_file.write_text(json.dumps({"command": cmd_a, "code": "other"}))
    assert not rb._copy_from_index("base-s1", cmd_b, dst + "2", dst_cmd + "2", 10)


def test_ranking_verdict_uses_the_spread_of_the_gap_not_of_the_baseline():
    from megatron_grpo.bench.ablation import ranking_verdict

    # The figures of the 1,000-step tiny ablation: a win on one seed, a tie on the other.
    v = ranking_verdict({1234: 1.37, 4321: 2.21}, {1234: 3.47, 4321: 2.19})
    assert v.startswith("importance ranking does NOT beat") and "+1.04 points" in v
    assert "seed 4321 -0.02" in v and "spread of the gap over seeds 1.28 points" in v
    v = ranking_verdict({1: 0.5, 2: 0.6}, {1: 3.0, 2: 3.2})
    assert v.startswith("importance ranking beats"), v
    assert ranking_verdict({1: 0.5}, {1: 3.0}).startswith("importance ranking does NOT beat")  # one seed
    assert ranking_verdict({1: None}, {1: 3.0}) == ""


def test_late_loss_is_the_paired_mean_of_the_second_half():
    base = _records(20, lambda i: 1000)          # loss 5.0 - 0.1 i
    run = [dict(r, loss=r["loss"] * 1.02 if r["iteration"] > 10 else r["loss"]) for r in base]
    b, g = F.summarize(base), F.summarize(run)
    assert b["late_loss"] == pytest.approx(sum(5.0 - 0.1 * i for i in range(11, 21)) / 10)
    assert F.compare(g, b)["late_loss_diff_pct"] == pytest.approx(2.0)  # first half left out


def test_contenders_subset_on_another_config_gets_its_own_section(tmp_path, monkeypatch):
    from megatron_grpo.bench import __main__ as cli

    ran = []

    def fake_run(self, name, c, extra=(), env=None):
        ran.append(name)
        worse = {"baseline": 0.0, "importance": 0.01, "random": 0.03}[c.name]
        recs = _records(40, lambda i: 1000 if c.name == "baseline" or i <= 10 else 250,
                        tiered_from=None if c.name == "baseline" else 11)
        for r in recs:
            r["loss"] += worse * (1 + 0.1 * int(extra[-1]))
            r["run"] = name
        return recs

    monkeypatch.setattr(runner.Runner, "run", fake_run)
    monkeypatch.setattr(cli, "ensure_data", lambda path: None)
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n<!-- bench:ablation -->\ntiny figures\n<!-- /bench:ablation -->\n")
    argv = ["ablation", "--out", str(tmp_path / "o"), "--config", "launch/configs/small.yaml",
            "--seeds", "1", "2", "--contenders", "importance", "random", "--update-docs",
            "--docs", str(docs)]
    assert cli.main(argv) == 0
    assert ran == ["baseline-s1", "importance-s1", "random-s1",
                   "baseline-s2", "importance-s2", "random-s2"]
    text = docs.read_text()
    assert "tiny figures" in text  # the tiny model's section is left alone
    section = text.split("<!-- bench:ablation-small -->")[1].split("<!-- /bench:ablation-small -->")[0]
    assert "score variants (small.yaml, ablation-small)" in section
    rows = [line.split(" | ")[0].lstrip("| ") for line in section.splitlines() if line.startswith("| ")]
    assert rows == ["contender", "importance", "random"]
    assert "late loss, importance vs random: importance ranking beats random tiers" in section
    saved = json.loads((tmp_path / "o" / "ablation" / "ablation-small.json").read_text())
    assert saved["suite"] == "ablation-small"
    assert cli.main([*argv[:-4], "--contenders", "nope"]) == 1
    # --section: the same table under another name, the earlier section left as it was.
    assert cli.main([*argv, "--section", "ablation-pair"]) == 0
    text = docs.read_text()
    assert section in text and "<!-- bench:ablation-pair -->" in text
    assert (tmp_path / "o" / "ablation" / "ablation-pair.json").exists()


def test_memory_suite_checks_the_planner_against_what_the_ssd_run_placed():
    from megatron_grpo.bench import memory
    from megatron_grpo.bench.runner import CONFIGS, RunSpec
    from megatron_grpo.planner.plan import plan, stream_window_bytes
    from megatron_grpo.training.memory_budget import spec_from_flags

    config = os.path.join(CONFIGS, "mem100m.yaml")
    model, cluster, grpo, bucket, off = spec_from_flags(
        ["--config", config, "--grpo", "--grpo-offload", "ssd", "--grpo-offload-dir", "x"], nodes=1,
        gpus_per_node=2, gpu_memory_gb=1.0, link_gbps=1.0, vocab=258, attention="unfused")
    n = len(plan(model, cluster, grpo, bucket_size=bucket).units)
    tier_map = "c" + "d" * (n - 5) + "ssss"
    p = plan(model, cluster, grpo, bucket_size=bucket, tiers=tier_map, offload=off)
    import dataclasses

    no_res = plan(model, cluster, grpo, bucket_size=bucket, tiers=tier_map,
                  offload=dataclasses.replace(off, residuals=False))
    away = no_res.grpo_memory.offloaded + stream_window_bytes(p.units, 2)
    # A run that placed 10 % more than predicted, and whose peak fell by exactly the prediction.
    rec = {"iteration": 9, "grpo_tier_map": tier_map, "grpo_tiered": True,
           "offload_bytes_dynamic_ssd": round(0.8 * 1.1 * away), "offload_bytes_stable_ssd": round(0.2 * 1.1 * away)}
    drop_mb = p.grpo_memory.offloaded / 2**20
    lines = memory._planner_check(RunSpec(out="x", config=config, data_path="x"), {"grpo-ssd": [rec]},
                                  {"grpo": {"steady_peak_rss_mb": 1000 + drop_mb},
                                   "grpo-ssd": {"steady_peak_rss_mb": 1000.0}})
    assert "(+10.0 %)" in lines[0] and lines[1].endswith("(+0.0 %)")
    assert memory._planner_check(RunSpec(out="x", config=config, data_path="x"), {}, {}) == []


def test_internode_suite_runs_four_ranks_as_two_nodes_and_reads_the_inter_node_bytes(tmp_path, monkeypatch):
    from megatron_grpo.bench import __main__ as cli

    seen = []
    inter = {"baseline": 600, "megatron-flat": 1800, "grpo-flat": 280, "grpo-hier": 90,
             "grpo-periodic": 36, "grpo-periodic-h10": 42, "grpo-periodic-nesterov": 36,
             "grpo-periodic-core10": 9, "grpo-periodic-c4h10": 18, "grpo-periodic-i4h10": 24,
             "grpo-periodic-i4h4": 30, "grpo-periodic-i4h10-d8": 27,
             "grpo-periodic-i4h10-lr14": 24,
             "grpo-source": 6}

    def fake_run(self, name, c, extra=(), env=None):
        seen.append((name, self.spec.nproc, dict(self.spec.env)))
        recs = _records(40, lambda i: 1800, tiered_from=None if "grpo" not in c.name else 11)
        for r in recs:
            r["wire_bytes_inter_node"] = 600 if r["iteration"] <= 10 and c.name != "megatron-flat" \
                else inter[c.name]
        return recs

    monkeypatch.setattr(runner.Runner, "run", fake_run)
    monkeypatch.setattr(cli, "ensure_data", lambda path: None)
    assert cli.main(["internode", "--out", str(tmp_path / "o")]) == 0
    assert [n for n, _, _ in seen] == [f"{c}-s1234" for c in inter]  # the suite's order
    assert {(p, e["MEGATRON_GRPO_RANKS_PER_NODE"]) for _, p, e in seen} == {(4, "2")}
    saved = json.loads((tmp_path / "o" / "internode" / "internode.json").read_text())
    rows = {r[0]: r for r in saved["rows"]}
    assert rows["grpo-hier"][2] == "0.150"  # 90 / 600 after warm-up
    assert rows["megatron-flat"][2] == "3.000"
    assert rows["grpo-periodic-core10"][2] == "0.015" and rows["grpo-source"][2] == "0.010"


def test_comm_suite_sets_megatrons_bf16_reduce_scatter_and_gpu_shaped_bytes_beside_the_runs(
        tmp_path, monkeypatch):
    """The comm table with its runs faked: megatron's reduce_scatter_with_fp32_accumulation is
    an analytic row (no loss, no step time), and every row's bytes with bf16 parameters stand
    beside the counted fp32 ones, against megatron's best bf16 setting. tiny.yaml at dp 2: the
    baseline's buckets and GRPO's 14 units both hold 908,032 padded elements."""
    from megatron_grpo.bench import __main__ as cli

    maps = {"grpo-int4": "cc" + "d" * 10 + "ss", "all-int4": "d" * 14}

    def fake_run(self, name, c, extra=(), env=None):
        tiered = "--grpo" in c.flags
        recs = _records(40, lambda i: 3_632_128 if not tiered or i <= 30 else 800_000,
                        tiered_from=31 if tiered else None, tier_map=maps.get(c.name, "d" * 14))
        if c.name == "grpo-int4":  # re-tiered after 5 of the 10 steady iterations
            for r in recs[35:]:
                r["grpo_tier_map"] = "d" * 14
        return recs

    monkeypatch.setattr(runner.Runner, "run", fake_run)
    monkeypatch.setattr(cli, "ensure_data", lambda path: None)
    assert cli.main(["comm", "--out", str(tmp_path / "o")]) == 0
    saved = json.loads((tmp_path / "o" / "comm" / "comm.json").read_text())
    rows = {r[0]: r for r in saved["rows"]}
    gpu = saved["header"].index("GPU-shaped (bf16) bytes/step")
    # Baseline, bf16 parameters: fp32 reduce-scatter + bf16 all-gather, (dp-1)/dp of 908,032
    # elements each: 1,816,064 + 908,032. megatron's bf16 reduce-scatter: 908,032 + 908,032.
    assert rows["baseline"][gpu:gpu + 2] == ["2.724 MB", "1.500"]
    peer = rows["megatron-bf16-rs (analytic, not run on CPU)"]
    assert peer[gpu:gpu + 2] == ["1.816 MB", "1.000"]
    assert peer[1:gpu] == ["-"] * (gpu - 1) and peer[gpu + 2:] == ["-"] * 4
    # grpo-int4 (exact core), its first map: core 2 units of 115,072 elements x 3 bytes (4 + 2,
    # halved by dp) = 345,216; dynamic int4 340,776 (no dtype in it); stable 132,096 x 3 every
    # 10 steps: 725,620.8. Its second map, all int4: 468,232. Five iterations each.
    assert rows["grpo-int4"][gpu:gpu + 2] == ["0.597 MB", f"{596_926.4 / 1_816_064:.3f}"]
    assert rows["all-int4"][gpu:gpu + 2] == ["0.468 MB", "0.258"]
    assert rows["grpo-powersgd"][gpu:gpu + 2] == ["-", "-"]  # the planner does not model it
    assert saved["data"]["gpu_shaped_bytes"]["grpo-int4"]["fp32"] == (853_902.4 + 468_232) / 2
    assert any("all-int4 0.468 MB (counted 0.800)" in n for n in saved["notes"])


def test_runs_of_one_contender_share_a_colour_and_seeds_a_line_style():
    """14 runs (7 contenders x 2 seeds) on the 10-colour cycle: no two contenders share one."""
    labels = [f"{n} s{seed}" for seed in (1234, 4321) for n in "abcdefg"]
    st = plots.run_styles(labels)
    assert len({st[f"{n} s1234"]["color"] for n in "abcdefg"}) == 7
    assert all(st[f"{n} s1234"]["color"] == st[f"{n} s4321"]["color"] for n in "abcdefg")
    assert {st[f"a s{seed}"]["linestyle"] for seed in (1234, 4321)} == {"-", "--"}
    assert plots.run_styles(["baseline"])["baseline"]["linestyle"] == "-"  # a label without a seed
