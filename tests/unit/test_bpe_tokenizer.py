"""The byte-level BPE tokenizer trained offline with HF ``tokenizers`` (megatron_grpo.data.bpe,
launch/train_tokenizer.py) and the shipped example launch/tokenizers/stdlib-bpe-4k."""

import json
import os
import subprocess
import sys
import sysconfig

import pytest

from megatron_grpo.data.bpe import train_bpe
from megatron_grpo.data.tokenizer import HFTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = os.path.join(REPO, "launch", "tokenizers", "stdlib-bpe-4k")


def _stdlib_text(*names):
    lib = sysconfig.get_paths()["stdlib"]
    return [open(os.path.join(lib, n), encoding="utf-8").read() for n in names]


def test_training_is_deterministic_and_reaches_the_vocabulary(tmp_path):
    docs = _stdlib_text("textwrap.py", "difflib.py", "shlex.py")
    assert train_bpe(docs, 600, str(tmp_path / "a")) == 600
    assert train_bpe(docs, 600, str(tmp_path / "b")) == 600
    a = json.load(open(tmp_path / "a" / "tokenizer.json"))
    b = json.load(open(tmp_path / "b" / "tokenizer.json"))
    assert a["model"]["vocab"] == b["model"]["vocab"] and a["model"]["merges"] == b["model"]["merges"]
    tok = HFTokenizer(str(tmp_path / "a"))
    assert (tok.eod, tok.pad, tok.vocab_size) == (0, 1, 600)  # pad != eod: no synthetic pad id


def test_too_small_a_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--vocab-size 100: a byte-level BPE needs at least 258"):
        train_bpe(["abc"], 100, str(tmp_path / "t"))


def test_the_shipped_tokenizer_round_trips_and_compresses():
    tok = HFTokenizer(SHIPPED)
    assert (tok.eod, tok.pad, tok.vocab_size) == (0, 1, 4096)
    for text in _stdlib_text("argparse.py") + ["naïve café ✓ 日本語\n\ttabs  and  spaces"]:
        ids = tok.tokenize(text)
        assert tok.detokenize(ids) == text
        assert max(ids) < 4096
    # BPE earns its place: 0.28 tokens per byte measured on textwrap.py
    text = _stdlib_text("textwrap.py")[0]
    assert len(tok.tokenize(text)) < 0.35 * len(text.encode())


def test_train_tokenizer_script(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("\n\n".join(_stdlib_text("textwrap.py")))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "train_tokenizer.py"), "--input",
                           str(src), "--vocab-size", "400", "--output", str(tmp_path / "tok")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "byte-level BPE, vocabulary 400" in proc.stdout
    assert HFTokenizer(str(tmp_path / "tok")).vocab_size == 400
