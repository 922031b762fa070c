"""The training run, the same for the baseline and GRPO: config dataclasses and Megatron-style
flags (config.py, arguments.py), builders (model.py), the step (step.py), the loop (loop.py:
run(cfg, hooks)), checkpointing (checkpointing.py and its guards: checkpoint_dirs, save_lock,
save_errors, resume_flags), metrics (metrics.py, metrics_log.py), the memory budget, CUDA
settings, the divergence guard, the weight hash check and the launcher watch. GRPO enters only
through the hooks (megatron_grpo/hooks.py).
"""
