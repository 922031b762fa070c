"""Model options that a GRPO feature cannot carry, refused at build, before the first step:
per-token loss with error feedback (a tier compressed every step) or with the delayed stable
tier, and CUDA graphs with the sampled backward (in get_grpo_optimizer, before megatron builds,
and again in the optimizer's bind, for a script that builds it without grpo_config), and, when
the memory tier is built (build_placement), gradient shards on it (--grpo-offload-grads) with
per-token loss or with megatron 0.19's separate grad-norm groups (multi-token prediction)."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megatron_grpo.grpo.config import GRPOConfig
from megatron_grpo.megatron import offload
from megatron_grpo.megatron.optimizer import GRPODistributedOptimizer, get_grpo_optimizer
from megatron_grpo.megatron.options import check_model_options
from megatron_grpo.offload import OffloadConfig

STABLE = {"core_share": 0.15, "dynamic_share": 0.65, "stable_share": 0.2}
# Every tier exact but a delayed stable one: what the delayed refusal alone is about.
EXACT_STABLE = {"core_share": 0.8, "dynamic_share": 0.0, "stable_share": 0.2, "core_compressor": "none"}
EXACT = {"core_share": 1.0, "dynamic_share": 0.0, "core_compressor": "none"}
PER_TOKEN = (r"rank 0: --grpo-stable-mode delayed does not support megatron's per-token loss "
             r"\(TransformerConfig.calculate_per_token_loss, Megatron-LM "
             r"--calculate-per-token-loss\).*divided again.*--grpo-stable-mode frozen \(or "
             r"--grpo-stable-share 0\), or without --calculate-per-token-loss")
FEEDBACK = (r"rank {rank}: megatron's per-token loss \(TransformerConfig.calculate_per_token_loss, "
            r"Megatron-LM --calculate-per-token-loss\) does not work with GRPO's error feedback "
            r"\({named}\): .*next step's count.*Run without --calculate-per-token-loss, or with "
            r"every sync exact \(--grpo-compress none; tiers, importance and the memory tier still "
            r"run\)")
GRAPHS = (r"rank 0: --grpo-sampled-backward does not support CUDA graphs \({}.*replay.*"
          r"--cuda-graph-impl none, or without --grpo-sampled-backward")


def _tf(**options):
    """A real TransformerConfig of the installed release (its own attribute names)."""
    return TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, **options)


def _opt_config():
    return SimpleNamespace(use_distributed_optimizer=True, bf16=True, fp16=False, loss_scale=None)


def _unbound_optimizer(tf_config):
    opt = GRPODistributedOptimizer.__new__(GRPODistributedOptimizer)
    opt.model_chunks = [SimpleNamespace(config=tf_config)]
    opt.shard_fp32_groups = []
    return opt


# -- per-token loss with error feedback ------------------------------------------------------
class _Lossless:
    """A compressor that sends fp32 as is: whatever reaches the receivers is what was owed."""

    def compress_rows(self, x):
        return x.contiguous().view(torch.uint8).clone()

    def decompress_rows(self, payload, numel, out=None):
        values = payload.contiguous().view(torch.float32).view(payload.shape[0], numel)
        return values.clone() if out is None else out.copy_(values)


def _megatron_per_token_steps(counts, compressor, residual=None, dp=2, n=512):
    """Steps of megatron's per-token loss through GRPO's error feedback, without the network:
    each rank adds its residual into its token-summed gradient and sends C(g + r); megatron sums
    what arrives and divides by the step's count after the sync (finalize_model_grads). Returns
    (sum of the applied gradients, sum of g_t / N_t: what megatron applies without compression,
    what error feedback still owes in applied units)."""
    from megatron_grpo.comm.error_feedback import ErrorFeedback

    gen = torch.Generator().manual_seed(5)
    efs = [ErrorFeedback() for _ in range(dp)]
    if residual is not None:  # owed from a step before these, whose count was counts[0]
        for ef in efs:
            ef._residuals["b"] = residual.clone()
    applied = torch.zeros(n, dtype=torch.float64)
    exact = torch.zeros(n, dtype=torch.float64)
    if residual is not None:
        exact += dp * residual.double() / counts[0]
        counts = counts[1:]
    for count in counts:
        summed = torch.zeros(n, dtype=torch.float64)
        for rank, ef in enumerate(efs):
            g = torch.randn(n, generator=gen) * (count / dp) ** 0.5 + 0.01 * count / dp
            exact += g.double() / count
            grad = g.clone()
            payload = compressor.compress_rows(ef.owed("b", grad).view(dp, -1))
            ef.stage("b", grad, payload, rank, compressor)  # taken before megatron's division
            ef.commit()
            summed += compressor.decompress_rows(payload, n // dp).view(-1).double()
        applied += summed / count
    owed = sum(ef.residual("b").double() for ef in efs) / counts[-1]
    return applied, exact, owed


def test_a_residual_lands_divided_by_the_next_steps_count():
    """Why per-token loss is refused with error feedback: the residual is taken in step t's raw
    token sums and added into step t+1's gradient before the sync, so megatron divides it by
    N_{t+1}, not N_t. Nothing later delivers the difference."""
    # A residual of 1 owed from a step of 100 tokens, one lossless step of 300 after it: a
    # third of what was owed arrives, and no residual is left to bring the rest.
    applied, exact, owed = _megatron_per_token_steps([100.0, 300.0], _Lossless(),
                                                     residual=torch.ones(512))
    assert float(owed.abs().max()) == 0.0
    lost = (exact - applied).mean() / (2 / 100.0)  # both ranks owed 1/100 per element
    assert abs(float(lost) - 2 / 3) < 1e-5
    # int4 over 20 steps: with one count the applied sum plus what is still owed is the exact
    # sum (error feedback's identity); with counts that vary by 20 % it misses by as much as
    # error feedback owes, and with counts of 1000 and 3000 in turn by several times that.
    from megatron_grpo.comm.compress import Int4Compressor

    def miss(counts):
        applied, exact, owed = _megatron_per_token_steps(counts, Int4Compressor(256))
        return float((applied + owed - exact).norm() / exact.norm()), float(owed.norm() / exact.norm())

    assert miss([1000.0] * 20)[0] < 1e-6
    varied, owed_varied = miss([1000.0, 1200.0, 900.0, 1100.0] * 5)
    swings, owed_swings = miss([1000.0, 3000.0] * 10)
    assert varied > 0.5 * owed_varied and varied > 1e-3
    assert swings > 2 * owed_swings


@pytest.mark.parametrize("grpo, named", [
    ({}, "--grpo-dynamic-share 0.85 with --grpo-compressor int4, --grpo-core-compressor int8"),
    ({"core_share": 1.0, "dynamic_share": 0.0}, "--grpo-core-compressor int8"),
    ({"core_compressor": "none", "compressor": "int8"}, "--grpo-dynamic-share 0.85 with --grpo-compressor int8"),
    ({**EXACT_STABLE, "stable_mode": "compressed"}, "--grpo-stable-mode compressed"),
    ({"compress": "inter-node"}, "--grpo-dynamic-share 0.85 with --grpo-compressor int4, "
                                 "--grpo-core-compressor int8"),  # decided after the build
])
def test_per_token_loss_with_error_feedback_is_refused_at_build(grpo, named):
    config = GRPOConfig(enabled=True, **grpo)
    chunk = SimpleNamespace(config=_tf(calculate_per_token_loss=True))
    # Before megatron's parallel state exists the data-parallel size is not known: refused.
    with pytest.raises(ValueError, match=FEEDBACK.format(rank=0, named=named)):
        get_grpo_optimizer(_opt_config(), [chunk], config)
    opt = _unbound_optimizer(_tf(calculate_per_token_loss=True))
    with pytest.raises(ValueError, match=FEEDBACK.format(rank=0, named=named)):
        opt.bind(SimpleNamespace(config=config, dp_size=2))
    assert opt.grpo is None  # nothing bound


@pytest.mark.parametrize("grpo, dp_size", [
    (EXACT, 2),                                                        # every tier exact
    ({**EXACT_STABLE, "stable_mode": "frozen"}, 2),                    # and a frozen stable tier
    ({}, 1),                                                           # one rank: nothing is sent
    ({"core_share": 1.0, "dynamic_share": 0.0, "core_sync_interval": 4}, 2),  # periodic: exact inside
    ({"compress": "none"}, 2),                                         # the defaults, every sync exact
])
def test_per_token_loss_without_a_compressed_sync_is_accepted(grpo, dp_size):
    check_model_options(GRPOConfig(enabled=True, **grpo), [_tf(calculate_per_token_loss=True)],
                        rank=0, dp_size=dp_size)
    opt = _unbound_optimizer(_tf(calculate_per_token_loss=True))
    opt.bind(SimpleNamespace(config=GRPOConfig(enabled=True, **grpo), dp_size=dp_size,
                             outer=SimpleNamespace(active=False)))


# -- per-token loss with the delayed stable tier ---------------------------------------------
# megatron divides the gradient buffer by the step's token count after the sync; the delayed
# accumulator took each step's gradient after that division, and the update step's sync sent
# the sum on to be divided again by its own count: earlier steps applied at 1/(N_t N_T).
def test_per_token_loss_with_a_delayed_stable_tier_is_refused_before_megatron_builds():
    chunk = SimpleNamespace(config=_tf(calculate_per_token_loss=True))
    with pytest.raises(ValueError, match=PER_TOKEN):
        get_grpo_optimizer(_opt_config(), [chunk], GRPOConfig(enabled=True, **EXACT_STABLE))


def test_per_token_loss_with_a_delayed_stable_tier_is_refused_at_bind():
    # A script of its own builds the optimizer without grpo_config; bind comes before step 1.
    opt = _unbound_optimizer(_tf(calculate_per_token_loss=True))
    with pytest.raises(ValueError, match=PER_TOKEN):
        opt.bind(SimpleNamespace(config=GRPOConfig(enabled=True, **EXACT_STABLE)))
    assert opt.grpo is None  # nothing bound


@pytest.mark.parametrize("grpo, tf", [
    ({**EXACT_STABLE, "stable_mode": "frozen"}, {"calculate_per_token_loss": True}),
    (EXACT, {"calculate_per_token_loss": True}),  # no stable tier at all
    (STABLE, {}),                                 # delayed, per-sequence loss (megatron's default)
    ({}, {}),                                     # the defaults, per-sequence loss
])
def test_what_divides_each_steps_gradient_once_is_accepted(grpo, tf):
    check_model_options(GRPOConfig(enabled=True, **grpo), [_tf(**tf)], rank=0)


# -- CUDA graphs with the sampled backward ------------------------------------------------------
@pytest.mark.parametrize("tf, named", [
    ({"cuda_graph_impl": "local"}, "cuda_graph_impl='local'"),
    ({"cuda_graph_impl": "transformer_engine"}, "cuda_graph_impl='transformer_engine'"),
    ({"enable_cuda_graph": True}, "cuda_graph_impl='local', enable_cuda_graph"),
    ({"external_cuda_graph": True}, "cuda_graph_impl='transformer_engine', external_cuda_graph"),
])
def test_cuda_graphs_with_the_sampled_backward_are_refused_at_build(tf, named):
    grpo = GRPOConfig(enabled=True, sampled_backward=True)
    with pytest.raises(ValueError, match=GRAPHS.format(named)):
        get_grpo_optimizer(_opt_config(), [SimpleNamespace(config=_tf(**tf))], grpo)
    opt = _unbound_optimizer(_tf(**tf))
    with pytest.raises(ValueError, match=GRAPHS.format(named)):
        opt.bind(SimpleNamespace(config=grpo))


@pytest.mark.parametrize("grpo, tf", [
    ({"sampled_backward": True}, _tf(cuda_graph_impl="none")),
    ({"sampled_backward": True}, SimpleNamespace()),       # a release without these options
    ({"sampled_backward": True}, SimpleNamespace(enable_cuda_graph=False, cuda_graph_impl=None)),
    ({}, _tf(cuda_graph_impl="local")),                    # graphs without the sampled backward
])
def test_no_graphs_or_no_sampled_backward_is_accepted(grpo, tf):
    check_model_options(GRPOConfig(enabled=True, **grpo), [tf, None], rank=0)


# -- separate grad-norm groups (multi-token prediction) with --grpo-offload-grads ------------
class _ReachedTheStore(Exception):
    pass


def _placement_inputs(grad_norm_group=None, late=False, tag="shard", per_token=False):
    """One GRPO optimizer with one parameter in one unit whose bucket releases its gradient."""
    model_param = torch.nn.Parameter(torch.zeros(4))
    shard = torch.nn.Parameter(torch.zeros(4))
    if grad_norm_group is not None:  # megatron 0.19 tags the model param and copies it over
        setattr(shard if tag == "shard" else model_param, "grad_norm_group", grad_norm_group)
    grads = SimpleNamespace(late=[model_param] if late else [], shard_len=2)
    bucket = SimpleNamespace(grad_data=torch.zeros(4), grpo_grads=grads)
    group = SimpleNamespace(buckets=[bucket], grpo_storage=object())
    ctrl = SimpleNamespace(config=GRPOConfig(enabled=True), units=[SimpleNamespace(group=group)],
                           unit_of_bucket={id(bucket): 0})
    opt = GRPODistributedOptimizer.__new__(GRPODistributedOptimizer)
    opt._pairs = lambda: iter([(model_param, shard)])
    opt._bucket_of = lambda p: bucket
    opt.config = SimpleNamespace(log_num_zeros_in_grad=False)
    opt.optimizer = SimpleNamespace()  # the inner optimizer: no TE master weights
    opt.model_chunks = [SimpleNamespace(config=_tf(calculate_per_token_loss=per_token))]
    return opt, ctrl


@pytest.fixture
def store_reached(monkeypatch):
    def reached(*args, **kwargs):
        raise _ReachedTheStore()
    monkeypatch.setattr(offload, "ChunkStore", reached)


@pytest.mark.parametrize("tag", ["shard", "model"])
def test_a_separate_norm_group_is_refused_when_the_placement_is_built(store_reached, tag):
    # Before the store exists, so before step 1 (not at the first step that held one away).
    opt, ctrl = _placement_inputs("mtp", tag=tag)
    with pytest.raises(ValueError, match=r"rank 3: GRPO's memory tier would hold away the gradient "
                                         r"of a parameter in megatron's separate grad-norm group "
                                         r"'mtp' \(unit 0; multi-token prediction\).*"
                                         r"--no-grpo-offload-grads"):
        offload.build_placement(OffloadConfig(target="cpu"), opt, ctrl, rank=3)


@pytest.mark.parametrize("group, late, grads", [
    (None, False, True),    # no separate group
    ("mtp", True, True),    # a late param keeps its own copy: it never leaves
    ("mtp", False, False),  # --no-grpo-offload-grads: gradients stay, optimizer state moves
])
def test_what_never_goes_away_reaches_the_store(store_reached, group, late, grads):
    opt, ctrl = _placement_inputs(group, late=late)
    with pytest.raises(_ReachedTheStore):
        offload.build_placement(OffloadConfig(target="cpu", grads=grads), opt, ctrl, rank=3)


# -- per-token loss with --grpo-offload-grads ---------------------------------------------------
# megatron divides the gradients by the step's token count after the sync, when a streamed
# unit's shard is already on host memory or SSD: refused before the store exists, not at the
# first step's division (BucketGrads.scale keeps that check as a guard).
def test_per_token_loss_with_gradient_shards_on_the_memory_tier_is_refused_at_build(store_reached):
    opt, ctrl = _placement_inputs(per_token=True)
    with pytest.raises(ValueError, match=r"rank 3: --grpo-offload-grads does not support megatron's "
                                         r"per-token loss \(TransformerConfig.calculate_per_token_loss, "
                                         r"Megatron-LM --calculate-per-token-loss\).*"
                                         r"Run with --no-grpo-offload-grads \(optimizer state still "
                                         r"moves\), or without --calculate-per-token-loss"):
        offload.build_placement(OffloadConfig(target="cpu"), opt, ctrl, rank=3)


def test_per_token_loss_with_gradients_kept_reaches_the_store(store_reached):
    opt, ctrl = _placement_inputs(per_token=True)
    with pytest.raises(_ReachedTheStore):
        offload.build_placement(OffloadConfig(target="cpu", grads=False), opt, ctrl, rank=3)
