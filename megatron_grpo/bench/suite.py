"""What every benchmark suite returns: a table, notes, plots and the raw figures, written as
JSON beside the runs and rendered as a markdown section for docs/benchmarks.md."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from typing import Dict, List, Optional


@dataclasses.dataclass
class SuiteResult:
    """The outcome of one suite (comm, quality, compute, memory, slowlink)."""

    suite: str
    """Suite name, also the docs section it regenerates."""
    title: str
    """Heading of the docs section."""
    command: str
    """The exact command that produced it (rerun it to reproduce)."""
    header: List[str]
    """Column names of the table."""
    rows: List[List[str]] = dataclasses.field(default_factory=list)
    """Table rows, already formatted."""
    notes: List[str] = dataclasses.field(default_factory=list)
    """Lines under the table: settings, goals met or missed, skipped contenders and why."""
    plots: Dict[str, str] = dataclasses.field(default_factory=dict)
    """Caption -> PNG path."""
    data: Dict = dataclasses.field(default_factory=dict)
    """Raw figures (summaries, comparisons) for the JSON file."""
    skipped: Optional[str] = None
    """Set when the whole suite could not run here, with the reason."""

    def print(self) -> None:
        print(f"\n=== bench {self.suite}: {self.title}")
        if self.skipped:
            print(f"SKIPPED: {self.skipped}")
        if self.rows:
            widths = [max(len(str(c)) for c in col) for col in zip(self.header, *self.rows)]
            for row in [self.header, *self.rows]:
                print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
        for note in self.notes:
            print(f"- {note}")
        for caption, path in self.plots.items():
            print(f"plot: {caption}: {path}")
        sys.stdout.flush()

    def write_json(self, out_dir: str) -> str:
        path = os.path.join(out_dir, f"{self.suite}.json")
        os.makedirs(out_dir, exist_ok=True)
        with open(path + ".tmp", "w") as fh:
            json.dump(dataclasses.asdict(self), fh, indent=1, default=str)
        os.replace(path + ".tmp", path)
        return path

    def markdown(self, relative_to: str) -> str:
        """The docs section; plot paths are made relative to ``relative_to`` (the docs dir)."""
        lines = [f"### {self.title}", "", f"**Command:** `{self.command}`", ""]
        if self.skipped:
            lines += [f"Not run here: {self.skipped}", ""]
        if self.rows:
            lines.append("| " + " | ".join(self.header) + " |")
            lines.append("|" + "---|" * len(self.header))
            lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in self.rows]
            lines.append("")
        lines += [f"- {n}" for n in self.notes]
        if self.notes:
            lines.append("")
        for caption, path in self.plots.items():
            lines += [f"![{caption}]({os.path.relpath(path, relative_to)})", ""]
        return "\n".join(lines)


# Flags that decide where results go, not what is measured: left out of the shown command, so
# docs show the command that reproduces the figures wherever a user writes them.
_PLACEMENT = {"--out": 1, "--docs": 1, "--update-docs": 0}


def command_line(argv: List[str]) -> str:
    shown, i = [], 0
    while i < len(argv):
        if argv[i] == "--":
            shown += argv[i:]
            break
        if argv[i] in _PLACEMENT:
            i += 1 + _PLACEMENT[argv[i]]
            continue
        shown.append(argv[i])
        i += 1
    return "python -m megatron_grpo.bench " + " ".join(shlex.quote(a) for a in shown)
