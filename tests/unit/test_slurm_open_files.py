"""The SLURM scripts raise the soft open-file limit to the hard one before training starts (the
SSD memory tier and torch_dist saves open many files; the common soft limit of 1024 runs out
mid-save), never fail the job when the raise is refused, and the batch script says the value."""

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SBATCH = os.path.join(REPO, "launch", "slurm", "pretrain_gpt_grpo.sbatch")
NODE_TASK = os.path.join(REPO, "launch", "slurm", "node_task.sh")
RAISE = 'ulimit -Sn "$(ulimit -Hn)" 2>/dev/null || true'


def _lines(path):
    return [line.strip() for line in open(path)]


def test_both_scripts_raise_the_limit_before_training_starts():
    for path, starts in ((SBATCH, "srun "), (NODE_TASK, '"$PYTHON" -m torch.distributed.run')):
        lines = _lines(path)
        assert RAISE in lines, path
        assert lines.index(RAISE) < next(i for i, line in enumerate(lines) if line.startswith(starts)), path
    said = [line for line in _lines(SBATCH) if "open files: ulimit -n" in line]
    assert said == ['echo "[job $SLURM_JOB_ID] open files: ulimit -n $(ulimit -Sn) (hard limit $(ulimit -Hn))"']


def test_the_raise_reaches_the_hard_limit_and_a_refusal_does_not_fail():
    hard = subprocess.run(["bash", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip()
    low = "256" if hard == "unlimited" or int(hard) > 256 else hard
    out = subprocess.run(["bash", "-euc", f"ulimit -Sn {low}; {RAISE}; ulimit -Sn"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == hard, out
    # A node that refuses the raise (here: setting the limit fails) keeps its limit, says nothing
    # and the script goes on, even under `set -e`.
    refuse = 'ulimit() { if [ $# -gt 1 ]; then echo refused >&2; return 1; fi; command ulimit "$@"; }'
    out = subprocess.run(["bash", "-euc", f"{refuse}; {RAISE}; echo on"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "on" and out.stderr == "", out
