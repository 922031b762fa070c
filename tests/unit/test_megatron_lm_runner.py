"""The Megatron-LM runner's parts that need no Megatron-LM: refusals, CPU flags, the settings
read back from Megatron-LM's args, and the checks at the construction points (on stand-in
modules shaped like megatron.training's)."""

import argparse
import sys
import types

import pytest

from megatron_grpo.grpo.config import ConfigError, GRPOConfig
from megatron_grpo.megatron_lm import cpu, flags, refusals
from megatron_grpo.offload.config import OffloadConfig

GOOD = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=False,
            optimizer="adam", rerun_mode="disabled", fp16=False, bf16=True, cuda_graph_impl="none",
            pipeline_model_parallel_size=1, untie_embeddings_and_output_weights=False,
            num_distributed_optimizer_instances=1)


def problems(**changes):
    args = argparse.Namespace(**{**GOOD, **changes})
    return refusals.problems(args, GRPOConfig(enabled=True), OffloadConfig())


def test_a_supported_run_has_no_problem():
    assert problems() == []
    # Without --grpo nothing is refused, whatever megatron is asked to do.
    args = argparse.Namespace(**{**GOOD, "overlap_param_gather": True, "fp16": True})
    assert refusals.problems(args, GRPOConfig(), OffloadConfig()) == []


@pytest.mark.parametrize("changes, names", [
    ({"overlap_param_gather": True}, "--overlap-param-gather"),
    ({"optimizer": "muon"}, "--optimizer muon"),
    ({"optimizer": "dist_muon"}, "--optimizer dist_muon"),
    ({"rerun_mode": "validate_results"}, "add --rerun-mode disabled"),
    ({"fp16": True, "bf16": False}, "--fp16"),
    ({"overlap_grad_reduce": False}, "add --overlap-grad-reduce"),
    ({"use_distributed_optimizer": False}, "add --use-distributed-optimizer"),
    ({"use_torch_fsdp2": True}, "--use-torch-fsdp2"),
    ({"pipeline_model_parallel_size": 2}, "add --untie-embeddings-and-output-weights"),
])
def test_each_refusal_names_its_flag_and_the_fix(changes, names):
    found = problems(**changes)
    assert len(found) == 1 and names in found[0], found


def test_cuda_graphs_are_refused_only_with_the_sampled_backward():
    args = argparse.Namespace(**{**GOOD, "cuda_graph_impl": "local"})
    assert refusals.problems(args, GRPOConfig(enabled=True), OffloadConfig()) == []
    found = refusals.problems(args, GRPOConfig(enabled=True, sampled_backward=True), OffloadConfig())
    assert len(found) == 1 and "CUDA graph" in found[0]


def test_the_offload_tier_without_grpo_is_refused():
    found = refusals.problems(argparse.Namespace(**GOOD), GRPOConfig(), OffloadConfig(target="cpu"))
    assert found == ["--grpo-offload cpu places GRPO's stable tier: it needs --grpo"]


def test_check_lists_every_problem_with_the_rank():
    args = argparse.Namespace(**{**GOOD, "fp16": True, "overlap_param_gather": True})
    with pytest.raises(ConfigError) as err:
        refusals.check(args, GRPOConfig(enabled=True), OffloadConfig(), rank=3)
    text = str(err.value)
    assert text.startswith("rank 3: this Megatron-LM run cannot start with GRPO")
    assert "--fp16" in text and "--overlap-param-gather" in text


def test_cpu_flags_add_only_what_the_user_did_not_give():
    out = cpu.cpu_flags(["--transformer-impl=local", "--distributed-backend", "gloo", "--lr", "1"])
    assert out[:5] == ["--transformer-impl=local", "--distributed-backend", "gloo", "--lr", "1"]
    assert out.count("--transformer-impl") == 0 and out.count("--distributed-backend") == 1
    assert "--no-persist-layer-norm" in out and "--no-gradient-accumulation-fusion" in out


def test_settings_read_grpo_flags_from_megatron_lm_args():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    flags.add_arguments(parser)
    args = parser.parse_args(["--grpo", "--grpo-compress", "all", "--grpo-bucket-mb", "2",
                              "--grpo-metrics-file", "m.jsonl"])
    grpo, offload, runner = flags.settings(args)
    assert (grpo.enabled, grpo.compress, grpo.bucket_mb) == (True, "all", 2.0)
    assert offload.target == "none" and runner.metrics_file == "m.jsonl"
    bad = parser.parse_args(["--grpo", "--grpo-core-share", "1.5"])
    with pytest.raises(ConfigError, match="--grpo-core-share"):
        flags.settings(bad)


@pytest.fixture
def fake_training(monkeypatch):
    """Stand-ins for megatron.training.training (0.16.1's points: DDP and the optimizer)."""
    from megatron_grpo.megatron.ddp import GRPODistributedDataParallel

    pkg = types.ModuleType("megatron.training")
    pkg.__path__ = []
    training = types.ModuleType("megatron.training.training")
    training.DDP = object
    training.get_megatron_optimizer = lambda config, model_chunks, **kw: "megatron's"
    training.setup_model_and_optimizer = lambda *a, **kw: ([], "megatron's optimizer", None)
    pkg.training = training
    monkeypatch.setitem(sys.modules, "megatron.training", pkg)
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.models", None)
    monkeypatch.setitem(sys.modules, "megatron.training.models.dist_utils", None)
    return training, GRPODistributedDataParallel


def test_points_are_replaced_and_a_foreign_model_is_refused(fake_training):
    from megatron_grpo.megatron import lm_points

    training, grpo_ddp = fake_training
    replaced = lm_points.install(GRPOConfig(enabled=True), lambda chunks, opt: None, rank=1)
    assert replaced == ["megatron.training.training.DDP",
                        "megatron.training.training.get_megatron_optimizer"]
    assert issubclass(training.DDP, grpo_ddp)
    # A model chunk wrapped by another class: stop, naming what wrapped it and the points.
    with pytest.raises(ConfigError, match=r"rank 1: --grpo is on but the model chunks were wrapped "
                                          r"by object, not GRPO's DDP.*megatron.training.training.DDP"):
        training.get_megatron_optimizer(None, [object()])
    # An optimizer built elsewhere: setup_model_and_optimizer's result is checked.
    with pytest.raises(ConfigError, match="without GRPO's distributed optimizer"):
        training.setup_model_and_optimizer()


def test_a_megatron_lm_without_known_points_is_refused(monkeypatch):
    from megatron_grpo.megatron import lm_points

    monkeypatch.setitem(sys.modules, "megatron.training", None)
    monkeypatch.setitem(sys.modules, "megatron.training.training", None)
    monkeypatch.setitem(sys.modules, "megatron.training.models.dist_utils", None)
    with pytest.raises(ConfigError, match="none of the DDP construction points"):
        lm_points.install(GRPOConfig(enabled=True), lambda c, o: None, rank=0)


def test_the_metrics_file_errors_name_the_runners_flag(tmp_path):
    from megatron_grpo.training.metrics_log import JsonlLog, MetricsFileError

    (tmp_path / "file").write_text("")
    with pytest.raises(MetricsFileError, match=r"^--grpo-metrics-file .*Point --grpo-metrics-file at"):
        JsonlLog(str(tmp_path / "file" / "m.jsonl"), 0, flag="--grpo-metrics-file")
