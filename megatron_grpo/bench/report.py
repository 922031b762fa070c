"""Regenerate the evidence-suite sections of docs/benchmarks.md from suite results.

Each suite owns the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; a suite
without markers yet gets them appended under the evidence heading. Plots are copied next to the
docs (docs/figures/bench/NAME/) so the markdown shows them from a clone. The file is replaced
atomically: a killed bench leaves the old docs, never half of them.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Iterable

HEADING = "## Evidence suite: `python -m megatron_grpo.bench`"


def _markers(name: str):
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def update_docs(path: str, results: Iterable) -> None:
    docs_dir = os.path.dirname(os.path.abspath(path))
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    for res in results:
        fig_dir = os.path.join(docs_dir, "figures", "bench", res.suite)
        os.makedirs(fig_dir, exist_ok=True)
        res.plots = {cap: _copy(src, fig_dir) for cap, src in res.plots.items()}
        begin, end = _markers(res.suite)
        block = f"{begin}\n{res.markdown(docs_dir)}\n{end}"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        if pattern.search(text):
            text = pattern.sub(lambda _: block, text)
        else:
            if HEADING not in text:
                text = text.rstrip("\n") + f"\n\n{HEADING}\n"
            text = text.rstrip("\n") + f"\n\n{block}\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def _copy(src: str, fig_dir: str) -> str:
    dst = os.path.join(fig_dir, os.path.basename(src))
    if os.path.abspath(src) != os.path.abspath(dst):
        shutil.copyfile(src, dst)
    return dst
