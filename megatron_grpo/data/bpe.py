"""Train a byte-level BPE tokenizer offline with the Hugging Face ``tokenizers`` library.

The result is a transformers fast-tokenizer directory (``tokenizer.json`` and its config) that
``launch/preprocess_data.py --tokenizer-model DIR`` uses and ``checkpoints/grpo_ckpt.py to-hf``
copies next to the converted model. ``<|endoftext|>`` (id 0) ends documents and ``<|pad|>``
(id 1) pads, so the pad id never equals the end-of-document id (megatron's GPTDataset masks
labels equal to pad). Training is deterministic for the same documents and settings.
"""

from __future__ import annotations

import os
from typing import Iterable

EOD, PAD = "<|endoftext|>", "<|pad|>"


def train_bpe(docs: Iterable[str], vocab_size: int, out_dir: str, min_frequency: int = 2) -> int:
    """Train on ``docs`` and save to ``out_dir``; returns the vocabulary size reached (smaller
    than asked when the text has fewer merges to give)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258:
        raise ValueError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 258 "
                         f"(256 bytes and the two special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOD, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD, bos_token=EOD, pad_token=PAD)
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return len(fast)
