"""Model options that a GRPO feature cannot carry, refused at build, before the first step:
per-token loss with the delayed stable tier and CUDA graphs with the sampled backward (in
get_grpo_optimizer, before megatron builds, and again in the optimizer's bind, for a script that
builds it without grpo_config), and megatron 0.19's separate grad-norm groups (multi-token
prediction) with gradient shards on the memory tier (in build_placement)."""

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
PER_TOKEN = (r"rank 0: --grpo-stable-mode delayed does not support megatron's per-token loss "
             r"\(TransformerConfig.calculate_per_token_loss, Megatron-LM "
             r"--calculate-per-token-loss\).*divided again.*--grpo-stable-mode frozen or compressed")
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


# -- per-token loss with the delayed stable tier ---------------------------------------------
# megatron divides the gradient buffer by the step's token count after the sync; the delayed
# accumulator took each step's gradient after that division, and the update step's sync sent
# the sum on to be divided again by its own count: earlier steps applied at 1/(N_t N_T).
def test_per_token_loss_with_a_delayed_stable_tier_is_refused_before_megatron_builds():
    chunk = SimpleNamespace(config=_tf(calculate_per_token_loss=True))
    with pytest.raises(ValueError, match=PER_TOKEN):
        get_grpo_optimizer(_opt_config(), [chunk], GRPOConfig(enabled=True, **STABLE))


def test_per_token_loss_with_a_delayed_stable_tier_is_refused_at_bind():
    # A script of its own builds the optimizer without grpo_config; bind comes before step 1.
    opt = _unbound_optimizer(_tf(calculate_per_token_loss=True))
    with pytest.raises(ValueError, match=PER_TOKEN):
        opt.bind(SimpleNamespace(config=GRPOConfig(enabled=True, **STABLE)))
    assert opt.grpo is None  # nothing bound


@pytest.mark.parametrize("grpo, tf", [
    ({**STABLE, "stable_mode": "frozen"}, {"calculate_per_token_loss": True}),
    ({**STABLE, "stable_mode": "compressed"}, {"calculate_per_token_loss": True}),
    ({}, {"calculate_per_token_loss": True}),    # the default shares: no stable tier at all
    (STABLE, {}),                                 # delayed, per-sequence loss (megatron's default)
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


def _placement_inputs(grad_norm_group=None, late=False, tag="shard"):
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
