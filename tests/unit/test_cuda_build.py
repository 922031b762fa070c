"""The CUDA model is built as Megatron-LM builds one: initialised on the device,
with every fusion whose kernel is importable, and a start-up warning when attention is unfused at
a sequence length where its S x S scores cost memory. CPU mode keeps its settings exactly.

Everything here runs on CPU: the settings are a pure function of the config and of which kernels
the probe found, so "kernel present" and "kernel missing" are both given to it.
"""

import importlib.util

import pytest
import torch

from megatron_grpo.platform import Platform
from megatron_grpo.training.arguments import parse_args

DATA = ["--data-path", "data/x"]
CUDA = Platform(torch.device("cuda", 0), "nccl", False)  # a device object needs no GPU
CPU = Platform(torch.device("cpu"), "gloo", True)
FUSIONS = ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
           "masked_softmax_fusion", "apply_rope_fusion")
# What megatron_grpo/training/model.py passed to TransformerConfig before this change, on every
# device; CPU mode must keep exactly this.
TODAY = dict(use_cpu_initialization=True, **{f: False for f in FUSIONS})


def config(name, *extra):
    return parse_args(["--config", f"launch/configs/{name}.yaml", *DATA, *extra])


def gpt2_style():
    """GeLU with linear biases, RoPE: every fusion applies to it."""
    return parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--position-embedding-type", "rope", *DATA])


def all_present():
    from megatron_grpo.training.cuda_settings import KERNELS

    return {k: None for k in KERNELS}


def test_cuda_transformer_config_initialises_on_the_device():
    """The wiring: today this config says use_cpu_initialization=True and no fusion on CUDA."""
    from megatron_grpo.training.model import transformer_config

    tf = transformer_config(config("tiny"), CUDA)
    assert tf.use_cpu_initialization is False
    from megatron_grpo.training.cuda_settings import build_settings, probe_kernels

    # The fusions are those the real probe allows on this machine (no apex, no TE here).
    expected = build_settings(config("tiny"), True, probe_kernels())
    assert {f: getattr(tf, f) for f in FUSIONS} == expected.fusions


@pytest.mark.parametrize("name", ["tiny", "gpt_8b"])
def test_cpu_mode_keeps_todays_settings(name):
    from megatron_grpo.training.cuda_settings import build_settings
    from megatron_grpo.training.model import transformer_config

    tf = transformer_config(config(name), CPU)
    assert {k: getattr(tf, k) for k in TODAY} == TODAY
    settings = build_settings(config(name), False, all_present())  # kernels do not matter on CPU
    assert settings.kwargs() == TODAY
    assert all(r.startswith("CPU mode") for r in settings.off_reasons.values())


@pytest.mark.parametrize("make", [gpt2_style, lambda: config("gpt_8b")], ids=["gpt2-style", "gpt_8b"])
def test_cuda_with_every_kernel_turns_every_fusion_on(make):
    from megatron_grpo.training.cuda_settings import build_settings

    settings = build_settings(make(), True, all_present())
    assert settings.kwargs() == dict(use_cpu_initialization=False, **{f: True for f in FUSIONS})
    assert settings.off_reasons == {}
    lines = settings.describe()
    assert lines[0].startswith("fusions on: " + ", ".join(FUSIONS))
    assert "--init-from" in lines[-1]  # layout-independent weights: the seed checkpoint


@pytest.mark.parametrize("kernel, fusions", [
    ("fused_weight_gradient_mlp_cuda", ["gradient_accumulation_fusion"]),
    ("jit_fuser", ["bias_activation_fusion", "bias_dropout_fusion"]),
    ("scaled_masked_softmax_cuda", ["masked_softmax_fusion"]),
    ("scaled_upper_triang_masked_softmax_cuda", ["masked_softmax_fusion"]),
    ("te_fused_rope", ["apply_rope_fusion"]),
])
def test_a_missing_kernel_turns_off_its_fusion_and_says_why(kernel, fusions):
    from megatron_grpo.training.cuda_settings import build_settings

    kernels = dict(all_present(), **{kernel: f"No module named '{kernel}'"})
    settings = build_settings(gpt2_style(), True, kernels)
    assert {f for f, on in settings.fusions.items() if not on} == set(fusions)
    assert settings.use_cpu_initialization is False
    for f in fusions:
        assert kernel in settings.off_reasons[f] and f"No module named '{kernel}'" in settings.off_reasons[f]
    assert any(line.startswith(f"fusion off: {fusions[0]}: ") for line in settings.describe())


