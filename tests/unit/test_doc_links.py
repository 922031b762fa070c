"""Every relative link in the docs resolves: the file (or folder, or image) exists, and a
``#anchor`` names a heading of the target, slugged as GitHub does. Docs move (the
studies once moved out of docs/benchmarks.md); a link left behind must fail here, not for a reader."""

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _docs():
    files = [os.path.join(REPO, "README.md"), os.path.join(REPO, "tests", "README.md")]
    return files + sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))


def slugs(text: str) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-', repeats -1, -2."""
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: str):
    text = FENCE.sub("", open(path).read())
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            out.append(f"{os.path.relpath(path, REPO)}: {target} (no such file)")
        elif anchor and dest.endswith(".md") and anchor not in slugs(open(dest).read()):
            out.append(f"{os.path.relpath(path, REPO)}: {target} (no such heading)")
    return out


def test_every_relative_link_resolves():
    assert [b for path in _docs() for b in broken_links(path)] == []


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n## Bytes vs quality (tiny.yaml)\n## Bytes vs quality (tiny.yaml)\n")
    (tmp_path / "b.md").write_text("[ok](a.md#bytes-vs-quality-tinyyaml-1) [gone](c.md) "
                                   "[no heading](a.md#bytes-vs-quality-tinyyaml-2) [self](#nope)\n"
                                   "```\n[in a fence](ignored.md)\n```\n")
    assert broken_links(str(tmp_path / "b.md")) == [
        f"{os.path.relpath(str(tmp_path / 'b.md'), REPO)}: c.md (no such file)",
        f"{os.path.relpath(str(tmp_path / 'b.md'), REPO)}: a.md#bytes-vs-quality-tinyyaml-2 (no such heading)",
        f"{os.path.relpath(str(tmp_path / 'b.md'), REPO)}: #nope (no such heading)",
    ]
