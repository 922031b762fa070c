"""GPT train/valid datasets from indexed-dataset prefixes, and the micro-batch reader.

:func:`build_gpt_datasets` is a thin, checked front end to megatron-core's
``BlendedMegatronDatasetBuilder(GPTDataset, ...)``. What it adds, and why:

* damaged files named before megatron maps them (megatron_grpo.data.integrity: a truncated
  ``.bin`` or ``.idx``, or a pair that does not match its ``.meta.json``);
* clear errors before megatron runs. megatron only asserts, and a split that receives no
  document makes ``GPTDataset._get_num_epochs`` loop forever (it adds empty epochs until it has
  enough tokens), so every split that gets a share is checked to hold >= seq_length + 1 tokens;
* a cache folder keyed by the data's ``.idx`` sha256: megatron names cached sample indices by a
  hash of (path, split, seed, seq_length, tokenizer) but not of the file contents, so rebuilding
  a prefix in place would otherwise silently reuse indices into the old file;
* multi-rank safety comes from megatron itself: with ``torch.distributed`` initialized, the
  builder constructs each dataset on rank 0 first (writing the cache), calls ``barrier()``, and
  only then lets the other ranks construct theirs (cache hits). Every rank must call this
  function; the cache folder must be visible to all ranks (shared filesystem).

GPTDatasetConfig choices: ``reset_position_ids / reset_attention_mask / eod_mask_loss`` are
required (megatron asserts they are not None) and set False: documents are packed and attend
across eod like Megatron-LM's default. ``create_attention_mask`` defaults to True in 0.16.1 and
would return a [1, seq, seq] bool mask with every sample; it is set False because the trainer
builds the causal mask itself.

:class:`MicroBatchIterator` reproduces Megatron-LM's ``MegatronPretrainingSampler``.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_grpo.data.integrity import check_dataset_files
from megatron_grpo.data.preprocess import dataset_paths, read_meta, sha256_file
from megatron_grpo.data.tokenizer import Tokenizer, tokenizer_from_meta

SPLIT_NAMES = ("train", "valid", "test")


def parse_data_prefix(data_prefix: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """``["P"]`` / ``["P1", "P2"]`` -> prefixes, no weights; ``["W1", "P1", "W2", "P2"]`` -> weighted.

    Megatron-LM style: if the first entry is a number, entries alternate weight, prefix.
    A single string with spaces (from a config file) is split on whitespace.
    """
    if isinstance(data_prefix, str):
        data_prefix = [data_prefix]
    items = [tok for entry in data_prefix for tok in str(entry).split()]
    if not items:
        raise ValueError("data_prefix is empty: give at least one PREFIX written by launch/preprocess_data.py")

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if not is_number(items[0]):
        numbers = [s for s in items if is_number(s)]
        if numbers:
            raise ValueError(f"data_prefix {items}: mixes weights {numbers} with unweighted prefixes; "
                             f"give either 'P1 P2 ...' or 'W1 P1 W2 P2 ...'")
        return items, None
    if len(items) % 2:
        raise ValueError(f"data_prefix {items}: weighted form needs pairs 'W1 P1 W2 P2 ...', got an odd count")
    weights, prefixes = items[0::2], items[1::2]
    bad = [w for w in weights if not is_number(w)] + [p for p in prefixes if is_number(p)]
    if bad:
        raise ValueError(f"data_prefix {items}: expected alternating weight, prefix; {bad} out of place")
    values = [float(w) for w in weights]
    if any(w < 0 for w in values) or sum(values) <= 0:
        raise ValueError(f"data_prefix {items}: weights must be >= 0 with a positive sum")
    return prefixes, values


def normalize_split(split: str) -> str:
    """Validate ``"969,30,1"``-style splits (1 to 3 non-negative numbers, ',' or '/' separated)."""
    parts = [p.strip() for p in re.split(r"[,/]", str(split))]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"split {split!r}: expected up to three non-negative numbers 'train,valid,test' "
                         f"with a positive sum, e.g. '98,2,0'")
    values += [0.0] * (3 - len(values))
    return ",".join(f"{v:g}" for v in values)


def split_document_ranges(split: str, num_docs: int) -> List[Optional[Tuple[int, int]]]:
    """The [begin, end) document range megatron gives each split (None: split has no share)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(normalize_split(split)))
    # Same rounding as BlendedMegatronDatasetBuilder._build_megatron_dataset_splits.
    return [None if m is None else (int(round(m[0] * num_docs)), int(round(m[1] * num_docs))) for m in matrix]


