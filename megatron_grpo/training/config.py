"""Configuration of a pretraining run: dataclasses with a docstring per field.

Every field becomes a Megatron-LM style flag (``num_layers`` -> ``--num-layers``); the field's
docstring is its ``--help`` text. A YAML file (``--config``) may set any field by the same
name (dashes or underscores); flags given explicitly on the command line override the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from megatron_grpo.grpo.config import GRPOConfig
from megatron_grpo.offload.config import OffloadConfig


@dataclass
class ModelConfig:
    """Shape of the GPT model (megatron-core GPTModel)."""

    num_layers: int = 4
    """Number of transformer layers."""
    hidden_size: int = 128
    """Transformer hidden size."""
    num_attention_heads: int = 4
    """Number of attention heads; must divide hidden_size."""
    ffn_hidden_size: Optional[int] = None
    """MLP hidden size; default 4 * hidden_size."""
    seq_length: int = 128
    """Tokens per training sample."""
    max_position_embeddings: Optional[int] = None
    """Learned position embedding table size; default seq_length."""
    make_vocab_size_divisible_by: int = 128
    """Pad the tokenizer's vocabulary to a multiple of this (times tensor parallel size)."""
    init_method_std: float = 0.02
    """Standard deviation of the weight initialisation (> 0)."""
    hidden_dropout: float = 0.0
    """Dropout after attention/MLP (0 keeps CPU runs deterministic)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    num_query_groups: Optional[int] = None
    """Grouped-query attention: key/value head groups (Llama-3: 8); None = one per head (MHA).
    Must divide --num-attention-heads and be divisible by --tensor-model-parallel-size."""
    swiglu: bool = False
    """SwiGLU MLP (gated linear unit with SiLU, megatron's gated_linear_unit) instead of GeLU."""
    normalization: str = "LayerNorm"
    """LayerNorm or RMSNorm (megatron TransformerConfig.normalization)."""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute (a learned table) or rope (rotary, no table)."""
    rotary_base: int = 10000
    """RoPE base (Llama-3: 500000); used with --position-embedding-type rope."""
    disable_bias_linear: bool = False
    """No biases in the linear layers (Llama-style; megatron add_bias_linear=False)."""
    untie_embeddings_and_output_weights: bool = True
    """Separate input embedding and output layer weights (megatron-core GPTModel's default and
    Llama's); --no-untie-embeddings-and-output-weights ties them (GPT-2; Megatron-LM's default)."""
    recompute_granularity: Optional[str] = None
    """Activation recompute: full (a layer keeps only its input and is recomputed in backward)
    or selective (megatron's choice of cheap-to-recompute attention parts); None = off."""
    recompute_method: Optional[str] = None
    """With full recompute: uniform (every --recompute-num-layers layers form one recomputed
    chunk) or block (the first --recompute-num-layers layers of each stage are recomputed)."""
    recompute_num_layers: Optional[int] = None
    """Layers per recomputed chunk (uniform) or recomputed layers per stage (block)."""


@dataclass
class ParallelConfig:
    """Model parallel layout; data parallel size = world size / (TP * PP)."""

    tensor_model_parallel_size: int = 1
    """Tensor model parallel size (TP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline model parallel size (PP)."""
    pipeline_model_parallel_layout: Optional[str] = None
    """megatron's layout of layers over pipeline stages, e.g. ``"E|t*4,L"`` (stage 0: the
    embedding alone; stage 1: four transformer layers and the loss); stages are separated by
    ``|``. Default: --num-layers split evenly, the embedding on the first stage and the output
    layer on the last."""
    ddp_bucket_size: Optional[int] = None
    """Elements per DDP gradient bucket; default megatron's max(4e7, 1e6 * dp)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1): norms, dropout and the activations they
    keep are split over the tensor-parallel ranks along the sequence."""
    overlap_grad_reduce: bool = True
    """Overlap data-parallel gradient reduce-scatter with the backward pass (megatron DDP)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (megatron DistributedOptimizer)."""
    distributed_timeout_minutes: float = 10.0
    """Timeout of torch.distributed collectives: a rank stuck waiting on a dead peer fails after it."""
    num_distributed_optimizer_instances: int = 1
    """megatron's partial distributed optimizer: split the data-parallel ranks into this many
    instances (consecutive ranks, so one per node when it equals the node count). Gradients are
    reduce-scattered inside an instance and all-reduced across instances; optimizer state is
    sharded inside an instance and replicated across them. Needs --use-distributed-optimizer
    and must divide the data-parallel size. 0: one instance per node (the nodes one pipeline
    stage spans, from torchrun's LOCAL_WORLD_SIZE, which the SLURM launch sets)."""


@dataclass
class OptimizerSettings:
    """Adam and learning-rate schedule."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = 20
    """Linear warm-up iterations."""
    lr_decay_style: str = "cosine"
    """Decay after warm-up: cosine, linear or constant."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which lr decays; default train_iters."""
    weight_decay: float = 0.01
    """AdamW weight decay (>= 0)."""
    adam_beta1: float = 0.9
    """Adam beta1, in [0, 1)."""
    adam_beta2: float = 0.95
    """Adam beta2, in [0, 1)."""
    adam_eps: float = 1e-8
    """Adam epsilon (> 0)."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold (0 disables)."""


@dataclass
class TrainingSettings:
    """Batches, iterations, precision and seed."""

    micro_batch_size: int = 4
    """Samples per micro-batch per data-parallel rank."""
    global_batch_size: int = 16
    """Samples per optimizer step over all data-parallel ranks (a multiple of mbs * dp)."""
    train_iters: int = 300
    """Optimizer steps to run (in total, counting steps done before --load); 0 with --save
    writes the initial weights as a seed checkpoint and exits."""
    seed: int = 1234
    """Random seed for initialisation and data order, in [0, 2**32 - 1]."""
    bf16: bool = False
    """Train in bf16 with fp32 master weights (megatron mixed precision)."""
    cpu: bool = False
    """Force CPU mode (gloo) even where CUDA is available."""
    exit_after_iter: Optional[int] = None
    """Stop (as if killed) after this iteration; for resume tests and dry runs."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop the run (an error naming the iteration and the ranks, exit code 2) at the first NaN or
    Inf training loss, and at the first non-finite gradient norm of an update that was applied
    (the megatron baseline applies it: its weights are then non-finite). On by default, as
    Megatron-LM's flag of this name, which raises at the first NaN in a loss or gradient.
    GRPO's skip of a step with a non-finite gradient is governed by
    --max-consecutive-skipped-steps instead. --no-check-for-nan-in-loss-and-grad trains on."""
    max_consecutive_skipped_steps: int = 10
    """Stop the run after this many optimizer steps in a row were skipped (GRPO skips a step whose
    gradient is non-finite on any rank, as megatron skips an fp16 overflow step); 0 never stops.
    An isolated bad step (one corrupt batch, one flipped value) is skipped and training goes on;
    the default 10 stops a run whose weights have stopped moving, where Megatron-LM (which does
    not skip) would have stopped at the first. The count restarts at a resume."""


@dataclass
class DataSettings:
    """Where training text comes from (megatron indexed datasets)."""

    data_path: List[str] = field(default_factory=list)
    """Dataset prefixes (PREFIX.bin/.idx from launch/preprocess_data.py), optionally weighted: 'W1 P1 W2 P2'."""
    split: str = "98,2,0"
    """Train/validation/test split by document, as in Megatron-LM."""
    data_cache_dir: Optional[str] = None
    """Where megatron writes dataset index caches; default <first prefix>_cache."""


@dataclass
class CheckpointSettings:
    """Saving and resuming (megatron dist_checkpointing, torch_dist format)."""

    save: Optional[str] = None
    """Directory to save checkpoints to."""
    save_interval: Optional[int] = None
    """Save every this many iterations (and at the end)."""
    load: Optional[str] = None
    """Directory to resume from: the iteration its latest_checkpointed_iteration.txt names, or a
    newer iter_* directory whose manifest verifies when the tracker is missing or older (a job
    killed between a save and its tracker write), with a WARNING."""
    init_from: Optional[str] = None
    """Start from the model weights of this checkpoint (any TP/PP layout), with fresh optimizer,
    iteration 0 and data position 0. --train-iters 0 --save DIR writes such a seed checkpoint."""
    load_optim: bool = True
    """With --load: also restore the optimizer state. --no-load-optim restores the weights,
    iteration, data position and lr schedule only (Adam state starts at zero; per-rank RNG and
    GRPO state start fresh, GRPO with a new exact warm-up): the way to resume in another TP/PP
    layout, whose optimizer shards do not match."""
    overwrite_checkpoints: bool = False
    """Let this run replace complete, verified iter_* directories under --save (a fresh run into
    an earlier run's directory, or a resume from an older iteration than the newest). Off: such
    a run stops at start, naming the directories, and a save never replaces a verified one."""
    override_opt_param_scheduler: bool = False
    """With --load: where this run's lr schedule (--lr, --min-lr, --lr-warmup-iters,
    --lr-decay-iters or --train-iters, --lr-decay-style, --weight-decay) or Adam's betas and eps
    differ from the checkpoint's, use this run's, from the saved position on (Megatron-LM's flag;
    a longer --train-iters then stretches the decay). Without this flag or
    --use-checkpoint-opt_param-scheduler such a resume is refused, naming each value."""
    use_checkpoint_opt_param_scheduler: bool = False
    """With --load: keep the checkpoint's lr schedule and Adam betas and eps where this run's
    differ (Megatron-LM's flag), with a WARNING naming each."""

    FLAG_NAMES = {"override_opt_param_scheduler": "--override-opt_param-scheduler",
                  "use_checkpoint_opt_param_scheduler": "--use-checkpoint-opt_param-scheduler"}
    """Megatron-LM's spelling of the two flags."""


@dataclass
class LoggingSettings:
    """Metrics, evaluation and progress output."""

    log_interval: int = 10
    """Print a progress line on rank 0 every this many iterations."""
    eval_interval: int = 100
    """Evaluate validation loss every this many iterations (and at the end)."""
    eval_iters: int = 10
    """Validation micro-batch steps (global batches) per evaluation."""
    metrics_file: Optional[str] = None
    """JSONL file, one record per iteration (written by the last rank of data-parallel rank 0)."""
    tensorboard_dir: Optional[str] = None
    """Directory for TensorBoard event files."""
    run_name: str = "run"
    """Name printed in the summary and stored in metrics records."""
    check_weight_hash_interval: Optional[int] = None
    """Every this many iterations, after the optimizer step, verify that all copies of the weights
    that must be bit-identical are (data-parallel replicas, tensor-parallel copies of replicated
    parameters, the tied embedding of the first and last pipeline stage); records weight_hash_ok
    and stops the run with an error naming the parameters on a mismatch. Off by default."""


@dataclass
class PretrainConfig:
    """One whole pretraining run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    data: DataSettings = field(default_factory=DataSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)


SECTIONS = ("model", "parallel", "optimizer", "training", "data", "checkpoint", "logging", "grpo",
            "offload")
