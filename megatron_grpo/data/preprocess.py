"""Turn text files / folders / JSONL into a megatron-core indexed dataset ``PREFIX.bin/.idx``.

Layout written for a prefix ``P``:

* ``P.bin`` / ``P.idx`` - megatron-core's ``IndexedDatasetBuilder`` format, one sequence per
  document (``add_item`` + ``end_document``), each document's tokens followed by ``eod``;
* ``P.meta.json`` - what was written (tokenizer, counts, sources, sha256 of ``P.idx``). It is
  written last, so its presence with a matching sha256 means the pair is complete.

Why documents are shuffled before writing: megatron's train/valid/test split takes contiguous
ranges of documents in file order, so an unshuffled corpus (e.g. files in sorted order) would
put e.g. all of one package or all tiny ``__init__.py`` files into validation, or leave it empty.

Why writing is atomic: the files are written under temporary names in the same directory and
moved into place with ``os.replace``; the old ``.meta.json`` and ``.idx`` are removed first and
the new ``.idx`` is moved in after the new ``.bin``, so at no point does a ``.bin``/``.idx``
pair under the final names disagree, and a crash leaves no ``.meta.json`` (readers then ask for
a rebuild instead of training on a truncated file).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_grpo.data.tokenizer import Tokenizer, build_tokenizer, tokenizer_spec_dict

TEXT_EXTENSIONS = (".txt", ".md", ".rst", ".py")
"""File types picked up when a folder is given (any file given explicitly is read as text)."""

JSONL_EXTENSION = ".jsonl"
"""One JSON object per line with a string field ``text``; one document per line."""

DEFAULT_DOC_CHARS = 4096
"""Plain text longer than this is cut at blank lines into documents of at most about this size."""

META_FORMAT = 1
"""Version of the ``.meta.json`` layout; bump when fields change meaning."""

_REBUILD_HINT = "run `python launch/preprocess_data.py --input PATH... --output-prefix {prefix}` " \
                "(or `--default-corpus --output-prefix {prefix}`)"


def dataset_paths(prefix: str) -> Tuple[str, str, str]:
    """(``PREFIX.bin``, ``PREFIX.idx``, ``PREFIX.meta.json``)."""
    return prefix + ".bin", prefix + ".idx", prefix + ".meta.json"


def token_dtype(vocab_size: int) -> type:
    """uint16 halves the file size when every id fits, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's contents."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------- reading inputs

def split_text(text: str, doc_chars: Optional[int] = DEFAULT_DOC_CHARS) -> List[str]:
    """Cut ``text`` into documents of at most about ``doc_chars`` characters.

    Cuts only at blank lines (paragraphs are kept whole and re-joined with one blank line);
    a paragraph longer than ``doc_chars`` is cut at line ends; a single longer line stays whole.
    Text no longer than ``doc_chars`` (or ``doc_chars`` None/0) is returned unchanged, as one
    document. Whitespace-only pieces are dropped.
    """
    if not doc_chars or len(text) <= doc_chars:
        return [text] if text.strip() else []
    pieces: List[str] = []
    for para in re.split(r"\n[ \t\r\f\v]*\n", text):
        if len(para) <= doc_chars:
            pieces.append(para)
            continue
        chunk = ""
        for line in para.splitlines(keepends=True):
            if chunk and len(chunk) + len(line) > doc_chars:
                pieces.append(chunk)
                chunk = ""
            chunk += line
        pieces.append(chunk)
    docs: List[str] = []
    group: List[str] = []
    size = 0
    for piece in pieces:
        if not piece.strip():
            continue
        if group and size + 2 + len(piece) > doc_chars:
            docs.append("\n\n".join(group))
            group, size = [], 0
        size += len(piece) + (2 if group else 0)
        group.append(piece)
    if group:
        docs.append("\n\n".join(group))
    return docs


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: not valid UTF-8 (byte {err.start}); convert it to UTF-8 or leave it out "
            f"of --input"
        ) from None


