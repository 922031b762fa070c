"""Damaged ``PREFIX.bin`` / ``PREFIX.idx`` found when the datasets are built, by name.

megatron-core maps both files and trusts them. A ``.bin`` cut short (an interrupted copy, a full
disk) trains until a sample reaches the missing tail, which for the last documents (the
validation split) is the first evaluation, and again after every resume; a truncated ``.idx``
fails with numpy's "buffer is smaller than requested size", naming no file. Both are cheap to
see before anything runs: the ``.idx`` header gives the counts and hence its own size, the
sequence lengths and pointers give the bytes of ``.bin`` they refer to, and our ``.meta.json``
(when there is one) records the documents, tokens and ``.bin`` size that were written.

No hashing: the ``.idx`` sha256 in the meta is for the cache key and ``read_meta(verify=True)``;
at start, reading the header and the lengths/pointers arrays is all the check costs.
"""

from __future__ import annotations

import os
import struct
from typing import Any, Dict, Optional

import numpy as np

from megatron_grpo.data.preprocess import _REBUILD_HINT, dataset_paths

# megatron.core.datasets.indexed_dataset's layout (_IndexWriter.write / _IndexReader, 0.16.1):
# magic, version <Q, dtype code <B, sequence count <Q, document count <Q, then int32 lengths,
# int64 pointers, int64 document indices and, for multimodal data only, int8 modes per sequence.
_MAGIC = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
           7: np.float32, 8: np.uint16}


def _fix(prefix: str) -> str:
    return (f"Rebuild dataset {prefix!r}: {_REBUILD_HINT.format(prefix=prefix)}, or copy the "
            f"files again from where they were built")


def check_dataset_files(prefix: str, meta: Optional[Dict[str, Any]] = None) -> None:
    """Raise ValueError naming the file when ``prefix``.idx or .bin is truncated, does not match
    the other, or (with ``meta``, the prefix's .meta.json) is not the pair that was written."""
    bin_path, idx_path, meta_path = dataset_paths(prefix)
    idx_size, bin_size = os.path.getsize(idx_path), os.path.getsize(bin_path)
    if idx_size < _HEADER_BYTES:
        raise ValueError(f"{idx_path} has {idx_size} bytes, fewer than the {_HEADER_BYTES}-byte header "
                         f"of a megatron index: the file is truncated. {_fix(prefix)}.")
    with open(idx_path, "rb") as fh:
        magic = fh.read(9)
        _version, code, sequences, documents = struct.unpack("<QBQQ", fh.read(_HEADER_BYTES - 9))
    if magic != _MAGIC or code not in _DTYPES:
        raise ValueError(f"{idx_path} does not start with a megatron index header (magic {magic!r}, "
                         f"dtype code {code}): the file is damaged or not an index. {_fix(prefix)}.")
    needed = _HEADER_BYTES + sequences * (4 + 8) + documents * 8
    if idx_size not in (needed, needed + sequences):  # + one mode byte per sequence: multimodal
        what = "truncated" if idx_size < needed else "damaged (longer than its header says)"
        raise ValueError(f"{idx_path} has {idx_size} bytes, but its header describes {sequences} sequences "
                         f"and {documents} document indices ({needed} bytes): the file is {what}. "
                         f"{_fix(prefix)}.")
    dtype = np.dtype(_DTYPES[code])
    if meta is not None:
        _check_against_meta(prefix, meta, dtype, documents - 1)
    index = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(index, dtype=np.int32, count=sequences, offset=_HEADER_BYTES)
    pointers = np.frombuffer(index, dtype=np.int64, count=sequences, offset=_HEADER_BYTES + 4 * sequences)
    tokens = int(lengths.sum(dtype=np.int64))
    # The end of the furthest sequence, whatever the order of the pointers.
    referenced = int((pointers + lengths.astype(np.int64) * dtype.itemsize).max()) if sequences else 0
    del index, lengths, pointers
    if bin_size < referenced:
        raise ValueError(
            f"{bin_path} has {bin_size} bytes, {referenced - bin_size} fewer than the {referenced} that "
            f"its index {idx_path} refers to ({tokens} {dtype.name} tokens in {documents - 1} documents): "
            f"the file is truncated (an interrupted copy, or a full disk while it was written). "
            f"{_fix(prefix)}.")
    if meta is not None:
        written = meta.get("bin_bytes", int(meta["num_tokens"]) * dtype.itemsize)
        if tokens != int(meta["num_tokens"]) or bin_size != written:
            raise ValueError(
                f"{bin_path} has {bin_size} bytes and {idx_path} {tokens} tokens, but {meta_path} records "
                f"{written} bytes and {meta['num_tokens']} tokens: the files are not from one build. "
                f"{_fix(prefix)}.")


def _check_against_meta(prefix: str, meta: Dict[str, Any], dtype: np.dtype, docs: int) -> None:
    _, idx_path, meta_path = dataset_paths(prefix)
    if docs != int(meta["num_docs"]):
        raise ValueError(f"{idx_path} describes {docs} documents, but {meta_path} records "
                         f"{meta['num_docs']}: the files are not from one build. {_fix(prefix)}.")
    if "dtype" in meta and np.dtype(meta["dtype"]) != dtype:
        raise ValueError(f"{idx_path} holds {dtype.name} tokens, but {meta_path} records "
                         f"{meta['dtype']}: the files are not from one build. {_fix(prefix)}.")
