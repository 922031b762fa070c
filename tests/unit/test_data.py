"""Data pipeline: tokenizers, preprocessing to indexed datasets, GPT datasets, micro-batches."""

import json
import multiprocessing as mp
import os
import socket
import sys
import warnings

import numpy as np
import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

from megatron.core.datasets import indexed_dataset as megatron_indexed  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

from megatron_grpo.data import (  # noqa: E402
    ByteTokenizer,
    HFTokenizer,
    MicroBatchIterator,
    build_default_dataset,
    build_gpt_datasets,
    build_tokenizer,
    parse_data_prefix,
    preprocess,
    read_meta,
    tokenizer_from_meta,
    tokenizer_spec_dict,
)
from megatron_grpo.data.preprocess import sha256_file, split_text  # noqa: E402

# --------------------------------------------------------------------------------------- helpers


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)


def _read_docs(prefix):
    """All documents of an indexed dataset as lists of ids (copied out of the mmap)."""
    ds = IndexedDataset(prefix)
    docs = [ds[i].tolist() for i in range(len(ds))]
    del ds
    return docs


def _corpus(tmp_path, n_docs=120, words=60):
    """A folder of n_docs small text files with distinct contents; returns (folder, total bytes)."""
    folder = tmp_path / "corpus"
    rng = np.random.default_rng(0)
    vocab = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    total = 0
    for i in range(n_docs):
        text = f"doc {i}: " + " ".join(rng.choice(vocab, size=words)) + "\n"
        _write(str(folder / f"d{i:04d}.txt"), text)
        total += len(text.encode())
    return str(folder), total


# ------------------------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo wörld ✓\nline two\n"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert len(ids) == 27  # 23 characters; é, ö: 2 bytes each; ✓: 3 bytes
    assert tok.detokenize(ids + [tok.eod, tok.pad]) == text
    assert (tok.eod, tok.pad, tok.vocab_size) == (256, 257, 258)
    assert json.loads(json.dumps(tok.unique_identifiers))["class"] == "ByteTokenizer"


def test_build_tokenizer_and_meta_round_trip():
    assert isinstance(build_tokenizer(None), ByteTokenizer)
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    spec = tokenizer_spec_dict(ByteTokenizer())
    assert spec == {"type": "byte", "path": None, "vocab_size": 258, "eod": 256, "pad": 257}
    assert isinstance(tokenizer_from_meta({"tokenizer": spec}), ByteTokenizer)
    with pytest.raises(ValueError, match="x.meta.json: tokenizer field 'eod' was 0"):
        tokenizer_from_meta({"tokenizer": dict(spec, eod=0)}, where="x.meta.json")


