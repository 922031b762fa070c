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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (minutes on 2 cores) run only with ``-m slow`` or MEGATRON_GRPO_SLOW=1,
    so the README's test command stays within CI's time; the benchmark command runs them."""
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
