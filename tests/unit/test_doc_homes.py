"""Each figure has one home in the docs: docs/results.md holds today's figures, docs/benchmarks.md
says how each suite runs and links there, dated studies live in docs/studies/. Two headings
with the same text read as two homes of one thing (and their anchors get -1 suffixes nobody
links right); a table row carrying numbers in both results.md and benchmarks.md is a figure
that will drift apart. Headings are for users: no issue numbers in them."""

import glob
import os
import re

from test_doc_links import FENCE, REPO

HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
ISSUE = re.compile(r"\(issues? \d+", re.I)
RULE = re.compile(r"^\|[-| :]+\|$")


def _user_docs():
    return sorted(glob.glob(os.path.join(REPO, "docs", "*.md")) +
                  glob.glob(os.path.join(REPO, "docs", "studies", "*.md")))


def headings(path):
    return [h.strip() for h in HEADING.findall(FENCE.sub("", open(path).read()))]


def repeated_headings(paths):
    seen, out = {}, []
    for path in paths:
        for h in headings(path):
            key = h.lower()
            if key in seen:
                out.append(f"{h!r}: {os.path.relpath(seen[key], REPO)} and {os.path.relpath(path, REPO)}")
            else:
                seen[key] = path
    return out


def figure_rows(path):
    rows = set()
    for line in FENCE.sub("", open(path).read()).splitlines():
        line = line.strip()
        if line.startswith("|") and not RULE.match(line) and re.search(r"\d", line):
            rows.add(line)
    return rows


def test_no_heading_repeats_across_the_docs():
    assert repeated_headings(_user_docs()) == []


def test_no_heading_names_an_issue():
    found = [f"{os.path.relpath(p, REPO)}: {h}" for p in _user_docs() for h in headings(p) if ISSUE.search(h)]
    assert found == []


def test_no_figure_table_row_is_in_both_results_and_benchmarks():
    results, benchmarks = (os.path.join(REPO, "docs", n) for n in ("results.md", "benchmarks.md"))
    assert sorted(figure_rows(results) & figure_rows(benchmarks)) == []


def test_the_checks_say_bad_on_a_bad_case(tmp_path):
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text("# Results\n\n| run | loss |\n|---|---|\n| grpo | 2.7485 |\n\n## Memory (issue 10)\n")
    b.write_text("# Other\n\n## results\n\n| run | loss |\n|---|---|\n| grpo | 2.7485 |\n")
    assert repeated_headings([str(a), str(b)]) == [f"'results': {os.path.relpath(a, REPO)} and "
                                                    f"{os.path.relpath(b, REPO)}"]
    assert [h for h in headings(str(a)) if ISSUE.search(h)] == ["Memory (issue 10)"]
    assert figure_rows(str(a)) & figure_rows(str(b)) == {"| grpo | 2.7485 |"}
