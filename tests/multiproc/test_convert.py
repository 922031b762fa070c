"""checkpoints/grpo_ckpt.py on checkpoints the training entry wrote with GRPO (Llama-style at
TP2 x PP2, GPT-2-style with a tied head at DP2) and on models transformers itself made:
to-hf and from-hf pass their numerical checks (per-token KL maximum below 1e-6, top-1 agreement,
bit-identical round trip), the check fails on a broken conversion, inspect describes and
refuses damage, strip-grpo gives a checkpoint the baseline resumes, and a load of another
model shape names the difference."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from harness import GRPO_SMALL, LLAMA_SMALL, REPO, SMALL_MODEL, env, read_metrics, run_training

TOOL = os.path.join(REPO, "checkpoints", "grpo_ckpt.py")
KL = re.compile(r"per-token KL max (\S+) \(threshold 1e-06\).*top-1 agreement (\S+)")


def tool(*args, check=True):
    proc = subprocess.run([sys.executable, TOOL, *args], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"grpo_ckpt.py {args[0]} rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return proc


def kl_top1(stdout):
    m = KL.search(stdout)
    assert m, stdout
    return float(m.group(1)), float(m.group(2))


@pytest.fixture(scope="module")
def llama_ckpt(stdlib_data, tmp_path_factory):
    """Llama-style (GQA 4 heads / 2 groups, SwiGLU, RMSNorm, RoPE, untied), GRPO, TP2 x PP2."""
    root = str(tmp_path_factory.mktemp("llama") / "ck")
    run_training(4, [*LLAMA_SMALL, *GRPO_SMALL, "--data-path", stdlib_data, "--tensor-model-parallel-size", "2",
                     "--pipeline-model-parallel-size", "2", "--train-iters", "8", "--eval-interval", "8",
                     "--eval-iters", "1", "--save", root, "--save-interval", "8"], timeout=600)
    return root


@pytest.fixture(scope="module")
def gpt_tied_ckpt(stdlib_data, tmp_path_factory):
    """GPT-2-style with the output layer tied to the embedding, GRPO, DP2."""
    root = str(tmp_path_factory.mktemp("gpt") / "ck")
    run_training(2, [*SMALL_MODEL, *GRPO_SMALL, "--data-path", stdlib_data,
                     "--no-untie-embeddings-and-output-weights", "--train-iters", "8", "--eval-interval", "8",
                     "--eval-iters", "1", "--save", root, "--save-interval", "8"])
    return root


def test_llama_tp2_pp2_grpo_to_hf_and_back(llama_ckpt, stdlib_data, tmp_path):
    hf = str(tmp_path / "hf")
    out = tool("to-hf", llama_ckpt, hf, "--verify").stdout
    kl, top1 = kl_top1(out)
    assert kl < 1e-6 and top1 == 1.0 and "verify OK" in out
    cfg = json.load(open(os.path.join(hf, "config.json")))
    assert (cfg["model_type"], cfg["num_key_value_heads"], cfg["num_attention_heads"]) == ("llama", 2, 4)
    assert cfg["vocab_size"] == 258 and cfg["tie_word_embeddings"] is False  # padding (512 at TP2) dropped
    assert cfg["rope_parameters"]["rope_theta"] == 500000.0 and cfg["intermediate_size"] == 256
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))["weight_map"]
    assert len(set(index.values())) == 3 and "lm_head.weight" in index  # one shard per layer + globals
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    assert tok("é\n")["input_ids"] == list("é\n".encode()) and tok.eos_token_id == 256

    back = str(tmp_path / "back")
    # padded as a TP2 run pads (512 rows), so the TP2 x PP2 run below takes it
    out = tool("from-hf", hf, back, "--verify", "--tensor-model-parallel-size", "2").stdout
    kl, top1 = kl_top1(out)
    assert kl < 1e-6 and top1 == 1.0
    assert "round trip HF -> megatron -> HF: identical tensors" in out
    proc = run_training(4, [*LLAMA_SMALL, *GRPO_SMALL, "--data-path", stdlib_data, "--tensor-model-parallel-size",
                            "2", "--pipeline-model-parallel-size", "2", "--train-iters", "2", "--eval-interval", "2",
                            "--eval-iters", "1", "--init-from", back], timeout=600)
    assert "vocab=512" in proc.stdout


def test_gpt2_style_tied_head_to_hf(gpt_tied_ckpt, tmp_path):
    hf = str(tmp_path / "hf")
    out = tool("to-hf", gpt_tied_ckpt, hf, "--verify").stdout
    kl, top1 = kl_top1(out)
    assert kl < 1e-6 and top1 == 1.0
    cfg = json.load(open(os.path.join(hf, "config.json")))
    assert cfg["model_type"] == "gpt2" and cfg["tie_word_embeddings"] is True
    assert cfg["activation_function"] == "gelu" and cfg["n_positions"] == 64
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))["weight_map"]
    assert "lm_head.weight" not in index and "transformer.wte.weight" in index


def _transformers_model(kind, path):
    """A random model made by transformers itself: vocabulary 300 (padded to 384 in megatron),
    tied head; the Llama one with GQA and biases."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                           activation_function="gelu", tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128, attention_bias=True, mlp_bias=True,
                                             rms_norm_eps=1e-5, tie_word_embeddings=True,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    # random init leaves norms at 1 and biases at 0: perturb them so a mapping mistake shows
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_models_made_by_transformers_round_trip(kind, tmp_path):
    from safetensors.torch import load_file

    src, ck, back = str(tmp_path / "src"), str(tmp_path / "ck"), str(tmp_path / "back")
    original = _transformers_model(kind, src)
    out = tool("from-hf", src, ck, "--verify").stdout
    kl, top1 = kl_top1(out)
    assert kl < 1e-6 and top1 == 1.0 and "identical tensors" in out
    info = json.loads(tool("inspect", ck, "--json").stdout)
    assert info["padded_vocab_size"] == 384 and info["model"]["untie_embeddings_and_output_weights"] is False
    tool("to-hf", ck, back)
    written = {}
    for name in sorted(os.listdir(back)):
        if name.endswith(".safetensors"):
            written.update(load_file(os.path.join(back, name)))
    expected = {k: v for k, v in original.items() if k != "lm_head.weight"}  # tied: not stored
    assert sorted(written) == sorted(expected)
    assert [k for k in expected if not torch.equal(written[k], expected[k])] == []


