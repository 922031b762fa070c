"""Where the Megatron-LM runner's tests find Megatron-LM: the test install of megatron-core
0.19.2 (its wheel carries megatron.training) that launch/setup_env.sh puts beside the venv."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
INSTALL = os.path.join(sys.prefix, "megatron-lm-0.19.2")
DRIVER = os.path.join(HERE, "gpt_driver.py")
