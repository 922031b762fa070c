"""megatron-core 0.16.1 through 0.19.x (megatron/compat.py): the version gate, and each place
where a newer release changed what a glue override replaces. The default suite runs on 0.16.1,
so each newer behaviour is reproduced here by a double of that release's code (quoted from its
source); the glue's multi-rank checks of the same points are in
tests/multiproc/test_megatron_versions_gloo.py, and the real releases run in
tools/megatron_matrix.sh."""

import warnings
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.megatron import compat


@pytest.mark.parametrize("text, version", [("0.16.1", (0, 16, 1)), ("0.19.2", (0, 19, 2)),
                                           ("0.20.0rc1", (0, 20, 0)), ("0.19.0+abc", (0, 19, 0)),
                                           ("1.0", (1, 0, 0))])
def test_versions_are_read_as_release_numbers(text, version):
    assert compat.parse_version(text) == version


@pytest.mark.parametrize("version, ok", [((0, 16, 1), True), ((0, 17, 1), True), ((0, 18, 2), True),
                                         ((0, 19, 2), True), ((0, 16, 0), False), ((0, 15, 3), False),
                                         ((0, 20, 0), False)])
def test_the_gate_stops_outside_the_range_with_one_line(version, ok, monkeypatch):
    monkeypatch.delenv(compat.SKIP_CHECK_ENV, raising=False)
    if ok:
        compat.check_version(version)
        return
    found = ".".join(map(str, version))
    with pytest.raises(ImportError) as err:
        compat.check_version(version)
    line = str(err.value)
    assert "\n" not in line
    assert f"megatron-core {found} is installed" in line
    assert "supports megatron-core >=0.16.1,<0.20" in line
    assert "pip install 'megatron-core>=0.16.1,<0.20'" in line


def test_the_gate_can_be_passed_on_purpose_with_a_warning(monkeypatch):
    monkeypatch.setenv(compat.SKIP_CHECK_ENV, "1")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compat.check_version((0, 20, 0))
    assert any("results unverified" in str(w.message) for w in seen)


def test_the_installed_version_passes_the_gate():
    assert compat.version_problem(compat.mcore_version()) is None


def test_setup_py_takes_the_range_and_the_cpu_setup_pins():
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    setup = open(os.path.join(root, "setup.py")).read()
    assert f'"megatron-core{compat.SUPPORTED_RANGE}"' in setup and '"megatron-core==' not in setup
    assert (compat.SUPPORTED_MIN, compat.SUPPORTED_BELOW) == ((0, 16, 1), (0, 20, 0))
    assert compat.SUPPORTED_RANGE == ">=0.16.1,<0.20"
    assert '"megatron-core==0.16.1"' in open(os.path.join(root, "launch", "setup_env.sh")).read()