def _check_splits(prefix: str, split: str, seq_length: int, valid_samples: int) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    # Copy: sequence_lengths is a view into the dataset's mmap, which closes (and segfaults
    # readers) once the temporary IndexedDataset is garbage collected.
    dataset = IndexedDataset(prefix)
    lengths = dataset.sequence_lengths.copy()
    del dataset
    ranges = split_document_ranges(split, len(lengths))
    if ranges[0] is None:
        raise ValueError(f"split {split!r} gives the train split no share; make its first number positive")
    if valid_samples > 0 and ranges[1] is None:
        raise ValueError(f"split {split!r} gives the valid split no share but {valid_samples} validation "
                         f"samples were requested; give it a share (e.g. '98,2,0') or request 0")
    for name, rng in zip(SPLIT_NAMES, ranges):
        if rng is None:
            continue
        beg, end = rng
        tokens = int(lengths[beg:end].sum())
        if tokens < seq_length + 1:
            fix = "set its share to 0" if name == "test" else "give it a larger share"
            raise ValueError(
                f"the {name} split of {prefix} (documents {beg}..{end} of {len(lengths)}: "
                f"{end - beg} documents, {tokens} tokens) with split {split!r} is smaller than one "
                f"sample of seq_length + 1 = {seq_length + 1} tokens; {fix} in the split, lower "
                f"seq_length, or add data"
            )


def _read_meta_if_any(prefix: str) -> Optional[Dict[str, Any]]:
    bin_path, idx_path, meta_path = dataset_paths(prefix)
    for path in (bin_path, idx_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: build dataset {prefix!r} with "
                                    f"`python launch/preprocess_data.py --input ... --output-prefix {prefix}`")
    meta = read_meta(prefix) if os.path.isfile(meta_path) else None  # None: e.g. Megatron-LM's tools
    # Truncated or mismatched files are named now, not when a sample reaches the damage.
    check_dataset_files(prefix, meta)
    return meta


def _content_key(prefixes: Sequence[str], metas: Sequence[Optional[Dict[str, Any]]]) -> str:
    h = hashlib.sha256()
    for prefix, meta in zip(prefixes, metas):
        digest = meta["idx_sha256"] if meta and "idx_sha256" in meta else sha256_file(dataset_paths(prefix)[1])
        h.update(digest.encode())
    return h.hexdigest()[:16]


