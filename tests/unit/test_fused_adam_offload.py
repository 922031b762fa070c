"""The memory tier's windowed optimizer step with the optimizers megatron picks on CUDA (issue
27, item 4): TE's FusedAdam (one step counter per param group, every parameter's state made at
its first step()), apex's FusedAdam (group counter, lazy state, no empty param group) and
torch's AdamW. The windowed step (megatron_grpo/megatron/offload.py) calls the inner optimizer
once for the resident units and once per streamed unit; it must update every parameter exactly
as one call would, advance each group counter once per iteration, and let no streamed unit's
state be made before its own turn (else all of it is resident at once: the tier's peak
promise fails).

The model is a stand-in for GRPODistributedOptimizer: six units of fp32 master shards in three
param groups; unit 4 is stable (no gradient, not updated), and group 2 holds only its params,
so no windowed call ever hands that group to the optimizer."""

from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.platform.fused_adam import FusedAdamDouble
from megatron_grpo.megatron.offload import _opt_state, _window_inner_step
from megatron_grpo.offload import ChunkStore, OffloadConfig
from megatron_grpo.offload.placement import TierPlacement

TIERS = ["core", "dynamic", "dynamic", "dynamic", "stable", "dynamic"]
SIZES = [(3000, 257), (4000, 1), (2500, 900), (3300, 64), (1200, 700), (5000, 33)]
ITERS = 10


class FakeOptimizer:
    """What _window_inner_step reads of GRPODistributedOptimizer."""

    def __init__(self, inner, shards):
        self.optimizer = inner
        self.shards = shards  # [(unit, shard)]
        self.buckets = {u: object() for u in range(len(TIERS))}
        self._grpo_copied_units = set()
        self._grads_away = {}  # no gradient shard is away here (tests/unit/test_grad_shards.py)
        self.copied = []

    def bring_grads(self, unit):
        return []

    def grads_still_away(self):
        return []

    def _pairs(self):
        return [((u, i), s) for i, (u, s) in enumerate(self.shards)]

    def _bucket_of(self, model_param):
        return self.buckets[model_param[0]]

    def _copy_main_params_to_model_params(self, units=None):
        self.copied.append(set(units))


def build(kind):
    g = torch.Generator().manual_seed(11)
    shards = [(u, torch.randn(n, generator=g)) for u, pair in enumerate(SIZES) for n in pair]
    groups = [
        {"params": [s for u, s in shards if u != 4 and s.numel() % 2 == 0], "weight_decay": 0.1},
        {"params": [s for u, s in shards if u != 4 and s.numel() % 2 == 1], "weight_decay": 0.0},
        {"params": [s for u, s in shards if u == 4], "weight_decay": 0.1},
    ]
    if kind == "torch":
        inner = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    else:
        cls = type("Double", (FusedAdamDouble,), {"eager": kind == "te"})
        inner = cls(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, adam_w_mode=True)
    return FakeOptimizer(inner, shards)


def set_grads(opt, iteration):
    g = torch.Generator().manual_seed(100 + iteration)
    for u, s in opt.shards:
        grad = torch.randn(s.numel(), generator=g)
        s.grad = None if TIERS[u] == "stable" else grad


def unit_state_bytes(opt, units):
    return sum(v.numel() * v.element_size() for u, s in opt.shards if u in units
               for v in opt.optimizer.state.get(s, {}).values() if torch.is_tensor(v) and v.numel() > 1)


@pytest.mark.parametrize("kind", ["te", "apex", "torch"])
def test_windowed_step_equals_one_call_with_group_counters_and_eager_state(tmp_path, kind):
    plain, tiered = build(kind), build(kind)
    ctrl = SimpleNamespace(unit_of_bucket={id(b): u for u, b in tiered.buckets.items()},
                           step=SimpleNamespace(stable_update=False))
    cfg = OffloadConfig(chunk_mb=(16 << 10) / (1 << 20))  # 16 KiB chunks: units span chunks
    placement = TierPlacement(ChunkStore(cfg, rank=0), "cpu", stream=True)
    _window_inner_step(0, tiered, placement, ctrl)
    streamed = [u for u, t in enumerate(TIERS) if t == "dynamic"]
    try:
        for it in range(1, ITERS + 1):
            set_grads(plain, it)
            set_grads(tiered, it)
            plain.optimizer.step()
            placement.add(_opt_state(0, tiered, ctrl))
            placement.begin_step(TIERS, update_now=False, update_next=False)
            placement.ensure(update_now=False)
            if it == 1 and kind != "torch":
                tiered.optimizer.reset_peak()
            tiered.optimizer.step()
            if it == 1 and kind != "torch":
                # At no step() call of the first iteration was more state allocated than the
                # resident (core) unit's and three streamed units' (running, arriving,
                # leaving): the windows' promise. TE's eager state broke it (all units at once).
                largest = max(unit_state_bytes(tiered, {u}) for u in streamed)
                bound = unit_state_bytes(tiered, {0}) + 3 * largest
                total = unit_state_bytes(plain, set(range(len(TIERS))))
                assert tiered.optimizer.peak_state_bytes <= bound < total, \
                    (tiered.optimizer.peak_state_bytes, bound, total)
            placement.store.wait_all()
            placement.settle()
            # After the step the streamed units' state is away, none of it left resident.
            for u, s in tiered.shards:
                for v in tiered.optimizer.state.get(s, {}).values():
                    if torch.is_tensor(v) and v.numel() > 1:
                        assert (v.untyped_storage().nbytes() == 0) == (u in streamed), (it, u)
            if kind == "torch":
                steps = {float(tiered.optimizer.state[s]["step"]) for u, s in tiered.shards if u != 4}
                assert steps == {float(it)}
            else:
                # One advance of every group counter per iteration, as one step() call does
                # (group 2 is handed to no windowed call: it still advances with the others).
                counters = [g["step"] for g in tiered.optimizer.param_groups]
                assert counters == [g["step"] for g in plain.optimizer.param_groups] == [it] * 3, \
                    f"iteration {it}: group step counters {counters}, expected [{it}] * 3"
            placement.resident_all()
            for (u, a), (_, b) in zip(plain.shards, tiered.shards):
                assert torch.equal(a, b), f"iteration {it}: unit {u}'s master differs"
            assert all(set(c) <= set(streamed) for c in tiered.copied)
    finally:
        placement.close()
