"""megatron-grpo packaging.

CPU set-up (developers, CI):   launch/setup_env.sh (torch==2.13.0, megatron-core==0.16.1 pinned)
GPU cluster:                   pip install -e .[gpu]   (into an environment with a CUDA torch)

torch is NOT pinned here on purpose: on a GPU cluster it comes with the site's CUDA build, and a
bare 'torch' requirement would pull a multi-GB CUDA build onto CPU machines. The CPU path
(launch/setup_env.sh, .ci/run) installs torch==2.13.0 explicitly first. apex is a source build
on GPU clusters (see docs/launch.md); the PyPI package named 'apex' is unrelated, never install it.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-grpo",
    version="0.1.0",
    description="Gradient-aware Resource Partitioning Optimization (GRPO) for megatron-core pretraining",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_grpo", "megatron_grpo.*"]),
    install_requires=[
        # A range, so pip keeps a supported megatron-core a user already has (0.17-0.19 need
        # Python >= 3.12) instead of downgrading it; megatron_grpo/megatron/compat.py names
        # what differs between them, and its version gate stops outside the range.
        "megatron-core>=0.16.1,<0.20",
        "matplotlib",  # benchmark plots (python -m megatron_grpo.bench)
        "numpy",
        # megatron-core's partial distributed optimizer (--num-distributed-optimizer-instances)
        # builds its hierarchical groups with einops, which the wheel does not declare
        "einops",
        "psutil",  # dist_checkpointing needs it but the megatron-core wheel does not declare it
        "pyyaml",
        "tensorboard",
    ],
    extras_require={
        # triton: the fused codec kernels' tests (interpreter, sm_90 compile). CUDA torch wheels
        # bring their own pinned triton, which this leaves alone; launch/setup_env.sh pins the
        # CPU set-up's to torch 2.13.0's (3.7.1). Linux x86-64 and aarch64 wheels only.
        # ruff: the lint .ci/run runs before the tests (ruff.toml says which checks).
        "test": ["pytest>=8", "transformers", "triton; platform_system == 'Linux'", "ruff==0.17.6"],
        # checkpoints/grpo_ckpt.py to-hf / from-hf, HF tokenizers (tokenizers and safetensors
        # come with transformers)
        "convert": ["transformers"],
        "gpu": ["transformer-engine[pytorch]"],
    },
)