def build_gpt_datasets(
    data_prefix: Sequence[str],
    split: str,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int,
    cache_dir: Optional[str] = None,
    tokenizer: Optional[Tokenizer] = None,
) -> Tuple[Any, Optional[Any]]:
    """(train, valid) GPT datasets of ``train_samples`` / ``valid_samples`` samples of ``seq_length``.

    ``data_prefix``: prefixes, or Megatron-style ``"W1 P1 W2 P2"`` for a weighted blend.
    ``cache_dir`` (default ``<first prefix>_cache``) receives megatron's index caches under a
    sub-folder keyed by the data contents. ``tokenizer`` defaults to the one recorded in the
    first prefix's ``.meta.json``; if given, it must match every recorded one. ``valid`` is None
    only when the split gives validation no share and ``valid_samples`` is 0.
    Call on every rank when ``torch.distributed`` is initialized (see module docstring).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    for name, value, low in (("seq_length", seq_length, 1), ("train_samples", train_samples, 1),
                             ("valid_samples", valid_samples, 0)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    prefixes, weights = parse_data_prefix(data_prefix)
    split = normalize_split(split)
    blended = len(prefixes) > 1 or weights is not None
    if blended and not torch.distributed.is_initialized():
        # megatron's BlendedDataset calls torch.distributed.get_rank() unguarded.
        raise RuntimeError(f"data_prefix {list(data_prefix)} is a blend, which needs torch.distributed "
                           f"initialized (a 1-rank gloo group is enough for a single process)")

    metas = [_read_meta_if_any(p) for p in prefixes]
    if tokenizer is None:
        if metas[0] is None:
            raise ValueError(f"{prefixes[0]}.meta.json is missing, so the tokenizer is unknown: "
                             f"pass tokenizer=")
        tokenizer = tokenizer_from_meta(metas[0], where=dataset_paths(prefixes[0])[2])
    for prefix, meta in zip(prefixes, metas):
        if meta is None:
            continue
        for field in ("vocab_size", "eod"):
            if meta.get(field) != getattr(tokenizer, field):
                raise ValueError(f"{dataset_paths(prefix)[2]}: {field} {meta.get(field)} differs from the "
                                 f"tokenizer's {getattr(tokenizer, field)}; use the tokenizer the data "
                                 f"was preprocessed with, or re-run launch/preprocess_data.py")
    for prefix in prefixes:
        _check_splits(prefix, split, seq_length, valid_samples)

    root = cache_dir if cache_dir is not None else prefixes[0] + "_cache"
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        path_to_cache=os.path.join(root, "data-" + _content_key(prefixes, metas)),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, valid, _test = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, 0], lambda: True, config
    ).build()
    if train is None or len(train) == 0:
        raise ValueError(f"the train split of {prefixes} came out empty with split {split!r}; "
                         f"give train a larger share or add data")
    if valid is not None and len(valid) == 0:
        raise ValueError(f"the valid split of {prefixes} came out empty with split {split!r}; "
                         f"give valid a larger share, lower seq_length, or add data")
    return train, valid


BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class MicroBatchIterator:
    """Infinite micro-batch reader with Megatron-LM ``MegatronPretrainingSampler`` order.

    The dataset is read sequentially from global sample ``consumed_samples``. Each micro-step
    takes the next ``micro_batch_size * data_parallel_size`` samples; this rank gets the slice
    ``[rank * mbs, (rank + 1) * mbs)`` of them. Sample number ``k`` (counting all ranks) is
    ``dataset[k % len(dataset)]``, so the reader wraps around instead of stopping (megatron's
    GPTDataset is normally built with at least ``train_samples`` samples, so it rarely wraps).

    Hence the samples read depend only on the global count, not on how a global batch is
    divided: DP=1 with two micro-batches of ``mbs`` reads exactly what DP=2 with one does, and a
    new iterator built with a saved ``consumed_samples`` continues exactly where training stopped.

    Yields dicts of tensors ``tokens``/``labels``/``position_ids`` (int64, [mbs, seq]) and
    ``loss_mask`` (float32, [mbs, seq]).
    """

    def __init__(
        self,
        dataset: Any,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        for name, value, low in (("consumed_samples", consumed_samples, 0),
                                 ("micro_batch_size", micro_batch_size, 1),
                                 ("data_parallel_size", data_parallel_size, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"MicroBatchIterator: {name} must be an integer >= {low}, got {value!r}")
        if not isinstance(data_parallel_rank, int) or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"MicroBatchIterator: data_parallel_rank {data_parallel_rank!r} must be in "
                             f"[0, {data_parallel_size})")
        if dataset is None or len(dataset) == 0:
            raise ValueError("MicroBatchIterator: the dataset is empty (check the split and the data prefix)")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self._consumed = consumed_samples

    @property
    def consumed_samples(self) -> int:
        """Global samples consumed by all data-parallel ranks so far (save this to resume)."""
        return self._consumed

    @property
    def samples_per_step(self) -> int:
        """Global samples one micro-step consumes: ``micro_batch_size * data_parallel_size``."""
        return self.micro_batch_size * self.data_parallel_size

    def next_indices(self) -> List[int]:
        """Dataset indices the next micro-batch of this rank will read."""
        start = self._consumed + self.data_parallel_rank * self.micro_batch_size
        n = len(self.dataset)
        return [(start + j) % n for j in range(self.micro_batch_size)]

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        samples = [self.dataset[i] for i in self.next_indices()]
        batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in BATCH_KEYS}
        for key in ("tokens", "labels", "position_ids"):
            batch[key] = batch[key].long()
        batch["loss_mask"] = batch["loss_mask"].float()
        self._consumed += self.samples_per_step
        return batch