BROKEN = r"""
import sys, torch
from safetensors.torch import load_file, save_file
from megatron_grpo.convert import hf_layout, verify
from megatron_grpo.convert.reader import CheckpointView
ckpt, hf, shard = sys.argv[1:4]
view = CheckpointView(ckpt)
shape = hf_layout.shape_from_record(view.record)
t = load_file(shard)
a = "model.layers.0.self_attn."
q, k, v = (t[a + n + "_proj.weight"] for n in "qkv")
# the GQA trap: megatron's per-group [q.., k, v] rows cut in plain thirds, as a naive converter does
rows = hf_layout._join_qkv(q, k, v, shape)
t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"] = rows.split([len(q), len(k), len(v)])
save_file(t, shard, metadata={"format": "pt"})
tokens = verify.token_batch(verify.tokenizer_of(view.record), verify.default_text(), 64)
print(verify.check(verify.MegatronModel(view.record, view.path), hf, tokens).describe(), flush=True)
import os; os._exit(0)
"""


def test_verify_fails_on_a_broken_conversion(llama_ckpt, tmp_path):
    hf = str(tmp_path / "hf")
    tool("to-hf", llama_ckpt, hf)
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))["weight_map"]
    shard = os.path.join(hf, index["model.layers.0.self_attn.q_proj.weight"])
    proc = subprocess.run([sys.executable, "-c", BROKEN, llama_ckpt, hf, shard], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert "verify FAILED" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    kl, _ = kl_top1(proc.stdout)
    assert kl > 1e-4  # 100x the threshold: the check has room on both sides


def test_inspect_describes_and_refuses_damage(llama_ckpt, tmp_path):
    info = json.loads(tool("inspect", llama_ckpt, "--json").stdout)
    assert (info["iteration"], info["world_size"], info["layout_tp_pp"]) == (8, 4, [2, 2])
    assert info["grpo_state"] and "core" in info["tier_counts"]
    h, ffn, layers, vocab = 96, 256, 2, 512  # vocabulary padded for TP2
    layer = h + h * (4 + 2 * 2) * 24 + h * h + h + h * 2 * ffn + ffn * h
    assert info["model_parameters"] == 2 * vocab * h + layers * layer + h
    assert info["model"]["num_query_groups"] == 2 and info["tokenizer"]["type"] == "byte"
    text = tool("inspect", llama_ckpt).stdout
    assert "verified (size and CRC32 of every file)" in text and "GRPO state: tier map" in text

    import shutil

    damaged = str(tmp_path / "damaged")
    shutil.copytree(llama_ckpt, damaged)
    it = os.path.join(damaged, "iter_0000008")
    shard = sorted(f for f in os.listdir(it) if f.endswith(".distcp"))[1]
    with open(os.path.join(it, shard), "r+b") as fh:
        fh.truncate(os.path.getsize(os.path.join(it, shard)) // 2)
    for command in (["inspect", damaged], ["to-hf", damaged, str(tmp_path / "out")]):
        proc = tool(*command, check=False)
        assert proc.returncode == 2 and f"{shard} is corrupted" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.tmp")


def test_strip_grpo_gives_a_checkpoint_the_baseline_resumes(gpt_tied_ckpt, stdlib_data, tmp_path):
    plain = str(tmp_path / "plain")
    out = tool("strip-grpo", gpt_tied_ckpt, plain).stdout
    assert "extensions" in out and "rng/rank_00001.pt: extra (controller, optimizer)" in out
    info = json.loads(tool("inspect", plain, "--json").stdout)
    assert info["grpo_state"] is False and info["optimizer_tensors"] > 0
    source = json.loads(tool("inspect", gpt_tied_ckpt, "--json").stdout)
    assert source["grpo_state"] is True  # the source is untouched (and its checksums still verify)
    base = [*SMALL_MODEL, "--data-path", stdlib_data, "--no-untie-embeddings-and-output-weights",
            "--train-iters", "10", "--eval-interval", "10", "--eval-iters", "1", "--load", plain,
            "--use-checkpoint-opt_param-scheduler"]  # written with --train-iters 8: keep its lr decay
    # The optimizer state is saved per DDP bucket: the baseline's own 20000-element buckets are
    # refused with the way out, before megatron's shape error.
    proc = run_training(2, base, check=False)
    assert proc.returncode != 0
    assert "the distributed optimizer's state is saved per DDP bucket" in proc.stdout + proc.stderr
    size = re.search(r"resume it without --grpo with --ddp-bucket-size (\d+)", out).group(1)
    assert int(size) == int(0.04 * 1024 * 1024 / 4)  # GRPO_SMALL's --grpo-bucket-mb
    metrics = str(tmp_path / "m.jsonl")
    run_training(2, [*base, "--ddp-bucket-size", size, "--metrics-file", metrics])
    records = read_metrics(metrics)
    assert [r["iteration"] for r in records] == [9, 10]


def test_load_of_another_model_shape_names_the_difference(gpt_tied_ckpt, stdlib_data):
    proc = run_training(1, [*SMALL_MODEL, "--hidden-size", "64", "--data-path", stdlib_data,
                            "--no-untie-embeddings-and-output-weights", "--train-iters", "10",
                            "--load", gpt_tied_ckpt], check=False)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    # ffn_hidden_size follows (4 x hidden): every difference is named
    assert ("the checkpoint holds another model shape: ffn_hidden_size 384 there, 256 here; hidden_size 96 "
            "there, 64 here") in text, text[-3000:]


def test_a_run_with_the_shipped_bpe_tokenizer_converts_with_its_tokenizer(tmp_path):
    import sysconfig

    from megatron_grpo.data.tokenizer import HFTokenizer

    shipped = os.path.join(REPO, "launch", "tokenizers", "stdlib-bpe-4k")
    lib = sysconfig.get_paths()["stdlib"]
    data = str(tmp_path / "bpe")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "preprocess_data.py"), "--input",
                           *(os.path.join(lib, n) for n in ("argparse.py", "difflib.py", "textwrap.py", "shlex.py")),
                           "--output-prefix", data, "--tokenizer-model", shipped],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ck = str(tmp_path / "ck")
    run_training(1, [*LLAMA_SMALL, "--data-path", data, "--train-iters", "4", "--eval-interval", "4",
                     "--eval-iters", "1", "--global-batch-size", "2", "--save", ck, "--save-interval", "4"])
    hf = str(tmp_path / "hf")
    out = tool("to-hf", ck, hf, "--verify").stdout
    assert "tokenizer of " + shipped in out
    kl, top1 = kl_top1(out)
    assert kl < 1e-6 and top1 == 1.0
    assert json.load(open(os.path.join(hf, "config.json")))["vocab_size"] == 4096
    from transformers import AutoTokenizer

    text = open(os.path.join(lib, "textwrap.py")).read()[:2000]
    assert AutoTokenizer.from_pretrained(hf)(text)["input_ids"] == HFTokenizer(shipped).tokenize(text)


