"""The planner's inputs: the model (``ModelSpec``, a megatron-core GPTModel as the launcher
builds it) and the cluster it runs on (``ClusterSpec``), each checked by ``validate``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ModelSpec:
    """A megatron-core GPTModel as launch/pretrain_gpt.py builds it (untied output layer; GPT-2
    style by default, Llama-style with the fields below)."""

    num_layers: int
    """Transformer layers."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention heads a."""
    ffn_hidden: Optional[int] = None
    """MLP hidden size f; None means 4 h (as --ffn-hidden-size)."""
    vocab: int = 128256
    """Tokenizer vocabulary before megatron's padding (byte tokenizer: 258)."""
    seq_length: int = 4096
    """Tokens per sample s."""
    micro_batch_size: int = 1
    """Samples per micro-batch b."""
    bf16: bool = True
    """bf16 parameters and activations with fp32 master weights; False: all fp32."""
    max_position: Optional[int] = None
    """Rows of the position embedding; None means seq_length."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times TP (Megatron-LM's rule)."""
    flash_attention: bool = False
    """True with transformer-engine's fused/flash attention (CUDA): no s x s scores are kept.
    False with megatron's local spec (CPU mode): scores and probabilities are kept."""
    dropout: bool = False
    """Hidden/attention dropout > 0: dropout masks are kept (the launcher's default is 0)."""
    softmax_in_fp32: bool = True
    """megatron's attention_softmax_in_fp32 (its default); only matters without flash attention."""
    num_query_groups: Optional[int] = None
    """Grouped-query attention: key/value groups g; None = one per head (MHA)."""
    swiglu: bool = False
    """SwiGLU MLP: fc1 is 2f wide (gate and up), SiLU gate."""
    rmsnorm: bool = False
    """RMSNorm (weight only) instead of LayerNorm (weight and bias)."""
    rope: bool = False
    """Rotary positions: no position-embedding table."""
    bias_linear: bool = True
    """Biases in the linear layers (False: --disable-bias-linear, Llama-style)."""
    recompute_granularity: Optional[str] = None
    """Activation recompute: None, "full" or "selective" (megatron_grpo/planner/activations.py)."""
    recompute_method: Optional[str] = None
    """With full recompute: "uniform" or "block"."""
    recompute_num_layers: Optional[int] = None
    """Layers per recomputed chunk (uniform) or recomputed layers per stage (block)."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all data-parallel ranks (--global-batch-size); None: one
    micro-batch per rank and step (pp of them with pipeline parallelism). More micro-batches
    than one accumulate gradients: every unit's storage stays full until the last one's sync."""
    overlap_grad_reduce: bool = True
    """megatron DDP's --overlap-grad-reduce: units sync during backward (False: after it)."""
    sequence_parallel: bool = False
    """megatron's --sequence-parallel (TP > 1): the activations TP would replicate (norms,
    dropout masks, the linear layers' inputs, a recomputed chunk's input) are split over TP
    along the sequence (Korthikanti et al. 2022, eq. 4; from the formula, not measured)."""

    def micro_batches(self, dp: int, pp: int = 1) -> int:
        """Micro-batches per rank and step."""
        if self.global_batch_size is None:
            return pp
        return self.global_batch_size // (self.micro_batch_size * dp)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def positions(self) -> int:
        return self.max_position or self.seq_length

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.heads

    @property
    def param_bytes(self) -> int:
        return 2 if self.bf16 else 4

    def padded_vocab(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab // multiple) * multiple

    def validate(self) -> None:
        for name in ("num_layers", "hidden", "heads", "vocab", "seq_length", "micro_batch_size",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelSpec.{name} must be a positive integer, got {value!r}")
        for name in ("ffn_hidden", "max_position"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"ModelSpec.{name} must be None or a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"ModelSpec.hidden ({self.hidden}) must be divisible by "
                             f"ModelSpec.heads ({self.heads})")
        if self.heads % self.groups:
            raise ValueError(f"ModelSpec.num_query_groups ({self.num_query_groups}) must divide "
                             f"ModelSpec.heads ({self.heads})")
        if self.global_batch_size is not None and (
                not isinstance(self.global_batch_size, int) or self.global_batch_size <= 0):
            raise ValueError(f"ModelSpec.global_batch_size must be None or a positive integer, "
                             f"got {self.global_batch_size!r}")
        if self.positions < self.seq_length:
            raise ValueError(f"ModelSpec.max_position ({self.max_position}) must be >= "
                             f"ModelSpec.seq_length ({self.seq_length})")


@dataclass
class ClusterSpec:
    """GPUs and links; megatron's default rank order (TP innermost, then DP, then PP)."""

    nodes: int = 1
    """Nodes in the job."""
    gpus_per_node: int = 8
    """GPUs per node."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GB (10^9 bytes)."""
    link_gbps: float = 400.0
    """Inter-node bandwidth per GPU, Gbit/s, one direction (one 400G NIC per GPU on DGX H100)."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    nvlink_gbps: float = 3600.0
    """Intra-node bandwidth per GPU, Gbit/s, one direction (H100 NVLink: 450 GB/s); used only
    when a data-parallel group fits inside one node."""
    instances: int = 1
    """megatron's partial distributed optimizer instances (--num-distributed-optimizer-instances;
    one per node is the hierarchical layout): planner_internode's inter-node bytes."""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def dp_spans_nodes(self) -> bool:
        """Whether some DP group has ranks on two nodes. Stage k owns ranks k*tp*dp onwards and
        the members of a DP group are tp ranks apart (TP rank 0's group spans the widest)."""
        first = [k * self.tp * self.dp for k in range(self.pp)]
        return any(f // self.gpus_per_node != (f + self.tp * (self.dp - 1)) // self.gpus_per_node
                   for f in first)

    @property
    def dp_link_gbps(self) -> float:
        """The slowest hop of the DP ring: every rank's bytes cross it (ring algorithm)."""
        return self.link_gbps if self.dp_spans_nodes else self.nvlink_gbps

    def validate(self, model: Optional[ModelSpec] = None) -> None:
        for name in ("nodes", "gpus_per_node", "tp", "pp", "instances"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ClusterSpec.{name} must be a positive integer, got {value!r}")
        for name in ("gpu_memory_gb", "link_gbps", "nvlink_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ClusterSpec.{name} must be > 0, got {getattr(self, name)!r}")
        if self.world % (self.tp * self.pp):
            raise ValueError(f"ClusterSpec: nodes x gpus_per_node ({self.world}) must be divisible "
                             f"by tp x pp ({self.tp} x {self.pp})")
        if self.world % (self.tp * self.pp) == 0 and self.dp % self.instances:
            raise ValueError(f"ClusterSpec.instances ({self.instances}) must divide the data-parallel "
                             f"size ({self.dp})")
        if model is not None:
            if model.num_layers % self.pp:
                raise ValueError(f"ClusterSpec.pp ({self.pp}) must divide ModelSpec.num_layers "
                                 f"({model.num_layers})")
            if model.groups % self.tp:
                raise ValueError(f"ClusterSpec.tp ({self.tp}) must divide ModelSpec.num_query_groups "
                                 f"({model.groups})")
            if model.heads % self.tp or model.ffn % self.tp:
                raise ValueError(f"ClusterSpec.tp ({self.tp}) must divide ModelSpec.heads "
                                 f"({model.heads}) and the MLP size ({model.ffn})")
            per_step = model.micro_batch_size * self.dp
            if model.global_batch_size is not None and model.global_batch_size % per_step:
                raise ValueError(f"ModelSpec.global_batch_size ({model.global_batch_size}) must be a "
                                 f"multiple of micro_batch_size x DP ({per_step})")
