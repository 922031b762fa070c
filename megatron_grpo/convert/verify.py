"""Numerical checks of a conversion: next-token log-probabilities of megatron's model and of the
converted transformers model on the same real text.

The measure is the per-token KL divergence, reported as its maximum over tokens with an explicit
threshold, plus top-1 agreement: a mean over the vocabulary or over tokens hides a wrong RoPE
layout or a swapped head that only some positions expose (torchtitan's lesson).
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

MAX_KL = 1e-6
"""Largest per-token KL(megatron || HF) a conversion may show in fp32 (measured: ~1e-14 on the
test models; a missing QKV re-ordering gives > 0.1)."""
MIN_TOP1 = 0.995
"""Fraction of positions whose most likely next token agrees."""


@dataclass
class Agreement:
    max_kl: float
    mean_kl: float
    top1: float
    tokens: int

    @property
    def ok(self) -> bool:
        return self.max_kl <= MAX_KL and self.top1 >= MIN_TOP1

    def describe(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        return (f"verify {verdict}: per-token KL max {self.max_kl:.3g} (threshold {MAX_KL:g}), mean "
                f"{self.mean_kl:.3g}; top-1 agreement {self.top1:.4f} (threshold {MIN_TOP1}) over "
                f"{self.tokens} tokens of real text")


def default_text() -> str:
    """Real text present on every machine that runs this tool: Python standard-library sources
    (the project's default corpus is built from them too; any file works, --verify-text)."""
    lib = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in ("textwrap.py", "difflib.py", "argparse.py"):
        with open(os.path.join(lib, name), encoding="utf-8") as fh:
            parts.append(fh.read())
    return "\n".join(parts)


def token_batch(tokenizer, text: str, seq_length: int, sequences: int = 4) -> torch.Tensor:
    """``sequences`` windows of ``seq_length`` ids, spread over ``text``."""
    ids = tokenizer.tokenize(text)
    if len(ids) < seq_length:
        raise ValueError(f"the verification text has {len(ids)} tokens, fewer than one sequence "
                         f"({seq_length}); pass a longer --verify-text")
    step = max(1, (len(ids) - seq_length) // max(1, sequences - 1))
    rows = [ids[i * step:i * step + seq_length] for i in range(sequences)]
    return torch.tensor([r for r in rows if len(r) == seq_length], dtype=torch.long)


def compare(ref_logits: torch.Tensor, hf_logits: torch.Tensor) -> Agreement:
    """Per-token KL(ref || hf) and top-1 agreement of two [n, s, V] logit tensors."""
    ref = torch.log_softmax(ref_logits.double(), dim=-1)
    hf = torch.log_softmax(hf_logits.double(), dim=-1)
    kl = (ref.exp() * (ref - hf)).sum(-1)  # [n, s]
    top1 = (ref.argmax(-1) == hf.argmax(-1)).double().mean()
    return Agreement(float(kl.max()), float(kl.mean()), float(top1), int(kl.numel()))


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the transformers model saved in ``hf_dir`` (local files only)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


class MegatronModel:
    """The checkpoint's model as megatron-core builds it, on CPU in this one process (TP 1,
    PP 1: dist_checkpointing reads any saved layout into it), weights loaded."""

    def __init__(self, record: Dict, ckpt_dir: Optional[str]) -> None:
        from megatron_grpo.platform import select_platform
        from megatron_grpo.training import checkpointing
        from megatron_grpo.training.config import ModelConfig, PretrainConfig
        from megatron_grpo.training.model import build_gpt_model, init_distributed, model_parallel_init

        self.platform = select_platform(force_cpu=True)
        init_distributed(self.platform)
        cfg = PretrainConfig()
        known = {f for f in ModelConfig.__dataclass_fields__}
        cfg.model = ModelConfig(**{k: v for k, v in record["config"].items() if k in known})
        cfg.training.bf16 = False
        self.cfg = cfg
        model_parallel_init(cfg)
        self.model, _, _, _ = build_gpt_model(cfg, self.platform, int(record["tokenizer"]["vocab_size"]),
                                              padded_vocab=int(record["padded_vocab_size"]))
        self.vocab = int(record["tokenizer"]["vocab_size"])
        if ckpt_dir is not None:
            checkpointing.load_model_state(self.model, ckpt_dir)
        self.model.eval()

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n, s, tokenizer vocabulary] logits (the padded rows dropped)."""
        s = tokens.shape[1]
        mask = torch.tril(torch.ones(1, 1, s, s)) < 0.5  # True = masked, as the training step
        pos = torch.arange(s).unsqueeze(0).expand_as(tokens)
        with torch.no_grad():
            out = self.model(tokens, pos, mask)
        return out[..., :self.vocab].float()


def tokenizer_of(record: Dict):
    """The tokenizer a checkpoint was trained with (its record). A model converted from an HF
    directory without tokenizer files is checked on the text's UTF-8 bytes as ids."""
    from megatron_grpo.data.tokenizer import ByteTokenizer, HFTokenizer

    spec = record["tokenizer"]
    if spec["type"] == "hf":
        return HFTokenizer(spec["path"])
    if spec["type"] == "none" and int(spec["vocab_size"]) < 256:
        raise ValueError(f"no tokenizer recorded and a vocabulary of {spec['vocab_size']} (< 256): "
                         f"byte ids would not fit; convert from a directory with tokenizer files")
    return ByteTokenizer()


def check(megatron: "MegatronModel", hf_dir: str, tokens: torch.Tensor) -> Agreement:
    return compare(megatron.logits(tokens), hf_logits(hf_dir, tokens))


def rows_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> List[str]:
    """Names whose tensors differ (or exist on one side only)."""
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not torch.equal(a[k], b[k]))