def test_a_checkpoint_of_other_versions_is_loaded_and_named(gpt_tied_ckpt, stdlib_data, tmp_path):
    import shutil

    copy = str(tmp_path / "ck")
    shutil.copytree(gpt_tied_ckpt, copy)
    manifest = os.path.join(copy, "iter_0000008", "megatron_grpo_manifest.json")
    m = json.load(open(manifest))
    ours = m["model"]["versions"]["megatron_core"]
    m["model"]["versions"].update(megatron_core="0.15.0", megatron_grpo="0.0.9")
    json.dump(m, open(manifest, "w"))
    proc = run_training(2, [*SMALL_MODEL, *GRPO_SMALL, "--data-path", stdlib_data,
                            "--no-untie-embeddings-and-output-weights", "--train-iters", "9",
                            "--eval-interval", "9", "--eval-iters", "1", "--load", copy,
                            "--use-checkpoint-opt_param-scheduler"])  # keep the 8-iteration decay
    assert (f"[checkpoint] --load {copy}: written with megatron-core 0.15.0 there, {ours} here; "
            f"megatron-grpo 0.0.9 there, 0.1.0 here") in proc.stdout


def test_a_checkpoint_without_common_pt_is_refused_by_strip_grpo_and_read_by_inspect(gpt_tied_ckpt, tmp_path):
    """megatron-core 0.19 writes no common.pt: the common state is a sharded object inside the
    torch_dist files. strip-grpo, which rewrites common.pt, refuses such a checkpoint naming the
    way out (before writing anything), and the reader's common() goes to megatron's own
    load_common_state_dict when common.pt is absent (here, under 0.16.1, that one needs it)."""
    import shutil

    from megatron_grpo.convert.ckpt_tools import strip_grpo
    from megatron_grpo.convert.reader import CheckpointView
    from megatron_grpo.training import checkpointing as ckpt

    src = CheckpointView(gpt_tied_ckpt)
    copy = str(tmp_path / os.path.basename(src.path))
    shutil.copytree(src.path, copy)
    os.remove(os.path.join(copy, "common.pt"))
    ckpt.write_manifest(copy, int(src.manifest["iteration"]), int(src.manifest.get("world_size", 1)),
                        src.manifest.get("layout", [1, 1]), src.record)
    with pytest.raises(ckpt.CheckpointError, match=r"strip-grpo rewrites common.pt, and this checkpoint "
                                                   r"has none \(written with megatron-core 0.19 or later"):
        strip_grpo(copy, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
    seen = []
    import megatron.core.dist_checkpointing as mdc

    original = mdc.load_common_state_dict
    mdc.load_common_state_dict = lambda path: seen.append(path) or {"common": {}}
    try:
        assert CheckpointView(copy).common() == {"common": {}} and seen == [copy]
    finally:
        mdc.load_common_state_dict = original
    assert "common" in CheckpointView(gpt_tied_ckpt).common()  # common.pt read directly
