"""Shared pytest fixtures, and the environment every test runs in.

The suite sets what it needs here, so `python -m pytest tests` behaves the same whether it is
started by hand, by the README's command or by CI: one intra-op thread (results compared bit
for bit must not depend on how many cores the machine has) and no Python warnings noise from
subprocesses (tests/harness.py passes the same settings to every torchrun it starts).
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported: it reads this once
os.environ.setdefault("PYTHONWARNINGS", "ignore")


import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_grpo.platform.ports import free_port as _free_port  # noqa: E402

torch.set_num_threads(1)


def _slow_selected(config) -> bool:
    import re

    expr = config.getoption("markexpr") or ""
    return os.environ.get("MEGATRON_GRPO_SLOW") == "1" or re.search(r"(?<!not )\bslow\b", expr) is not None


# Beyond the default suite's 15 minutes on 2 cores: each runs with `-m slow`, and the fast test
# named beside it keeps the same feature covered in the default suite (multi-rank where the
# feature is). Measured with --durations=0 on a fresh clone (seconds, 2026-12-03).
SLOW = {
    "multiproc/test_grpo.py::test_quality_within_2_percent_of_baseline": "bench quality; test_all_core_is_bit_identical_to_baseline",  # 20
    "multiproc/test_grpo.py::test_same_collectives_on_every_rank_with_padding_shards[--no-grpo-compress-param-gather]": "its other parameter",  # 9
    "multiproc/test_grpo.py::test_four_ranks_tp_pp_dp[layout2]": "test_four_ranks_tp_pp_dp[layout0]",  # 8
    "multiproc/test_grpo.py::test_grpo_collectives_use_the_group_device[layout1]": "its layout0",  # 9
    "multiproc/test_grpo.py::test_healthy_compressors_are_left_alone[topk-0.3-0.98]": "its int8 case",  # 6
    "multiproc/test_grpo.py::test_non_finite_gradient_skips_the_step_and_keeps_grpo_state[12:core-frozen]": "its stable-delayed case",  # 5
    "multiproc/test_grpo.py::test_non_finite_gradient_skips_the_step_and_keeps_grpo_state[13:dynamic-frozen]": "its stable-delayed case",  # 5
    "multiproc/test_grpo.py::test_non_finite_gradient_skips_the_step_and_keeps_grpo_state[14:stable-delayed]": "its iteration-16 case",  # 5
    "multiproc/test_grpo.py::test_tensor_parallel_copies_of_replicated_parameters_stay_identical": "test_four_ranks_tp_pp_dp[layout0], test_weight_check (TP)",  # 9
    "multiproc/test_convert.py::test_llama_tp2_pp2_grpo_to_hf_and_back": "test_models_made_by_transformers_round_trip[llama]",  # 33
    "multiproc/test_convert.py::test_a_run_with_the_shipped_bpe_tokenizer_converts_with_its_tokenizer": "unit/test_bpe*, round trips",  # 16
    "multiproc/test_convert.py::test_gpt2_style_tied_head_to_hf": "test_models_made_by_transformers_round_trip[gpt2]",  # 11
    "multiproc/test_grad_release.py::test_pipeline_stages_release_bit_identically": "unit/test_grad_storage (late copies), test_grpo four ranks",  # 19
    "multiproc/test_grad_release.py::test_release_is_bit_identical_and_leaves_nothing[delayed-int8core]": "its frozen and no-overlap cases",  # 11
    "multiproc/test_grad_release.py::test_release_is_bit_identical_and_leaves_nothing[compressed-1mb]": "its frozen and no-overlap cases",  # 11
    "multinode/test_slurm_faults.py::test_killed_rank_fails_the_job_fast_and_the_next_job_resumes": "reliability/test_launcher_death, test_sigterm",  # 44
    "multiproc/test_hierarchy.py::test_hierarchical_grpo_resume_is_bit_identical": "test_grpo resume; test_megatron_hierarchy_sends_a_third_between_instances",  # 24
    "multiproc/test_hierarchy.py::test_grpo_hierarchy_with_tensor_parallel_keeps_every_copy_identical": "test_megatron_hierarchy_sends_a_third_between_instances",  # 10
    "multiproc/test_stable_compressed.py::test_resume_with_stable_residuals_is_bit_identical": "test_grpo resume; test_stable_int2_every_step_copies_identical",  # 21
    "multiproc/test_stable_compressed.py::test_bad_stable_tier_falls_back_to_the_dynamic_compressor_and_resumes": "test_grpo::test_remediation_catches_a_damaging_compressor",  # 19
    "multiproc/test_stable_compressed.py::test_stable_int2_between_instances_keeps_every_copy_identical": "test_stable_int2_with_tensor_parallel_copies_identical",  # 11
    "multiproc/test_reshard.py::test_resume_at_another_data_parallel_size[1]": "its [4] case",  # 20
    "multiproc/test_reshard.py::test_tensor_parallel_2_to_1_with_no_load_optim": "test_another_tensor_parallel_layout_is_refused",  # 20
    "unit/test_gpu_check_script.py::test_cpu_dry_run_passes_every_phase": "the script's other tests; the phases' parts in multiproc",  # 47
    "multiproc/test_llama_style.py::test_activation_recompute_trains_the_same_bits_with_grpo": "test_llama_options_reach_megatron_and_copies_agree_at_dp2",  # 19
    "multiproc/test_llama_style.py::test_llama_copies_agree_with_tp_and_pp[layout1]": "its layout0",  # 9
    "multiproc/test_periodic.py::test_resume_in_the_middle_of_a_period_is_bit_identical": "test_copies_identical_inside_instances_and_across_them_after_each_full_sync",  # 26
    "multiproc/test_periodic.py::test_tensor_parallel_copies_stay_identical": "test_copies_identical_inside_instances_and_across_them_after_each_full_sync",  # 13
    "multiproc/test_core_compressor.py::test_resume_with_core_residuals_is_bit_identical": "test_grpo resume (an int8 core by default)",  # 19
    "multiproc/test_core_compressor.py::test_core_int8_with_tp_and_pp[layout1]": "its layout0",  # 8
    "multiproc/test_training.py::test_pp2_matches_pp1": "test_tp2_matches_tp1, test_grpo::test_four_ranks_tp_pp_dp[layout1] (PP 2)",  # 13
    "multiproc/test_checkpoint.py::test_missing_tracker_and_incomplete_save": "reliability/test_checkpoint_damage",  # 17
    "multiproc/test_weight_check.py::test_one_flipped_bit_stops_the_run_naming_param_and_group[dp-decoder.layers.1.mlp.linear_fc1.weight-expected1]": "its tp case",  # 10
    "reliability/test_nonfinite.py::test_non_finite_weights_are_never_saved": "test_a_nan_loss_stops_the_run_before_its_next_save",  # 10
    "reliability/test_nonfinite.py::test_consecutive_skipped_steps_stop_the_run": "test_nan_and_inf_in_every_tier_skip_the_step_and_keep_state",  # 6
    "multiproc/test_resume_changed_flags.py::test_override_takes_the_new_lr_and_extends_the_decay": "test_use_checkpoint_keeps_its_schedule_and_warns_once",  # 6
    "multiproc/test_single_unit.py::test_a_single_unit_model_runs_exactly_as_the_baseline": "test_grpo::test_all_core_is_bit_identical_to_baseline",  # 19
    # On a slower 2-core machine (Intel Xeon, 2026-12-04) the suite measured 981 s, then 886 s and
    # 1,011 s (the same code: a noisy machine) with all but the last three of these: for margin.
    "multiproc/test_bench_cli.py::test_quality_suite_runs_side_by_side_writes_json_and_plots_and_reuses": "unit/test_bench (every suite on recorded runs), test_a_failing_run_is_named_and_nothing_is_reused (the real CLI)",  # 16
    "multiproc/test_checkpoint_overwrite.py::test_verified_checkpoints_are_resumed_not_overwritten": "unit/test_checkpoint_checks (tracker and verified-directory rules), test_checkpoint resume",  # 24
    "multiproc/test_offload_training.py::test_memory_budget_chooses_before_the_model_and_refuses_what_cannot_fit": "unit/test_memory_budget",  # 12
    "reliability/test_nonfinite_periodic.py::test_nonfinite_in_a_local_tier_skips_the_step_on_every_node": "reliability/test_nonfinite::test_nan_and_inf_in_every_tier_skip_the_step_and_keep_state, multiproc/test_periodic",  # 14
    "multiproc/test_grad_release.py::test_release_is_bit_identical_and_leaves_nothing[no-overlap]": "its frozen case, test_warmup_peak_is_units_in_flight_plus_shards",  # 12
    "reliability/test_launcher_death.py::test_ranks_stop_without_saving_when_the_agent_is_killed[torchrun]": "its rank_exec case",  # 7
    "multiproc/test_planner_instances.py::test_instance_memory_predicted_from_the_run_tiers": "test_instances_double_the_optimizer_state_and_shrink_the_residuals, multiproc/test_planner_measured",  # 10
    "multiproc/test_llama_style.py::test_llama_copies_agree_with_tp_and_pp[layout0]": "test_llama_options_reach_megatron_and_copies_agree_at_dp2, test_convert round trip [llama], test_grpo four ranks (TP)",  # 10
    "multiproc/test_stable_compressed.py::test_stable_int2_with_tensor_parallel_copies_identical": "test_stable_int2_every_step_copies_identical, test_core_compressor::test_core_int8_with_tp_and_pp[layout0] (replicated elements exact under TP)",  # 10
    "multiproc/test_tier_policy.py::test_random_policy_redraws_and_ranks_agree": "unit/test_tiers (the policies), test_grpo (ranks agree on tiers)",  # 7
    # Margin under the 15 minutes (the suite measured 895 s without these two).
    "multinode/test_slurm_faults.py::test_rendezvous_that_cannot_complete_fails_clearly": "test_checkpoints_on_several_nodes_need_a_shared_filesystem",  # 24
    "multiproc/test_weight_check.py::test_clean_tp2_dp2_run_records_weight_hash_ok": "its flipped-bit tp case",  # 10
    # Room for the sampled backward's tests (2026-12-05; seconds measured after the deferred
    # torch.compile, megatron_grpo/platform/deferred_compile.py).
    "multiproc/test_planner_measured.py::test_step_peak_within_5_percent_gradient_and_residual_bytes_exact[release_w1_int8]": "its release_1mb case",  # 4.5
    "multiproc/test_planner_measured.py::test_grpo_tier_bytes_predicted_exactly_from_the_run_tiers[grpo_core_int8]": "its grpo case, test_core_compressor::test_copies_identical_and_core_bytes_int8",  # 4.3
    "multiproc/test_planner_measured.py::test_model_state_memory_within_10_percent[llama_bf16]": "its grpo_bf16 and llama cases",  # 4.4
    "multiproc/test_reshard.py::test_resume_at_the_same_size_is_still_exact_and_says_nothing": "test_checkpoint::test_resume_is_bit_identical, test_grpo resume",  # 4.9
    # Room for the link decision's, the kernels' and the defects' tests (2026-12-07: the suite
    # measured 1,000 s on CI's machine with all of them).
    "multiproc/test_compress_decision.py::test_a_run_saved_exact_resumes_compressed": "test_a_run_saved_compressed_resumes_exact, unit/test_link_decision",  # 19
    "unit/test_gpu_check_codec.py::test_cpu_dry_run_passes_end_to_end_with_every_field": "test_fused_path_under_the_interpreter_passes_the_device_analysis, test_help_and_no_cuda_device",  # 20 (the dry run)
    "unit/test_gpu_check_codec.py::test_a_byte_mismatch_or_a_missing_launch_fails_the_codec_part": "test_fused_path_under_the_interpreter_passes_the_device_analysis",  # shares the dry run
    "multiproc/test_offload_fd_limit.py::test_a_save_with_the_ssd_tier_fits_a_low_open_file_limit": "unit/test_slot_file_fds, unit/test_checkpoint_open_files",  # 13
}


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (minutes on 2 cores) run only with ``-m slow`` or MEGATRON_GRPO_SLOW=1,
    so the README's test command stays within CI's time; the benchmark command runs them. The
    tests in SLOW get the mark here."""
    for item in items:
        if item.nodeid.split("tests/", 1)[-1] in SLOW:
            item.add_marker(pytest.mark.slow)
    if _slow_selected(config):
        return
    skip = pytest.mark.skip(reason="slow test: run with `pytest -m slow` or MEGATRON_GRPO_SLOW=1")
    for item in items:
        if "slow" in item.keywords:  # slow docs blocks too (tests/unit/test_docs.py marks them)
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """A whole-suite run that collects no test is a broken suite, not a pass: exit 1, not
    pytest's 5, so CI (which runs exactly the README's command) fails on it. A run narrowed with
    -k or -m may legitimately select nothing and keeps pytest's 5."""
    config = session.config
    if int(exitstatus) == 5 and not config.getoption("keyword") and not config.getoption("markexpr"):
        session.exitstatus = 1