def read_jsonl(path: str) -> Iterator[str]:
    """The ``text`` of each line of a JSONL file; blank lines are skipped.

    Any other malformed line is an error naming the file and the 1-based line number, because
    silently dropping records would change the corpus without anyone noticing.
    """
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{lineno}: each line must be a JSON object with a string field "
                    f"'text'; got {type(text).__name__ if isinstance(record, dict) else type(record).__name__}"
                )
            yield text


def list_input_files(inputs: Sequence[str]) -> List[str]:
    """Files to read, in a deterministic order: inputs as given, folders walked sorted.

    Folders contribute files ending in ``TEXT_EXTENSIONS`` or ``.jsonl``; hidden folders
    (``.git``, ``.venv``...) and ``__pycache__`` are skipped. A file given explicitly is always
    read, whatever its extension.
    """
    files: List[str] = []
    for item in inputs:
        if not os.path.exists(item):
            raise FileNotFoundError(f"input path {item!r} does not exist (check --input)")
        if os.path.isfile(item):
            files.append(item)
            continue
        for root, dirs, names in os.walk(item):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            for name in sorted(names):
                if name.endswith(TEXT_EXTENSIONS + (JSONL_EXTENSION,)):
                    files.append(os.path.join(root, name))
    return files


def collect_documents(inputs: Sequence[str], doc_chars: Optional[int] = DEFAULT_DOC_CHARS) -> List[str]:
    """All documents of ``inputs`` in input order (JSONL: one per line; text: :func:`split_text`)."""
    docs: List[str] = []
    for path in list_input_files(inputs):
        if path.endswith(JSONL_EXTENSION):
            docs.extend(read_jsonl(path))
        else:
            docs.extend(split_text(_read_text(path), doc_chars))
    return docs


# ------------------------------------------------------------------------------------------ writing

def _fsync(path: str) -> None:
    # Data must be on disk before the rename makes it visible, or a power loss could leave a
    # complete-looking name with missing contents.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _write_json_atomic(path: str, data: Dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise


