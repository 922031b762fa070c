"""Run a list of contenders once each (same seed, data, steps) and compare each to the first."""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

from megatron_grpo.bench import figures as F
from megatron_grpo.bench.runner import Contender, Runner, config_value


def run_all(suite: str, args, default_config: str, contenders: List[Contender]
            ) -> Tuple[object, Dict[str, List[Dict]], Dict[str, Dict], Dict[str, Dict], int]:
    """Returns (spec, records, summaries, comparisons to contenders[0], steady-window start).
    Contenders with ``skip`` set are left out of the dicts (the suite reports why)."""
    spec = args.spec(default_config, suite)
    seed = (args.seeds or [int(config_value(spec.config, "seed", spec.common) or 1234)])[0]
    todo = [c for c in contenders if not c.skip]
    runner = Runner(suite, spec, len(todo))
    records = {c.name: runner.run(f"{c.name}-s{seed}", c, ["--seed", str(seed)]) for c in todo}
    warmup = F.steady_start(list(records.values()),
                            int(config_value(spec.config, "grpo-warmup-iters", spec.common) or 0))
    summaries = {n: F.summarize(r, warmup) for n, r in records.items()}
    base = summaries[todo[0].name]
    comparisons = {n: F.compare(s, base) for n, s in summaries.items()}
    return spec, records, summaries, comparisons, warmup


def plot_path(spec, name: str) -> str:
    return os.path.join(spec.out, name)
