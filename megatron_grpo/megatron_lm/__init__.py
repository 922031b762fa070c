"""GRPO inside Megatron-LM's own training loop.

``python -m megatron_grpo.megatron_lm PATH/pretrain_gpt.py [Megatron-LM flags] --grpo [...]``
runs the script unmodified with GRPO's flags on its parser (flags.py), its refusals (refusals.py),
GRPO's classes at Megatron-LM's construction points (megatron_grpo.megatron.lm_points), GRPO's
per-step hooks and metrics (steps.py), GRPO's state beside its checkpoints (checkpoints.py), and
on a machine without CUDA the CPU replacements of its start-up (cpu.py, wheel.py). runner.py puts
them in place in that order. docs/launch.md, "GRPO in your Megatron-LM job".
"""
