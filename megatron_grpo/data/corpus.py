"""The default training corpus: the Python standard library of the running interpreter.

Why this corpus: it is present OFFLINE on every machine that can run this package (no download,
no licence question: PSF-2.0), it is real text of useful size (~12 MB of code for CPython 3.11,
tests excluded) and the byte tokenizer needs nothing else. Documents are whole files in sorted
path order; :func:`~megatron_grpo.data.preprocess.write_indexed_dataset` shuffles them with a
seed, so the train/valid split does not follow package boundaries.
"""

from __future__ import annotations

import os
import platform
import sysconfig
import time
from typing import Any, Dict, List, Optional

from megatron_grpo.data.preprocess import (
    describe,
    read_meta,
    write_indexed_dataset,
)
from megatron_grpo.data.tokenizer import ByteTokenizer

DEFAULT_CORPUS_INFO: Dict[str, str] = {
    "name": "python-stdlib",
    "source": "CPython standard library of the running interpreter (sysconfig 'stdlib' path), .py files",
    "licence": "PSF-2.0",
    "description": (
        "One document per .py file of the standard library, excluding site-packages/"
        "dist-packages, test folders (test, tests, idle_test) and files over 1 MB; "
        "byte tokenizer (UTF-8 bytes, eod=256)."
    ),
}
"""Provenance of the default corpus, recorded in its ``.meta.json`` and shown in docs."""

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
"""Folder names never descended into: installed packages are not the stdlib; tests are
excluded as in the probe (large generated data files and deliberately malformed code)."""

MAX_FILE_BYTES = 1_000_000
"""Larger files are skipped (generated tables, not representative text)."""


def stdlib_root() -> str:
    """The standard library folder of the running interpreter (the base install inside a venv)."""
    return sysconfig.get_paths()["stdlib"]


def default_corpus_files(root: Optional[str] = None) -> List[str]:
    """Sorted paths of the corpus files under ``root`` (default :func:`stdlib_root`)."""
    root = root or stdlib_root()
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"standard library folder {root!r} (sysconfig 'stdlib') does not exist; "
            f"pass your own text with --input instead of --default-corpus"
        )
    files: List[str] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        for name in names:
            path = os.path.join(folder, name)
            if name.endswith(".py") and 0 < os.path.getsize(path) <= MAX_FILE_BYTES:
                files.append(path)
    return sorted(files)


def default_corpus_documents(root: Optional[str] = None) -> List[str]:
    """The corpus as a list of documents (one per file, sorted by path).

    Read with ``errors='replace'``: the corpus is whatever the interpreter ships, and one
    odd byte should not stop preprocessing (every CPython 3.11 stdlib file is valid UTF-8).
    """
    docs = []
    for path in default_corpus_files(root):
        with open(path, encoding="utf-8", errors="replace") as fh:
            docs.append(fh.read())
    return docs


def build_default_dataset(prefix: str, seed: int = 1234, verbose: bool = True,
                          tokenizer=None) -> Dict[str, Any]:
    """Build the default corpus at ``prefix`` with ``tokenizer`` (default: the byte tokenizer;
    e.g. the shipped BPE, launch/tokenizers/stdlib-bpe-4k); returns its meta dict.

    Skipped when ``prefix`` already holds a complete, verified build of this corpus (meta
    present, ``.idx`` sha256 and ``.bin`` size matching). A different dataset at ``prefix`` is an
    error rather than being overwritten. Call it on one rank and barrier before others read.
    """
    try:
        meta = read_meta(prefix, verify=True)
    except (FileNotFoundError, ValueError):
        meta = None  # missing, partial or stale: rebuild
    if meta is not None:
        if meta.get("corpus", {}).get("name") != DEFAULT_CORPUS_INFO["name"]:
            raise ValueError(
                f"{prefix}.meta.json describes another dataset (corpus "
                f"{meta.get('corpus', {}).get('name')!r}, sources {meta.get('sources')}); choose "
                f"another --output-prefix for the default corpus or delete {prefix}.*"
            )
        from megatron_grpo.data.tokenizer import tokenizer_spec_dict

        if meta.get("seed") == seed and meta.get("tokenizer") == tokenizer_spec_dict(tokenizer or ByteTokenizer()):
            if verbose:
                print(f"default corpus already built at {prefix}: {describe(meta)}")
            return meta

    t0 = time.time()
    root = stdlib_root()
    docs = default_corpus_documents(root)
    corpus = dict(DEFAULT_CORPUS_INFO, python=platform.python_version(), num_files=len(docs))
    meta = write_indexed_dataset(docs, prefix, tokenizer or ByteTokenizer(), seed=seed, sources=[root],
                                 extra_meta={"corpus": corpus})
    if verbose:
        print(f"built default corpus ({corpus['name']}, Python {corpus['python']}) at {prefix}: "
              f"{describe(meta)} in {time.time() - t0:.1f} s")
    return meta
