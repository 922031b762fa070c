"""The training run, the same for the baseline and GRPO: config dataclasses and Megatron-style
flags (config.py, arguments.py), builders (model.py), the step (step.py), the loop (loop.py:
run(cfg, hooks)), checkpointing (checkpointing.py) and what a resume does with changed flags
(resume_flags.py), metrics (metrics.py, metrics_log.py), the memory budget, CUDA settings and
the weight hash check. What keeps a run safe is its own room, safety/: checkpoint directories
and their manifest check, the --save lock, the launcher watch, the divergence guard and save
errors. GRPO enters only through the hooks (megatron_grpo/hooks.py).
"""
