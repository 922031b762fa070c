"""python -m megatron_grpo.bench {comm,quality,compute,memory,slowlink,all,ablation,front,internode,memcap} --out DIR

Each suite runs its contenders in one invocation (same seed, data and steps, real training entry
under torchrun), prints a table of ratios against the megatron baseline, and writes
DIR/<suite>/<suite>.json and PNG plots. ``all`` runs every suite and regenerates the figure
sections of docs/benchmarks.md (between the ``bench:`` markers) with the plots and commands.

    python -m megatron_grpo.bench comm --out runs/bench                  # tiny model, ~6 min
    python -m megatron_grpo.bench quality --out runs/bench               # ~10 M params, 2 seeds
    python -m megatron_grpo.bench quality --train-iters 500 --seeds 1234 -- --grpo-stable-mode delayed

Complete runs with an unchanged command are reused (``--no-reuse`` retrains them), so an
interrupted suite resumes where it stopped.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

from megatron_grpo.bench.runner import REPO, BenchError, RunSpec, ensure_data
from megatron_grpo.bench.suite import command_line

SUITES = ("comm", "quality", "compute", "memory", "slowlink")
# The quality front's studies: not part of `all` (they are sweeps of many runs); run them by name.
STUDIES = ("ablation", "front", "internode", "memcap")


class BenchArgs(argparse.Namespace):
    """Parsed flags plus the RunSpec each suite builds from them."""

    def spec(self, default_config: str, suite: str) -> RunSpec:
        common: List[str] = []
        if self.train_iters:
            common += ["--train-iters", str(self.train_iters)]
        common += self.extra
        return RunSpec(out=os.path.join(self.out, suite), config=self.config or default_config,
                       data_path=self.data_path, nproc=self.nproc, common=common,
                       reuse=not self.no_reuse)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_grpo.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=SUITES + STUDIES + ("all",), help="which benchmark to run")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench"),
                   help="output directory (one sub-directory per suite)")
    p.add_argument("--config", default=None,
                   help="model/training YAML (default: the suite's own, e.g. tiny.yaml or small.yaml)")
    p.add_argument("--data-path", default=os.path.join(REPO, "data", "stdlib"),
                   help="dataset prefix; the default corpus is built there when missing")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (gloo on CPU)")
    p.add_argument("--train-iters", type=int, default=None, help="override the config's iterations")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (quality: 1234 4321)")
    p.add_argument("--rates", nargs="+", default=None,
                   help="slowlink: tc rates of the link (default 100mbit)")
    p.add_argument("--cap-gb", type=float, default=None,
                   help="memcap: the memory cap on the whole job, GB (default 4)")
    p.add_argument("--no-reuse", action="store_true", help="retrain runs that are complete")
    p.add_argument("--only", nargs="+", default=None, metavar="CONTENDER",
                   help="train just these contenders of the suite (e.g. to run them as parallel "
                        "jobs), print no table; the suite run without --only reuses them")
    p.add_argument("--contenders", nargs="+", default=None, metavar="CONTENDER",
                   help="run and tabulate only these contenders of the suite (and its "
                        "baseline), e.g. a subset of the ablation on a larger model")
    p.add_argument("--section", default=None,
                   help="docs section (and JSON) name of this suite's table instead of the "
                        "suite's own, e.g. a --contenders subset beside the full table")
    p.add_argument("--docs", default=os.path.join(REPO, "docs", "benchmarks.md"),
                   help="the markdown file whose bench sections are regenerated (all, --update-docs)")
    p.add_argument("--update-docs", action="store_true",
                   help="also regenerate this suite's section of --docs (all always does)")
    return p


def train_only(name: str, args: BenchArgs) -> None:
    """--only: train the named contenders of suite ``name`` for each seed, under the suite's
    run names, so a later full run of the suite reuses them."""
    from megatron_grpo.bench.runner import Runner, config_value

    module = importlib.import_module(f"megatron_grpo.bench.{name}")
    cands = module.contenders(args.out) if hasattr(module, "contenders") else getattr(module, "CONTENDERS", None)
    if not cands:
        raise BenchError(f"--only: suite {name} has no contenders to select")
    known = [c.name for c in cands]
    unknown = [n for n in args.only if n not in known]
    if unknown:
        raise BenchError(f"--only: suite {name} has no contender {', '.join(unknown)}; "
                         f"its contenders: {', '.join(known)}")
    chosen = [c for c in cands if c.name in args.only and not c.skip]
    spec = args.spec(module.DEFAULT_CONFIG, name)
    seeds = args.seeds or getattr(module, "DEFAULT_SEEDS", None) or \
        [int(config_value(spec.config, "seed", spec.common) or 1234)]
    runner = Runner(name, spec, len(chosen) * len(seeds))
    for seed in seeds:
        for c in chosen:
            runner.run(f"{c.name}-s{seed}", c, ["--seed", str(seed)])
    print(f"[bench {name}] trained {', '.join(c.name for c in chosen)} for seed(s) "
          f"{', '.join(map(str, seeds))}; run the suite without --only for its table (complete "
          f"runs are reused)", flush=True)


def run_suite(name: str, args: BenchArgs, command: str):
    module = importlib.import_module(f"megatron_grpo.bench.{name}")
    result = module.run(args, command)
    result.print()
    result.write_json(os.path.join(args.out, name))
    return result


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:  # everything after -- goes to every training run of the suite
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = parser().parse_args(argv, namespace=BenchArgs())
    args.extra = extra
    args.out = os.path.abspath(args.out)
    command = command_line(argv + (["--", *extra] if extra else []))
    ensure_data(args.data_path)
    names = SUITES if args.suite == "all" else (args.suite,)
    results = []
    if args.only:
        if args.suite == "all":
            print("error: --only selects contenders of one suite, not of all", file=sys.stderr)
            return 2
        try:
            train_only(args.suite, args)
        except BenchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        for name in names:
            results.append(run_suite(name, args, command if args.suite != "all"
                                     else command.replace(" all", f" {name}", 1)))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.suite == "all" or args.update_docs:
        from megatron_grpo.bench.report import update_docs

        update_docs(args.docs, results)
        print(f"\nregenerated the bench section(s) of {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
