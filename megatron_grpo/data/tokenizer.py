"""Tokenizers for the data pipeline: a dependency-free byte tokenizer and a local Hugging Face one.

megatron-core's ``GPTDataset`` duck-types its tokenizer; it reads exactly these attributes:

* ``vocab_size`` - only to pick a token dtype code for an optional fast path;
* ``eod`` - the end-of-document id (position ids / masks are computed around it);
* ``pad`` - an id that never occurs in the data: positions whose label equals ``pad`` get
  ``loss_mask = 0``. If ``pad == eod`` megatron warns and silently stops masking pads, so the
  two must differ;
* ``unique_identifiers`` - a JSON-serialisable dict that goes into the hash naming the cached
  sample indices, so two tokenizers must never share it.

Both classes here provide those plus ``tokenize(str) -> list[int]`` and ``detokenize(ids) -> str``.
A tokenizer is recorded in a dataset's ``.meta.json`` via :func:`tokenizer_spec_dict` and rebuilt
with :func:`tokenizer_from_meta`, so training can check it matches what preprocessing used.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Optional, Union


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is end-of-document, 257 is padding.

    Needs nothing beyond Python, so every machine can preprocess and train on the same ids.
    ``vocab_size`` counts the pad id (258) so that every id this tokenizer can emit is a valid
    row of an embedding table of ``vocab_size`` rows.
    """

    eod: int = 256
    pad: int = 257
    vocab_size: int = 258

    def __init__(self) -> None:
        self.unique_identifiers: Dict[str, Any] = {
            "class": "ByteTokenizer",
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "pad": self.pad,
        }

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text`` (its UTF-8 bytes); no end-of-document is appended."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special ids (eod, pad) are dropped, broken UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a LOCAL directory (no network access is attempted).

    ``eod`` is the tokenizer's end-of-sequence id. ``pad`` is the tokenizer's own pad id when
    it has one that differs from ``eod``; otherwise (no pad token, or pad == eos as in GPT-2 and
    Llama) a synthetic pad id equal to ``len(tokenizer)`` is appended and ``vocab_size`` becomes
    ``len(tokenizer) + 1``. Appending keeps every real id unchanged and keeps pad inside the
    embedding table, exactly like :class:`ByteTokenizer` does with 257/258.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isdir(self.path):
            raise FileNotFoundError(
                f"tokenizer directory {self.path!r} does not exist: pass a local Hugging Face "
                f"tokenizer directory (with tokenizer.json / tokenizer_config.json), or 'byte'"
            )
        try:
            # Imported lazily: transformers is optional and slow to import.
            import transformers  # noqa: F401
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ImportError(
                f"loading the tokenizer at {self.path!r} needs the 'transformers' package: "
                f"pip install transformers (or use the byte tokenizer)"
            ) from err
        try:
            self._tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except Exception as err:  # transformers raises many types (OSError, ValueError, ...)
            raise ValueError(
                f"could not load a Hugging Face tokenizer from {self.path!r}: {err}"
            ) from err
        # Documents are tokenized whole; silence the "longer than model_max_length" warning,
        # which is about model inputs, not about corpus documents.
        self._tok.model_max_length = int(1e30)

        base = len(self._tok)
        eos = self._tok.eos_token_id
        if eos is None:
            raise ValueError(
                f"tokenizer at {self.path!r} has no eos_token: set 'eos_token' in its "
                f"tokenizer_config.json (it is used as the end-of-document id)"
            )
        self.eod: int = int(eos)
        own_pad = self._tok.pad_token_id
        if own_pad is not None and int(own_pad) != self.eod:
            self.pad: int = int(own_pad)
            self.vocab_size: int = base
        else:
            self.pad = base
            self.vocab_size = base + 1
        self.unique_identifiers: Dict[str, Any] = {
            "class": "HFTokenizer",
            "path": self.path,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "pad": self.pad,
        }

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text`` without special tokens (no BOS/EOS; preprocessing adds eod)."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; the pad id (which may not exist in the HF vocabulary) is dropped."""
        return self._tok.decode([int(i) for i in ids if int(i) != self.pad])

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def build_tokenizer(spec: Optional[str]) -> Tokenizer:
    """``None`` or ``"byte"`` -> :class:`ByteTokenizer`; anything else is a local HF directory."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def tokenizer_spec_dict(tok: Tokenizer) -> Dict[str, Any]:
    """JSON-serialisable description of ``tok`` (stored in ``PREFIX.meta.json``)."""
    if isinstance(tok, ByteTokenizer):
        kind, path = "byte", None
    elif isinstance(tok, HFTokenizer):
        kind, path = "hf", tok.path
    else:
        raise TypeError(f"unknown tokenizer type {type(tok).__name__}: use ByteTokenizer or HFTokenizer")
    return {"type": kind, "path": path, "vocab_size": tok.vocab_size, "eod": tok.eod, "pad": tok.pad}


def tokenizer_from_meta(meta: Dict[str, Any], where: str = "dataset meta") -> Tokenizer:
    """Rebuild the tokenizer a dataset was written with, from its meta dict (see ``read_meta``).

    ``where`` names the meta file in error messages. Raises if the rebuilt tokenizer's ids differ
    from the recorded ones (e.g. the HF directory was replaced since preprocessing): training
    would then read ids it does not understand.
    """
    spec = meta.get("tokenizer")
    if not isinstance(spec, dict) or spec.get("type") not in ("byte", "hf"):
        raise ValueError(f"{where}: field 'tokenizer' must be a dict with type 'byte' or 'hf', got {spec!r}")
    tok = ByteTokenizer() if spec["type"] == "byte" else HFTokenizer(spec.get("path") or "")
    for field in ("vocab_size", "eod", "pad"):
        recorded = spec.get(field)
        if recorded is not None and recorded != getattr(tok, field):
            raise ValueError(
                f"{where}: tokenizer field '{field}' was {recorded} at preprocessing but the "
                f"tokenizer now gives {getattr(tok, field)}; re-run launch/preprocess_data.py "
                f"with the current tokenizer"
            )
    return tok