# -- 1. the gradient-norm list under both names ------------------------------------------------
def _opt_with_one_gradient_away(monkeypatch):
    """A GRPODistributedOptimizer with two shards: one resident, one whose gradient the memory
    tier holds away (its norm, 3.0, taken at release). megatron 0.19's DistributedOptimizer
    gets its ``get_grads_for_grad_norm(grad_norm_group=None)`` (the 0.19.0 rename), built like
    0.19.2's ``_filter_grads_for_norm``: the params' ``.grad``, None skipped, megatron's order."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_grpo.megatron.optimizer import GRPODistributedOptimizer

    def get_grads_for_grad_norm_019(self, grad_norm_group=None):
        keep = (lambda p: getattr(p, "grad_norm_group", None) == grad_norm_group)
        return [p.grad for p in self.get_parameters() if p.grad is not None and keep(p)]

    monkeypatch.setattr(DistributedOptimizer, "get_grads_for_grad_norm", get_grads_for_grad_norm_019,
                        raising=False)
    resident = torch.nn.Parameter(torch.zeros(4))
    resident.grad = torch.full((4,), 2.0)
    away = torch.nn.Parameter(torch.zeros(6))
    opt = GRPODistributedOptimizer.__new__(GRPODistributedOptimizer)
    opt.get_parameters = lambda: [away, resident]
    opt._grads_away = {3: [(None, away)]}
    opt.grad_shards = SimpleNamespace(norm_of=lambda shard: torch.tensor(3.0) if shard is away else None)
    return opt, resident, away


def test_gradients_away_stay_in_the_norm_under_megatron_0_19s_name(monkeypatch):
    opt, resident, away = _opt_with_one_gradient_away(monkeypatch)
    grads = opt.get_grads_for_grad_norm()
    assert [g.tolist() for g in grads] == [[3.0], [2.0] * 4]       # megatron's order kept
    norm = torch.linalg.vector_norm(torch.cat([g.view(-1) for g in grads])).item()
    assert norm == pytest.approx((9.0 + 4 * 4.0) ** 0.5)          # not 4.0: nothing dropped
    assert away.grad is None                                       # the stand-in is gone again


def test_the_stand_in_holds_no_memory_and_megatrons_filters_still_apply(monkeypatch):
    opt, resident, away = _opt_with_one_gradient_away(monkeypatch)
    away.grad_norm_group = "mtp"  # 0.19: a separate norm group, not in the main norm
    assert [g.tolist() for g in opt.get_grads_for_grad_norm()] == [[2.0] * 4]
    assert [g.tolist() for g in opt.get_grads_for_grad_norm("mtp")] == [[3.0]]
    seen = []
    opt.grad_shards = SimpleNamespace(norm_of=lambda shard: seen.append(shard.grad) or torch.tensor(3.0))
    opt.get_grads_for_grad_norm("mtp")
    assert seen[0].stride() == (0,) and seen[0].untyped_storage().nbytes() == 4


# -- 4. the stream megatron's hierarchical finish waits on ------------------------------------
@pytest.mark.parametrize("version, which", [((0, 16, 1), "default"), ((0, 17, 1), "current"),
                                            ((0, 19, 2), "current")])
def test_the_hierarchical_finish_waits_on_the_stream_megatron_waits_on(version, which, monkeypatch):
    """megatron 0.16.1: ``torch.cuda.default_stream().wait_stream(self.communication_stream)``;
    0.17.1 and later: ``torch.cuda.current_stream()`` (param_and_grad_buffer.py,
    finish_grad_sync). GRPO's _complete must wait where megatron's finish would."""
    from megatron_grpo.megatron.bucket_group import GRPOBucketGroup

    waited = []
    streams = {name: SimpleNamespace(wait_stream=lambda s, name=name: waited.append((name, s)))
               for name in ("default", "current")}
    monkeypatch.setattr(torch.cuda, "default_stream", lambda *a: streams["default"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: streams["current"])
    monkeypatch.setattr(compat, "mcore_version", lambda: version)
    comm = object()
    group = GRPOBucketGroup.__new__(GRPOBucketGroup)
    group.__dict__.update(
        grad_reduce_handle=SimpleNamespace(wait=lambda: None), communication_stream=comm,
        ddp_config=SimpleNamespace(num_distributed_optimizer_instances=2, overlap_grad_reduce=True),
        grpo=SimpleNamespace(wait_timer=lambda: __import__("contextlib").nullcontext(),
                             join_side_stream=lambda: None),
        grpo_storage=None)
    group._complete()
    assert waited == [(which, comm)]


# -- 5. a precomputed bucket layout --------------------------------------------------------------
def test_a_layout_handed_to_ddp_is_recomputed_from_grpos_bucket_size(monkeypatch):
    """megatron 0.18+: ``DistributedDataParallel(..., full_param_layout=...)``, precomputed by
    Megatron-LM's get_model from ddp_config.bucket_size, bypasses the size GRPO keeps."""
    from megatron.core.distributed import DistributedDataParallel

    from megatron_grpo.grpo.config import GRPOConfig
    from megatron_grpo.megatron.ddp import GRPODistributedDataParallel

    seen = {}

    def init_018(self, config, ddp_config, module, disable_bucketing=False, pg_collection=None,
                 full_param_layout=None):
        seen["layout"] = full_param_layout
        self.bucket_size = None  # as megatron does without overlap: GRPO's size stands
        seen["bucket_size"] = self.bucket_size

    monkeypatch.setattr(DistributedDataParallel, "__init__", init_018)
    ddp_config = SimpleNamespace(bucket_size=1000, use_distributed_optimizer=True)
    precomputed = object()
    GRPODistributedDataParallel(None, ddp_config, None, full_param_layout=precomputed,
                                grpo_config=GRPOConfig(enabled=True, release_grads=False))
    assert seen == {"layout": None, "bucket_size": 1000}
    # GRPO off: megatron's class in every respect, the layout reaches it.
    GRPODistributedDataParallel(None, ddp_config, None, full_param_layout=precomputed,
                                grpo_config=GRPOConfig(enabled=False))
    assert seen["layout"] is precomputed


