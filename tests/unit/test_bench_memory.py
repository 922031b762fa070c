"""bench memory's save step: every contender saves after iteration SAVE_AT, the next record (which
holds the save's peak) is its own column and stays out of the steady window, the scratch
checkpoints are deleted, and --contenders tabulates only what ran."""

import json
import os

from megatron_grpo.bench import runner


def _records(name):
    base = 2000 if name == "baseline" else 1000
    out, high = [], 0
    for i in range(1, 17):
        step = 2**20 * (base + (500 if i == 13 else i))  # 13 holds the save after 12
        high = max(high, step)
        out.append({"iteration": i, "loss": 5.0 - 0.1 * i, "step_time_s": 0.1,
                    "optimizer_time_s": 0.02, "tokens_per_s": 100.0, "wire_bytes": 1000,
                    "step_peak_rss_bytes": step, "peak_rss_bytes": high,
                    **({"val_loss": 3.0} if i == 16 else {})})
    return out


def test_memory_suite_reports_the_step_after_its_save_apart(tmp_path, monkeypatch):
    from megatron_grpo.bench import __main__ as cli
    from megatron_grpo.bench import memory

    ran = {}

    def fake_run(self, name, c, extra=(), env=None):
        ran[c.name] = list(c.flags)
        save = c.flags[c.flags.index("--save") + 1]
        os.makedirs(os.path.join(save, "iter_0000012"))  # what the run leaves
        return _records(c.name)

    monkeypatch.setattr(runner.Runner, "run", fake_run)
    monkeypatch.setattr(cli, "ensure_data", lambda path: None)
    out = tmp_path / "o"
    assert cli.main(["memory", "--out", str(out), "--contenders", "grpo-ssd"]) == 0
    root = os.path.join(str(out), "memory", "ckpt")
    assert sorted(ran) == ["baseline", "grpo-ssd"]
    for name, flags in ran.items():
        assert flags[-5:] == ["--save", os.path.join(root, name), "--save-interval",
                              str(memory.SAVE_AT), "--overwrite-checkpoints"]
    assert not os.path.exists(root)  # scratch: gone once the suite has run
    saved = json.loads((out / "memory" / "memory.json").read_text())
    header = saved["header"]
    rows = {r[0]: dict(zip(header, r)) for r in saved["rows"]}
    assert list(rows) == ["baseline", "grpo-ssd", "megatron-cpu-offload"]
    after = "peak RSS MB, step after the save at 12"
    # Steady window: iterations 6-16 less 13; the save's step apart, against the steady peak.
    assert rows["grpo-ssd"]["steady peak RSS MB"] == "1016" and rows["grpo-ssd"][after] == "1500 (1.48×)"
    assert rows["baseline"]["steady peak RSS MB"] == "2016" and rows["baseline"][after] == "2500 (1.24×)"
    assert rows["grpo-ssd"]["whole-run peak RSS MB"] == "1500"  # the whole run holds the save
    assert memory.save_step_peak_mb(_records("grpo")[:12]) is None  # a run too short to save at 12
