"""Megatron-LM's training package as the megatron-core wheels ship it (0.17 on), not a checkout.

Its start-up builds the dataset index helpers with ``make`` in ``megatron/core/datasets``; a
checkout has the Makefile there, a wheel has the compiled ``helpers_cpp`` module and no Makefile,
so ``make`` fails and the run stops. Where the compiled module imports and no Makefile exists,
there is nothing to build.
"""

from __future__ import annotations

import functools
import importlib.util
import os


def install() -> None:
    import megatron.core.datasets.utils as dutils

    original = dutils.compile_helpers
    here = os.path.dirname(dutils.__file__)
    if os.path.exists(os.path.join(here, "Makefile")):
        return  # a checkout: megatron builds its helpers as usual
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return  # nothing compiled and nothing to build with: megatron's own error stands

    @functools.wraps(original)
    def compile_helpers():
        return None

    dutils.compile_helpers = compile_helpers