def test_fusions_megatron_refuses_for_the_model_stay_off_with_the_reason():
    from megatron_grpo.training.cuda_settings import build_settings

    # GeLU without biases: megatron's TransformerConfig raises on bias_activation_fusion (and
    # Megatron-LM turns bias-gelu fusion off); learned positions: no RoPE to fuse.
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--disable-bias-linear", *DATA])
    settings = build_settings(cfg, True, all_present())
    assert settings.fusions["bias_activation_fusion"] is False
    assert "--disable-bias-linear" in settings.off_reasons["bias_activation_fusion"]
    assert settings.fusions["apply_rope_fusion"] is False
    assert "learned_absolute" in settings.off_reasons["apply_rope_fusion"]
    assert settings.fusions["bias_dropout_fusion"] and settings.fusions["gradient_accumulation_fusion"]


@pytest.mark.parametrize("cfg_args", [
    ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--disable-bias-linear"],
    ["--config", "launch/configs/gpt_8b.yaml", "--num-layers", "2", "--hidden-size", "256",
     "--ffn-hidden-size", "512"],
])
def test_megatron_accepts_the_cuda_settings(cfg_args):
    """megatron's TransformerConfig validates fusions against the model (on CPU too): the CUDA
    settings with every kernel but TE's RoPE (absent here, and checked by megatron at build)."""
    from megatron_grpo.training.cuda_settings import build_settings
    from megatron_grpo.training.model import transformer_config

    cfg = parse_args([*cfg_args, *DATA])
    settings = build_settings(cfg, True, dict(all_present(), te_fused_rope="no transformer-engine"))
    tf = transformer_config(cfg, CUDA, settings)
    assert {k: getattr(tf, k) for k in settings.kwargs()} == settings.kwargs()


def test_probe_reports_what_this_machine_lacks():
    from megatron_grpo.training.cuda_settings import KERNELS, probe_kernels

    found = probe_kernels()
    assert set(found) == set(KERNELS)
    for module in ("fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda",
                   "scaled_upper_triang_masked_softmax_cuda"):
        if importlib.util.find_spec(module) is None:
            assert module in found[module]
    if importlib.util.find_spec("transformer_engine") is None:
        assert found["te_fused_rope"] is not None


def test_unfused_attention_warning_for_gpt_8b_at_4096_not_for_tiny():
    from megatron_grpo.training.cuda_settings import unfused_attention_bytes, unfused_attention_warning

    cfg = config("gpt_8b")
    extra = unfused_attention_bytes(cfg, vocab=128256)
    # At least the S x S scores alone: 32 layers x 32 heads x 4096^2 x micro-batch 1 / TP 2,
    # kept as fp32 softmax output (4 B) and bf16 probabilities (2 B).
    assert extra >= 32 * 32 * 4096 ** 2 // 2 * 6 == 51_539_607_552
    warning = unfused_attention_warning(cfg, "local", vocab=128256)
    assert warning is not None and "--seq-length 4096" in warning
    assert f"{extra / 1e9:.1f} GB" in warning and "transformer-engine" in warning
    assert unfused_attention_warning(cfg, "transformer_engine", vocab=128256) is None

    tiny = config("tiny")
    assert unfused_attention_bytes(tiny, vocab=258) < 1e9
    assert unfused_attention_warning(tiny, "local", vocab=258) is None


def test_rank0_start_up_report(gloo_group, capsys, monkeypatch):
    """What rank 0 prints before a CUDA build of the gpt_8b preset without transformer-engine."""
    from megatron_grpo.training.cuda_settings import build_settings
    from megatron_grpo.training.model import _report_cuda_build

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # TP=2: what the launchers export
    cfg = config("gpt_8b")
    settings = build_settings(cfg, True, dict(all_present(), jit_fuser="No module named 'triton'"))
    _report_cuda_build(cfg, settings, "local", 128256)
    out, err = capsys.readouterr()
    name = cfg.logging.run_name
    assert out.splitlines()[0] == (f"[{name}] fusions on: gradient_accumulation_fusion, "
                                   f"masked_softmax_fusion, apply_rope_fusion")
    assert f"[{name}] fusion off: bias_dropout_fusion: jit_fuser: No module named 'triton'" in out
    [warning] = err.splitlines()
    assert warning.startswith(f"[{name}] WARNING: attention is unfused") and "--seq-length 4096" in warning
