"""Data pipeline: tokenizers, preprocessing to megatron indexed datasets, GPT datasets, batches.

Flow: ``launch/preprocess_data.py`` (:func:`preprocess` or :func:`build_default_dataset`)
writes ``PREFIX.bin/.idx/.meta.json``; training calls :func:`build_gpt_datasets` on every rank
and reads micro-batches with :class:`MicroBatchIterator`.
"""

from megatron_grpo.data.corpus import DEFAULT_CORPUS_INFO, build_default_dataset, default_corpus_documents
from megatron_grpo.data.datasets import MicroBatchIterator, build_gpt_datasets, parse_data_prefix
from megatron_grpo.data.preprocess import preprocess, read_meta, write_indexed_dataset
from megatron_grpo.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
    tokenizer_from_meta,
    tokenizer_spec_dict,
)

__all__ = [
    "DEFAULT_CORPUS_INFO",
    "ByteTokenizer",
    "HFTokenizer",
    "MicroBatchIterator",
    "build_default_dataset",
    "build_gpt_datasets",
    "build_tokenizer",
    "default_corpus_documents",
    "parse_data_prefix",
    "preprocess",
    "read_meta",
    "tokenizer_from_meta",
    "tokenizer_spec_dict",
    "write_indexed_dataset",
]
