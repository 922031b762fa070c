"""A save with the SSD tier under a low open-file limit (2 gloo ranks, `ulimit -n 256`).

A model of 40 layers has more optimizer-state tensors per rank than the limit, and a checkpoint
reads each away one through a map of the rank's SSD file. With a map (and so a descriptor) per
tensor the ranks ran out of descriptors in the save; their launcher watches then could not read
/proc, took that for a dead torchrun, and stopped the ranks with "the launcher ... is gone", no
checkpoint written. With one map per file the save needs a handful of descriptors whatever the
number of tensors (tests/unit/test_slot_file_fds.py has the store's own cases,
tests/unit/test_launcher_watch.py the watch's)."""

import os
import subprocess
import sys

from harness import ENTRY, REPO, SMALL_MODEL, env, free_port

from megatron_grpo.training.safety.checkpoint_dirs import TRACKER, iteration_dir

LIMIT = 256


def test_a_save_with_the_ssd_tier_fits_a_low_open_file_limit(stdlib_data, tmp_path):
    ssd, ckpt = tmp_path / "ssd", tmp_path / "ckpt"
    ssd.mkdir()
    args = [*SMALL_MODEL, "--num-layers", "40", "--hidden-size", "32", "--num-attention-heads", "4",
            "--grpo", "--grpo-warmup-iters", "2", "--grpo-retier-interval", "2",
            "--grpo-offload", "ssd", "--grpo-offload-dir", str(ssd),
            "--data-path", stdlib_data, "--train-iters", "2", "--eval-interval", "1000",
            "--save", str(ckpt), "--save-interval", "2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), ENTRY, *args]
    # The limit for torchrun and its ranks only, set the way an sbatch script sets it.
    proc = subprocess.run(["bash", "-c", f"ulimit -Sn {LIMIT} && exec \"$@\"", "bash", *cmd], cwd=REPO,
                          env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "is gone" not in proc.stderr and "open-file limit" not in proc.stderr, proc.stderr[-6000:]
    assert (ckpt / TRACKER).read_text().strip() == "2"
    assert os.path.isdir(iteration_dir(str(ckpt), 2))
    assert os.listdir(ssd) == []  # the rank files are deleted at the end of the run
