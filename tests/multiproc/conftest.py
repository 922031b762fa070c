import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory):
    """The default corpus (CPython stdlib, real text), built once per test session."""
    from megatron_grpo.data import build_default_dataset

    prefix = str(tmp_path_factory.mktemp("data") / "stdlib")
    build_default_dataset(prefix, verbose=False)
    return prefix