@pytest.fixture
def gloo_group():
    """A 1-rank gloo default process group for the test, destroyed afterwards.

    megatron's dataset builders call torch.distributed.get_rank() and barrier() once a group
    exists (and BlendedDataset needs one even in a single process). If a group is already
    initialized it is reused and left alone.
    """
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", world_size=1, rank=0)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def tmpfs():
    """tmpfs(path, size, read_only=False): a context manager mounting a small tmpfs at path (a
    full or read-only filesystem for the offload tests; root ignores permissions, so a chmod
    cannot make a directory unwritable for it). Skips the test where mounting is not allowed."""
    import contextlib
    import subprocess

    @contextlib.contextmanager
    def mount(path, size, read_only=False):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        path.mkdir()
        run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
        if run.returncode:
            pytest.skip(f"mount -t tmpfs not permitted here: {run.stderr.strip()}")
        try:
            if read_only:
                subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
            yield path
        finally:
            subprocess.run(["umount", str(path)], check=True)

    return mount


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory):
    """The default corpus (CPython stdlib, real text), built once per test session for every
    folder's tests (multiproc, reliability, multinode)."""
    from megatron_grpo.data import build_default_dataset

    prefix = str(tmp_path_factory.mktemp("data") / "stdlib")
    build_default_dataset(prefix, verbose=False)
    return prefix
