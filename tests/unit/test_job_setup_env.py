"""CUDA_DEVICE_MAX_CONNECTIONS: the launchers export 1 only where megatron-core
relies on it (tensor-parallel communication overlap, TP > 1), leave it unset at TP = 1, where one
hardware queue would only hold GRPO's side stream behind the main one, and keep a value the user
set themselves (saying what it costs). launch/slurm/job_setup.py plan decides; the batch script
and launch/run_local.sh apply its GRPO_CUDA_MAX_CONNECTIONS verbatim."""

import importlib.util
import os
import shlex

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VAR = "CUDA_DEVICE_MAX_CONNECTIONS"


def job_setup():
    spec = importlib.util.spec_from_file_location("job_setup", os.path.join(REPO, "launch/slurm/job_setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan(capsys, *flags, world=4):
    job_setup().plan(world, ["--data-path", "x", *flags])
    out = capsys.readouterr().out
    return {k: shlex.split(v)[0] if v != "''" else "" for k, v in
            (line.split("=", 1) for line in out.splitlines())}


@pytest.fixture(autouse=True)
def no_user_value(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)


def test_tp1_leaves_it_unset(capsys):
    out = plan(capsys, "--global-batch-size", "16", "--grpo")
    assert out["GRPO_CUDA_MAX_CONNECTIONS"] == "" and out["GRPO_CUDA_MAX_CONNECTIONS_WARNING"] == ""
    assert out["GRPO_CUDA_MAX_CONNECTIONS_WHY"].startswith("TP=1")


@pytest.mark.parametrize("extra", [[], ["--sequence-parallel"]], ids=["tp2", "tp2-sequence-parallel"])
def test_tensor_parallel_overlap_sets_one(capsys, extra):
    out = plan(capsys, "--tensor-model-parallel-size", "2", "--global-batch-size", "8", *extra)
    assert out["GRPO_CUDA_MAX_CONNECTIONS"] == "1" and out["GRPO_CUDA_MAX_CONNECTIONS_WARNING"] == ""
    assert out["GRPO_CUDA_MAX_CONNECTIONS_WHY"].startswith("TP=2")


def test_a_users_own_value_is_kept_and_its_cost_said(capsys, monkeypatch):
    # TP=2 wants 1; the user's 8 stays (nothing exported over it), with the cost named.
    monkeypatch.setenv(VAR, "8")
    out = plan(capsys, "--tensor-model-parallel-size", "2", "--global-batch-size", "8")
    assert out["GRPO_CUDA_MAX_CONNECTIONS"] == ""
    assert out["GRPO_CUDA_MAX_CONNECTIONS_WHY"].startswith(f"{VAR}=8 kept as given")
    assert "TP=2" in out["GRPO_CUDA_MAX_CONNECTIONS_WARNING"]
    assert "weight-gradient GEMM" in out["GRPO_CUDA_MAX_CONNECTIONS_WARNING"]
    # Megatron-LM's habit (1 everywhere) at TP=1 with GRPO: kept, and the side stream named.
    monkeypatch.setenv(VAR, "1")
    out = plan(capsys, "--global-batch-size", "16", "--grpo")
    assert out["GRPO_CUDA_MAX_CONNECTIONS"] == ""
    assert "GRPO's side-stream work" in out["GRPO_CUDA_MAX_CONNECTIONS_WARNING"]
    # ... and a value that agrees with the rule needs no warning.
    out = plan(capsys, "--tensor-model-parallel-size", "2", "--global-batch-size", "8", "--grpo")
    assert out["GRPO_CUDA_MAX_CONNECTIONS"] == "" and out["GRPO_CUDA_MAX_CONNECTIONS_WARNING"] == ""


def test_the_rule_itself():
    from megatron_grpo.training.cuda_settings import cuda_max_connections

    assert cuda_max_connections(1, {}).export is None
    assert cuda_max_connections(4, {}).export == "1"
    assert cuda_max_connections(4, {VAR: ""}).export == "1"  # empty counts as unset
    kept = cuda_max_connections(1, {VAR: "1"}, grpo_enabled=False)
    assert kept.export is None and kept.warning is None  # the baseline has no side stream
    assert cuda_max_connections(1, {VAR: "1"}, grpo_enabled=True).warning is not None
    assert cuda_max_connections(1, {VAR: "32"}, grpo_enabled=True).warning is None


def test_training_warns_at_start_up_when_launched_without_the_rule():
    """A run started by the user's own torchrun (Megatron-LM's examples export 1 everywhere)."""
    from megatron_grpo.training.arguments import parse_args
    from megatron_grpo.training.cuda_settings import startup_warnings

    def warnings(environ, *flags):
        cfg = parse_args(["--data-path", "x", "--global-batch-size", "16", *flags], world_size=4)
        return startup_warnings(cfg, "transformer_engine", 258, environ)

    assert warnings({}, "--grpo") == []
    assert warnings({VAR: "1"}) == []  # the baseline: nothing of GRPO's to hold back
    [side] = warnings({VAR: "1"}, "--grpo")
    assert side.startswith(f"{VAR}=1 at TP=1") and "unset it" in side
    [unset] = warnings({}, "--tensor-model-parallel-size", "2")
    assert unset.startswith(f"{VAR} is not set at TP=2") and f"{VAR}=1" in unset
    assert warnings({VAR: "1"}, "--tensor-model-parallel-size", "2", "--grpo") == []
