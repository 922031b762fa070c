"""Loaded first by the Megatron-LM runner's test processes (PYTHONPATH): megatron-core 0.19.2's
training package imports ``typing.override`` (Python 3.12); on 3.11 typing_extensions has it.
Only the test install of 0.19.2 on the project's Python 3.11 needs this."""

import sys
import typing

if sys.version_info < (3, 12) and not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override