# -- 6. options of megatron 0.17-0.19, read with getattr ----------------------------------------
def _install(ddp=None, tf=None):
    from megatron_grpo.grpo.config import GRPOConfig
    from megatron_grpo.megatron.bucket_install import install

    class Group:
        buckets = [SimpleNamespace(grad_data=torch.zeros(8))]

    group = Group()
    ddp_config = SimpleNamespace(overlap_param_gather=False, num_distributed_optimizer_instances=1,
                                 grad_reduce_in_fp32=True, **(ddp or {}))
    chunk = SimpleNamespace(ddp_config=ddp_config, config=SimpleNamespace(**(tf or {})))
    ctrl = SimpleNamespace(units=[SimpleNamespace(group=group, index=0)], dp_size=2,
                           config=GRPOConfig(enabled=True), powersgd=None)
    install([chunk], ctrl)
    return group


@pytest.mark.parametrize("ddp, tf, message", [
    ({"fp4_param_gather": True}, {}, r"fp4 parameters \(DistributedDataParallelConfig.fp4_param_gather\)"),
    ({"param_name_patterns_for_fp32_local_accumulation": ("all",)}, {},
     r"param_name_patterns_for_fp32_local_accumulation .*grad_reduce_in_fp32=True"),
    ({"num_buckets": 8}, {}, r"num_buckets=8: .*--grpo-bucket-mb"),
    ({}, {"gtp_weight_remat_size": 2}, r"GTP weight remat \(gtp_weight_remat_size > 1"),
    ({}, {"expert_gtp_weight_remat_size": 4}, r"GTP weight remat \(expert_gtp_weight_remat_size > 1"),
])
def test_new_megatron_options_are_refused_at_install_naming_them(ddp, tf, message):
    with pytest.raises(ValueError, match=rf"rank 0: GRPO does not support .*{message}"):
        _install(ddp, tf)


def test_their_defaults_are_accepted():
    group = _install({"fp4_param_gather": False, "param_name_patterns_for_fp32_local_accumulation": (),
                      "num_buckets": None}, {"gtp_weight_remat_size": 1, "expert_gtp_weight_remat_size": 1})
    assert group.grpo is not None


def test_the_layer_wise_optimizer_is_refused_before_megatron_builds():
    from megatron_grpo.megatron.optimizer import get_grpo_optimizer

    config = SimpleNamespace(use_distributed_optimizer=True, use_layer_wise_distributed_optimizer=True)
    with pytest.raises(ValueError, match=r"rank 0: GRPO does not support the layer-wise distributed "
                                         r"optimizer \(OptimizerConfig.use_layer_wise_distributed_optimizer\)"):
        get_grpo_optimizer(config, [])


def test_flextron_router_gradients_are_read_after_the_sync():
    """megatron 0.19's finalize_model_grads all-reduces params marked flextron_router_pp_sync
    over pipeline stages (``_allreduce_router_grads``) after the DP sync: their gradient must
    outlive the release of its bucket."""
    from megatron_grpo.megatron.grad_storage import reads_after_sync

    router = torch.nn.Parameter(torch.zeros(2))
    router.flextron_router_pp_sync = True
    assert reads_after_sync(router, SimpleNamespace(flextron=True), tp_size=1, pp_size=2)
    assert not reads_after_sync(router, SimpleNamespace(flextron=True), tp_size=1, pp_size=1)
    assert not reads_after_sync(router, SimpleNamespace(flextron=False), tp_size=1, pp_size=2)
