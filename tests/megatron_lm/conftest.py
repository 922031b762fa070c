"""The Megatron-LM runner's tests: the path to Megatron-LM 0.19.2 (lm_harness.py)."""

import os

import pytest
from lm_harness import HERE, INSTALL, REPO


@pytest.fixture(scope="session")
def megatron_lm_path() -> str:
    """PYTHONPATH for a process running Megatron-LM 0.19.2: the 3.11 back-port first, then the
    test install (before the venv's megatron-core 0.16.1), then this checkout."""
    if not os.path.isfile(os.path.join(INSTALL, "megatron", "training", "training.py")):
        pytest.fail(f"no test install of megatron-core 0.19.2 at {INSTALL}: run bash launch/setup_env.sh "
                    f"(README command 2 does)")
    return os.pathsep.join([os.path.join(HERE, "py311"), INSTALL, REPO])