def write_indexed_dataset(
    documents: Sequence[str],
    output_prefix: str,
    tokenizer: Tokenizer,
    seed: int = 1234,
    sources: Sequence[str] = (),
    extra_meta: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Shuffle ``documents`` with ``seed`` and write them as ``output_prefix``.bin/.idx/.meta.json.

    Whitespace-only documents are skipped. Returns the meta dict that was written. Output is a
    pure function of (documents, tokenizer, seed), so two processes building the same prefix
    write identical files.
    """
    # Imported here: megatron-core's package import is slow and tokenizers/meta readers don't need it.
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if output_prefix.endswith(("/", os.sep)) or os.path.isdir(output_prefix):
        raise ValueError(
            f"--output-prefix {output_prefix!r} is a folder; give a file prefix such as "
            f"{os.path.join(output_prefix, 'corpus')!r} (PREFIX.bin/.idx are written)"
        )
    docs = [d for d in documents if d.strip()]
    if not docs:
        raise ValueError(f"no non-empty documents to write for {output_prefix!r} (sources: {list(sources)})")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)

    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    bin_path, idx_path, meta_path = dataset_paths(output_prefix)
    tag = f"{os.getpid()}.tmp"  # per-process temporaries: concurrent writers never share a file
    bin_tmp, idx_tmp = f"{bin_path}.{tag}", f"{idx_path}.{tag}"
    dtype = token_dtype(tokenizer.vocab_size)
    num_tokens = 0
    builder = None
    try:
        builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
        for i in order:
            ids = tokenizer.tokenize(docs[i])
            arr = np.empty(len(ids) + 1, dtype=np.int64)
            arr[:-1] = ids
            arr[-1] = tokenizer.eod
            builder.add_item(torch.from_numpy(arr))
            builder.end_document()
            num_tokens += arr.size
        builder.finalize(idx_tmp)
        _fsync(bin_tmp)
        _fsync(idx_tmp)
        meta: Dict[str, Any] = {
            "format": META_FORMAT,
            "tokenizer": tokenizer_spec_dict(tokenizer),
            "vocab_size": tokenizer.vocab_size,
            "eod": tokenizer.eod,
            "pad": tokenizer.pad,
            "dtype": np.dtype(dtype).name,
            "num_docs": len(docs),
            "num_tokens": num_tokens,
            "bin_bytes": os.path.getsize(bin_tmp),
            "seed": seed,
            "sources": [os.path.abspath(s) for s in sources],
            "idx_sha256": sha256_file(idx_tmp),
        }
        meta.update(extra_meta or {})
        # Commit order (see module docstring): meta and idx away, bin in, idx in, meta last.
        _remove_quietly(meta_path)
        _remove_quietly(idx_path)
        os.replace(bin_tmp, bin_path)
        os.replace(idx_tmp, idx_path)
        _write_json_atomic(meta_path, meta)
    except BaseException:
        if builder is not None and not builder.data_file.closed:
            builder.data_file.close()
        _remove_quietly(bin_tmp)
        _remove_quietly(idx_tmp)
        raise
    return meta


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer: Optional[Tokenizer] = None,
    seed: int = 1234,
    doc_chars: Optional[int] = DEFAULT_DOC_CHARS,
) -> Dict[str, Any]:
    """Read ``inputs`` (files, folders, .jsonl), shuffle the documents, write ``output_prefix``.

    ``tokenizer`` defaults to the byte tokenizer. Returns the written meta dict.
    """
    if not inputs:
        raise ValueError("no inputs given: pass at least one file or folder with --input")
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(None)
    docs = [d for d in collect_documents(inputs, doc_chars) if d.strip()]
    if not docs:
        raise ValueError(
            f"no documents found in {list(inputs)}: folders are searched for "
            f"{', '.join(TEXT_EXTENSIONS + (JSONL_EXTENSION,))} files; empty files and blank "
            f"JSONL texts are skipped"
        )
    return write_indexed_dataset(docs, output_prefix, tokenizer, seed=seed, sources=inputs,
                                 extra_meta={"doc_chars": doc_chars})


# ------------------------------------------------------------------------------------------ reading

_REQUIRED_META = ("format", "tokenizer", "vocab_size", "eod", "pad", "num_docs", "num_tokens",
                  "idx_sha256")


def read_meta(prefix: str, verify: bool = False) -> Dict[str, Any]:
    """Load ``PREFIX.meta.json`` after checking that ``.bin``, ``.idx`` and ``.meta.json`` exist.

    With ``verify`` also hash ``.idx`` and check the ``.bin`` size against the meta, which
    catches a pair replaced or truncated behind the meta's back. Errors name the file and say
    how to rebuild.
    """
    bin_path, idx_path, meta_path = dataset_paths(prefix)
    hint = _REBUILD_HINT.format(prefix=prefix)
    for path in (bin_path, idx_path, meta_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: dataset {prefix!r} is not (completely) built; {hint}")
    try:
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_path}: not valid JSON ({err.msg}); {hint}") from None
    missing = [k for k in _REQUIRED_META if k not in meta] if isinstance(meta, dict) else list(_REQUIRED_META)
    if missing:
        raise ValueError(f"{meta_path}: missing fields {missing}; {hint}")
    if verify:
        if sha256_file(idx_path) != meta["idx_sha256"]:
            raise ValueError(f"{idx_path} does not match the sha256 recorded in {meta_path}; {hint}")
        itemsize = np.dtype(meta.get("dtype", "uint16")).itemsize
        expected = int(meta["num_tokens"]) * itemsize
        if os.path.getsize(bin_path) != expected:
            raise ValueError(
                f"{bin_path} has {os.path.getsize(bin_path)} bytes but {meta_path} records "
                f"{meta['num_tokens']} tokens ({expected} bytes); {hint}"
            )
    return meta


def describe(meta: Dict[str, Any]) -> str:
    """One line for logs: documents, tokens, size on disk."""
    mb = meta.get("bin_bytes", 0) / 1e6
    return f"{meta['num_docs']} documents, {meta['num_tokens']} tokens, {mb:.1f} MB (.bin)"