def test_hf_tokenizer_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no-such-tokenizer"):
        HFTokenizer(str(tmp_path / "no-such-tokenizer"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match="pip install transformers"):
        HFTokenizer(str(tmp_path))


def test_hf_tokenizer_local_dir(tmp_path):
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    def save(name, **special):
        vocab = {"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3, "<pad>": 4}
        core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
        core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="<eos>", **special)
        fast.save_pretrained(str(tmp_path / name))
        return build_tokenizer(str(tmp_path / name))

    tok = save("nopad")
    assert isinstance(tok, HFTokenizer)
    # No pad token: a synthetic pad is appended after the real vocabulary.
    assert (tok.eod, tok.pad, tok.vocab_size) == (1, 5, 6)
    assert tok.tokenize("hello world") == [2, 3]
    assert tok.detokenize([2, 3, 5]) == "hello world"
    assert tokenizer_spec_dict(tok)["path"] == str(tmp_path / "nopad")
    own = save("ownpad", pad_token="<pad>")  # its own pad differs from eos: used as is
    assert (own.eod, own.pad, own.vocab_size) == (1, 4, 5)
    same = save("eospad", pad_token="<eos>")  # pad == eos (GPT-2 style): synthetic pad
    assert (same.eod, same.pad, same.vocab_size) == (1, 5, 6)


# ----------------------------------------------------------------------------------- preprocess


def test_preprocess_exact_counts(tmp_path):
    root = tmp_path / "in"
    texts = {"a.txt": "first document\n", "b.md": "# second ✓\n", "sub/c.py": "x = 1\n\n\ny = 2\n"}
    for name, text in texts.items():
        _write(str(root / name), text)
    _write(str(root / "empty.txt"), "  \n")  # whitespace only: skipped
    _write(str(root / "skip.bin"), "not picked from a folder")
    _write(str(root / ".hidden" / "h.txt"), "hidden folders are skipped")
    jsonl = ["jsonl one", "jsonl two ü", ""]  # the empty text is skipped
    _write(str(tmp_path / "d.jsonl"), "".join(json.dumps({"text": t}) + "\n" for t in jsonl) + "\n")
    explicit = tmp_path / "notes.log"  # any extension is read when given explicitly
    _write(str(explicit), "explicit file\n")

    prefix = str(tmp_path / "out" / "ds")
    meta = preprocess([str(root), str(tmp_path / "d.jsonl"), str(explicit)], prefix, seed=7)

    expected = list(texts.values()) + jsonl[:2] + ["explicit file\n"]
    n_tokens = sum(len(t.encode()) for t in expected) + len(expected)
    assert (meta["num_docs"], meta["num_tokens"]) == (6, n_tokens)
    docs = _read_docs(prefix)
    assert len(docs) == 6
    assert sum(len(d) for d in docs) == n_tokens
    assert all(d[-1] == 256 and 256 not in d[:-1] for d in docs)
    tok = ByteTokenizer()
    assert sorted(tok.detokenize(d) for d in docs) == sorted(expected)
    assert os.path.getsize(prefix + ".bin") == 2 * n_tokens  # uint16
    assert read_meta(prefix, verify=True)["idx_sha256"] == sha256_file(prefix + ".idx")
    assert sorted(os.listdir(tmp_path / "out")) == ["ds.bin", "ds.idx", "ds.meta.json"]


def test_preprocess_shuffle_is_seeded(tmp_path):
    folder, _ = _corpus(tmp_path, n_docs=20)
    a = preprocess([folder], str(tmp_path / "a"), seed=1)
    b = preprocess([folder], str(tmp_path / "b"), seed=1)
    preprocess([folder], str(tmp_path / "c"), seed=2)
    assert a["idx_sha256"] == b["idx_sha256"]
    assert _read_docs(str(tmp_path / "a")) == _read_docs(str(tmp_path / "b"))
    assert _read_docs(str(tmp_path / "a")) != _read_docs(str(tmp_path / "c"))
    first = [ByteTokenizer().detokenize(d) for d in _read_docs(str(tmp_path / "a"))]
    assert first != sorted(first)  # not left in file order


def test_split_text_sizes(tmp_path):
    paragraphs = [chr(ord("a") + i) * 1000 for i in range(10)]
    docs = split_text("\n\n".join(paragraphs), doc_chars=2500)
    assert [len(d) for d in docs] == [2002] * 5  # two paragraphs + one blank line each
    lines = "".join(chr(ord("a") + i) * 499 + "\n" for i in range(10))  # no blank line at all
    assert [len(d) for d in split_text(lines, doc_chars=1200)] == [1000] * 5
    assert split_text("short", doc_chars=2500) == ["short"]
    assert split_text(" \n\n ", doc_chars=2) == []
    # A single big file becomes many documents.
    _write(str(tmp_path / "big.txt"), "\n\n".join(paragraphs))
    meta = preprocess([str(tmp_path / "big.txt")], str(tmp_path / "big"), doc_chars=2500)
    assert (meta["num_docs"], meta["num_tokens"]) == (5, 5 * 2002 + 5)


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write(str(path), '{"text": "ok"}\n{"txt": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*string field 'text'"):
        preprocess([str(path)], str(tmp_path / "o"))
    _write(str(path), '{"text": "ok"}\n\n{"text": 3}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: "):
        preprocess([str(path)], str(tmp_path / "o"))
    assert not os.path.exists(tmp_path / "o.bin")


def test_missing_input_and_no_documents(tmp_path):
    missing = str(tmp_path / "nope" / "x.txt")
    with pytest.raises(FileNotFoundError, match=r"nope/x\.txt"):
        preprocess([missing], str(tmp_path / "o"))
    (tmp_path / "emptydir").mkdir()
    _write(str(tmp_path / "emptydir" / "e.txt"), "")
    with pytest.raises(ValueError, match=r"no documents found in .*emptydir"):
        preprocess([str(tmp_path / "emptydir")], str(tmp_path / "o"))


def test_write_failure_leaves_no_final_files(tmp_path, monkeypatch):
    folder, _ = _corpus(tmp_path, n_docs=10)
    prefix = str(tmp_path / "out" / "ds")
    real_add = megatron_indexed.IndexedDatasetBuilder.add_item
    calls = {"n": 0}

    def failing_add(self, tensor, mode=0):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("disk full (simulated)")
        return real_add(self, tensor, mode)

    monkeypatch.setattr(megatron_indexed.IndexedDatasetBuilder, "add_item", failing_add)
    with pytest.raises(RuntimeError, match="simulated"):
        preprocess([folder], prefix)
    assert calls["n"] == 4
    assert os.listdir(tmp_path / "out") == []  # no final names and no temporaries left

    # A failed rebuild over a good dataset keeps the old one intact...
    monkeypatch.setattr(megatron_indexed.IndexedDatasetBuilder, "add_item", real_add)
    good = preprocess([folder], prefix)
    monkeypatch.setattr(megatron_indexed.IndexedDatasetBuilder, "add_item", failing_add)
    calls["n"] = 0
    with pytest.raises(RuntimeError):
        preprocess([folder], prefix, seed=99)
    assert read_meta(prefix, verify=True)["idx_sha256"] == good["idx_sha256"]

    # ...and a crash while moving files into place never leaves a .meta.json or a mismatched pair.
    monkeypatch.setattr(megatron_indexed.IndexedDatasetBuilder, "add_item", real_add)
    real_replace = os.replace

    def failing_replace(src, dst):
        if dst.endswith(".idx"):
            raise OSError("crash (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated"):
        preprocess([folder], prefix, seed=99)
    assert sorted(os.listdir(tmp_path / "out")) == ["ds.bin"]
    with pytest.raises(FileNotFoundError, match=r"ds\.idx is missing.*preprocess_data\.py"):
        read_meta(prefix)


def test_read_meta_names_missing_file(tmp_path):
    folder, _ = _corpus(tmp_path, n_docs=5)
    prefix = str(tmp_path / "ds")
    preprocess([folder], prefix)
    os.remove(prefix + ".meta.json")
    with pytest.raises(FileNotFoundError, match=r"ds\.meta\.json is missing.*preprocess_data\.py"):
        read_meta(prefix)
    with pytest.raises(FileNotFoundError, match=r"other\.bin is missing"):
        read_meta(str(tmp_path / "other"))


# ------------------------------------------------------------------------------------- datasets


def test_parse_data_prefix():
    assert parse_data_prefix(["a"]) == (["a"], None)
    assert parse_data_prefix(["a", "b"]) == (["a", "b"], None)
    assert parse_data_prefix(["0.3 a 0.7 b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ValueError, match="odd count"):
        parse_data_prefix(["0.3", "a", "0.7"])
    with pytest.raises(ValueError, match="mixes weights"):
        parse_data_prefix(["a", "0.5"])


def _small_datasets(tmp_path, **kw):
    folder, total = _corpus(tmp_path, n_docs=120)
    prefix = str(tmp_path / "ds")
    preprocess([folder], prefix)
    args = dict(split="90,10,0", seq_length=64, seed=1234, train_samples=50, valid_samples=10,
                cache_dir=str(tmp_path / "cache"), tokenizer=None)
    args.update(kw)
    return (prefix,) + build_gpt_datasets([prefix], **args)


def test_build_gpt_datasets(tmp_path, gloo_group):
    prefix, train, valid = _small_datasets(tmp_path)
    # 120 docs: train = docs 0..107, valid = 108..119 (megatron rounds split * num_docs).
    index = IndexedDataset(prefix)  # keep it alive: its __del__ unmaps sequence_lengths
    lengths = index.sequence_lengths.copy()
    del index
    assert len(train) == (int(lengths[:108].sum()) - 1) // 64
    assert len(valid) == (int(lengths[108:].sum()) - 1) // 64
    assert len(valid) >= 10
    sample = train[0]
    assert sorted(sample) == ["labels", "loss_mask", "position_ids", "tokens"]  # no attention_mask
    assert sample["tokens"].shape == (64,) and sample["tokens"].dtype == torch.int64
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert torch.equal(sample["position_ids"], torch.arange(64))
    assert float(sample["loss_mask"].sum()) == 64.0
    assert os.listdir(tmp_path / "cache")[0].startswith("data-")


def test_build_gpt_datasets_weighted_blend(tmp_path, monkeypatch, gloo_group):
    folder, _ = _corpus(tmp_path, n_docs=60)
    preprocess([folder], str(tmp_path / "a"), seed=1)
    preprocess([folder], str(tmp_path / "b"), seed=2)
    blend = ["0.25", str(tmp_path / "a"), "0.75", str(tmp_path / "b")]
    train, valid = build_gpt_datasets(blend, "90,10,0", 32, 1, 40, 8, str(tmp_path / "cache"))
    assert type(train).__name__ == "BlendedDataset"
    assert (len(train), len(valid)) == (40, 8)
    assert train[0]["tokens"].shape == (32,)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="is a blend, which needs torch.distributed"):
        build_gpt_datasets(blend, "90,10,0", 32, 1, 40, 8, str(tmp_path / "cache"))


def test_build_gpt_datasets_empty_split_errors(tmp_path):
    folder, _ = _corpus(tmp_path, n_docs=10)
    prefix = str(tmp_path / "ds")
    preprocess([folder], prefix)
    common = dict(seq_length=16, seed=1, train_samples=4, cache_dir=str(tmp_path / "c"))
    # 2 % of 10 documents rounds to none: megatron would loop forever building it.
    with pytest.raises(ValueError, match=r"the valid split of .*0 documents, 0 tokens.*larger share"):
        build_gpt_datasets([prefix], split="98,2,0", valid_samples=2, **common)
    with pytest.raises(ValueError, match="gives the valid split no share"):
        build_gpt_datasets([prefix], split="100,0,0", valid_samples=2, **common)
    with pytest.raises(ValueError, match=r"split '1,2,x'"):
        build_gpt_datasets([prefix], split="1,2,x", valid_samples=2, **common)
    with pytest.raises(ValueError, match="differs from the tokenizer"):
        tok = ByteTokenizer()
        tok.eod = 0
        build_gpt_datasets([prefix], split="50,50,0", valid_samples=2, tokenizer=tok, **common)


def _truncate(path, by):
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size - by)
    return size


DAMAGE_ARGS = dict(split="90,10,0", seq_length=64, seed=1234, train_samples=50, valid_samples=10)


def test_truncated_bin_is_named_at_build_time(tmp_path):
    # 4 KiB short: before, training ran until a sample reached the missing tail (the first
    # evaluation: validation documents are the last ones), then died in megatron's reader.
    folder, _ = _corpus(tmp_path, n_docs=120)
    prefix = str(tmp_path / "ds")
    meta = preprocess([folder], prefix)
    size = _truncate(prefix + ".bin", 4096)
    expected = (f"{prefix}.bin has {size - 4096} bytes, 4096 fewer than the {size} that its index "
                f"{prefix}.idx refers to ({meta['num_tokens']} uint16 tokens in {meta['num_docs']} "
                f"documents): the file is truncated (an interrupted copy, or a full disk while it was "
                f"written). Rebuild dataset {prefix!r}: run `python launch/preprocess_data.py")
    with pytest.raises(ValueError) as err:
        build_gpt_datasets([prefix], cache_dir=str(tmp_path / "cache"), **DAMAGE_ARGS)
    assert str(err.value).startswith(expected), str(err.value)
    assert not os.path.exists(tmp_path / "cache")  # refused before megatron built anything
    # Data written by Megatron-LM's own tools has no .meta.json: checked against the index alone.
    os.remove(prefix + ".meta.json")
    with pytest.raises(ValueError, match=r"ds\.bin has \d+ bytes, 4096 fewer than"):
        build_gpt_datasets([prefix], cache_dir=str(tmp_path / "cache"), tokenizer=ByteTokenizer(),
                           **DAMAGE_ARGS)


@pytest.mark.parametrize("cut", [100, "header"])
def test_truncated_idx_is_named_at_build_time(tmp_path, cut):
    # Before: megatron's "buffer is smaller than requested size", naming no file.
    folder, _ = _corpus(tmp_path, n_docs=120)
    prefix = str(tmp_path / "ds")
    meta = preprocess([folder], prefix)
    size = os.path.getsize(prefix + ".idx")
    _truncate(prefix + ".idx", 100 if cut == 100 else size - 20)
    with pytest.raises(ValueError) as err:
        build_gpt_datasets([prefix], cache_dir=str(tmp_path / "cache"), **DAMAGE_ARGS)
    if cut == 100:
        head = (f"{prefix}.idx has {size - 100} bytes, but its header describes {meta['num_docs']} "
                f"sequences and {meta['num_docs'] + 1} document indices ({size} bytes): the file is truncated")
    else:
        head = (f"{prefix}.idx has 20 bytes, fewer than the 34-byte header of a megatron index: the "
                f"file is truncated")
    assert str(err.value).startswith(head), str(err.value)
    assert "launch/preprocess_data.py" in str(err.value) and f"--output-prefix {prefix}" in str(err.value)


def test_bin_and_idx_that_disagree_with_the_meta_are_named(tmp_path):
    # A pair from another build under the old .meta.json (copied in one by one, say).
    folder, _ = _corpus(tmp_path, n_docs=120)
    prefix, other = str(tmp_path / "ds"), str(tmp_path / "other")
    meta = preprocess([folder], prefix)
    _, few = _corpus(tmp_path / "few", n_docs=30)
    preprocess([str(tmp_path / "few" / "corpus")], other)
    for ext in (".bin", ".idx"):
        os.replace(other + ext, prefix + ext)
    with pytest.raises(ValueError) as err:
        build_gpt_datasets([prefix], cache_dir=str(tmp_path / "cache"), **DAMAGE_ARGS)
    assert str(err.value).startswith(
        f"{prefix}.idx describes 30 documents, but {prefix}.meta.json records {meta['num_docs']}: "
        f"the files are not from one build"), str(err.value)


@pytest.fixture(scope="module")
def default_corpus_prefix(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("stdlib") / "stdlib")
    build_default_dataset(prefix)
    return prefix


def test_default_corpus_builds_and_splits(default_corpus_prefix, tmp_path, gloo_group, capsys):
    meta = read_meta(default_corpus_prefix, verify=True)
    assert meta["corpus"]["licence"] == "PSF-2.0"
    assert meta["num_docs"] > 300 and meta["num_tokens"] > 2_000_000
    mtime = os.path.getmtime(default_corpus_prefix + ".idx")
    assert build_default_dataset(default_corpus_prefix)["idx_sha256"] == meta["idx_sha256"]
    assert os.path.getmtime(default_corpus_prefix + ".idx") == mtime  # skipped, not rebuilt
    assert "already built" in capsys.readouterr().out
    train, valid = build_gpt_datasets([default_corpus_prefix], "98,2,0", 256, 1234, 100, 20,
                                      str(tmp_path / "cache"), ByteTokenizer())
    assert len(train) >= 100 and len(valid) >= 20


def test_micro_batches_dp1x2_equal_dp2x1_and_resume(tmp_path):
    _, train, _ = _small_datasets(tmp_path)
    mbs = 2
    dp1 = MicroBatchIterator(train, 0, mbs, 0, 1)
    dp2 = [MicroBatchIterator(train, 0, mbs, r, 2) for r in range(2)]
    for _ in range(3):  # three global batches of 4 samples
        for rank in range(2):
            a, b = next(dp1), next(dp2[rank])
            assert a["tokens"].shape == (mbs, 64)
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                assert torch.equal(a[key], b[key]), key
    assert dp1.consumed_samples == 12 and dp2[0].consumed_samples == dp2[1].consumed_samples == 12
    assert a["tokens"].dtype == torch.int64 and a["loss_mask"].dtype == torch.float32

    # Resume: a fresh iterator at the saved position yields the identical next batch.
    expected = next(dp1)
    resumed = MicroBatchIterator(train, 12, mbs, 0, 1)
    got = next(resumed)
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert torch.equal(got["tokens"][0], train[12]["tokens"])
    assert resumed.consumed_samples == dp1.consumed_samples == 14


def test_micro_batch_wraps_around_and_validates():
    data = [{"tokens": torch.full((3,), i), "labels": torch.full((3,), i),
             "loss_mask": torch.ones(3), "position_ids": torch.arange(3)} for i in range(5)]
    it = MicroBatchIterator(data, 3, 2, 1, 2)  # global samples 3..6; rank 1 takes 5, 6 -> 0, 1
    assert it.next_indices() == [0, 1]
    assert next(it)["tokens"][:, 0].tolist() == [0, 1]
    assert it.consumed_samples == 7
    with pytest.raises(ValueError, match=r"data_parallel_rank 2 must be in \[0, 2\)"):
        MicroBatchIterator(data, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="dataset is empty"):
        MicroBatchIterator([], 0, 1, 0, 1)


# ------------------------------------------------------------------------------ two gloo ranks


def _two_rank_worker(rank, port, prefix, cache, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    try:
        train, valid = build_gpt_datasets([prefix], "90,10,0", 64, 1234, 50, 10, cache, None)
        it = MicroBatchIterator(train, 0, 2, rank, 2)
        torch.save({"len": (len(train), len(valid)), "batch": next(it)["tokens"]}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_build_gpt_datasets_two_ranks(tmp_path):
    folder, _ = _corpus(tmp_path, n_docs=120)
    prefix = str(tmp_path / "ds")
    preprocess([folder], prefix)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")  # megatron is already imported here; spawning would re-import it
    out = str(tmp_path / "res")
    procs = [ctx.Process(target=_two_rank_worker, args=(r, port, prefix, str(tmp_path / "cache"), out))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=60)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():  # hung in a barrier: do not leave it behind
                p.kill()
    r0, r1 = torch.load(out + ".0"), torch.load(out + ".1")
    assert r0["len"] == r1["len"]
    single = MicroBatchIterator(build_gpt_datasets([prefix], "90,10,0", 64, 1234, 50, 10,
                                                   str(tmp_path / "cache"), None)[0], 0, 4, 0, 1)
    assert torch.equal(torch.cat([r0["batch"], r1["batch"]]), next(single)["tokens"])
