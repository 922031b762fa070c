"""Run a list of contenders (same seed, data, steps) and compare each to the first, the baseline,
of the same seed."""

from __future__ import annotations

import os
import statistics
from typing import Dict, List, Optional, Sequence

from megatron_grpo.bench import figures as F
from megatron_grpo.bench.runner import Contender, Runner, config_value


class Grid:
    """records / summaries / comparisons indexed [contender name][seed]."""

    def __init__(self, spec, seeds: List[int]) -> None:
        self.spec, self.seeds = spec, seeds
        self.records: Dict[str, Dict[int, List[Dict]]] = {}
        self.summaries: Dict[str, Dict[int, Dict]] = {}
        self.compare: Dict[str, Dict[int, Dict]] = {}
        self.steady_from = 0
        self.load_note = ""
        self.section = ""
        """The suite's docs section (and JSON) name: the suite, or suite-<config> off its default
        config, so the small model's ablation does not overwrite the tiny model's."""
        self.names: List[str] = []
        """Contenders run, baseline first."""

    def has(self, *names: str) -> bool:
        return all(n in self.names for n in names)

    def mean(self, name: str, key: str) -> Optional[float]:
        """Mean over seeds of a comparison figure (e.g. val_loss_diff_pct)."""
        xs = [self.compare[name][s][key] for s in self.seeds if self.compare[name][s].get(key) is not None]
        return statistics.mean(xs) if xs else None

    def baseline_spread_pct(self, base: str = "baseline") -> Optional[float]:
        """Seed-to-seed spread of the baseline's validation loss, in percent of its mean."""
        vals = [self.summaries[base][s]["val_loss"] for s in self.seeds]
        vals = [v for v in vals if v is not None]
        if len(vals) < 2:
            return None
        return 100 * (max(vals) - min(vals)) / statistics.mean(vals)


def run_grid(suite: str, args, default_config: str, contenders: List[Contender],
             default_seeds: Sequence[int], env: Optional[Dict[str, str]] = None) -> Grid:
    """Train every runnable contender for every seed (seed-major, so a partial suite has whole
    seeds); contenders[0] is the baseline every other one is compared with."""
    spec = args.spec(default_config, suite)
    spec.env = dict(env or {})
    seeds = list(args.seeds or default_seeds)
    todo = [c for c in select(contenders, getattr(args, "contenders", None), suite) if not c.skip]
    runner = Runner(suite, spec, len(todo) * len(seeds))
    grid = Grid(spec, seeds)
    grid.section = getattr(args, "section", None) or section_name(suite, spec.config, default_config)
    grid.names = [c.name for c in todo]
    for seed in seeds:
        for c in todo:
            grid.records.setdefault(c.name, {})[seed] = runner.run(f"{c.name}-s{seed}", c,
                                                                   ["--seed", str(seed)])
    grid.load_note = runner.load_note()
    grid.steady_from = F.steady_start(
        [r for runs in grid.records.values() for r in runs.values()],
        int(config_value(spec.config, "grpo-warmup-iters", spec.common) or 0))
    for name, runs in grid.records.items():
        grid.summaries[name] = {s: F.summarize(r, grid.steady_from) for s, r in runs.items()}
    base = todo[0].name
    for name in grid.summaries:
        grid.compare[name] = {s: F.compare(grid.summaries[name][s], grid.summaries[base][s])
                              for s in seeds}
    return grid


def select(contenders: List[Contender], names: Optional[Sequence[str]], suite: str) -> List[Contender]:
    """--contenders: the baseline (always) and the named ones, in the suite's order."""
    if not names:
        return list(contenders)
    from megatron_grpo.bench.runner import BenchError

    known = [c.name for c in contenders]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BenchError(f"--contenders: suite {suite} has no contender {', '.join(unknown)}; "
                         f"its contenders: {', '.join(known)}")
    return [c for i, c in enumerate(contenders) if i == 0 or c.name in names]


def section_name(suite: str, config: str, default_config: str) -> str:
    if os.path.abspath(config) == os.path.abspath(default_config):
        return suite
    return f"{suite}-{os.path.splitext(os.path.basename(config))[0]}"


def run_all(suite: str, args, default_config: str, contenders: List[Contender],
            env: Optional[Dict[str, str]] = None):
    """One seed (the first of --seeds, else the config's): (spec, records, summaries,
    comparisons, steady-window start, machine-load note), dicts keyed by contender name."""
    spec = args.spec(default_config, suite)
    seed = (args.seeds or [int(config_value(spec.config, "seed", spec.common) or 1234)])[0]
    one = type(args)(**{**vars(args), "seeds": [seed]})
    grid = run_grid(suite, one, default_config, contenders, [seed], env)
    pick = lambda d: {n: v[seed] for n, v in d.items()}  # noqa: E731
    return (spec, pick(grid.records), pick(grid.summaries), pick(grid.compare), grid.steady_from,
            grid.load_note)


def plot_path(spec, name: str) -> str:
    return os.path.join(spec.out, name)
