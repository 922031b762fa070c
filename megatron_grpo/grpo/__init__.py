"""GRPO's decisions, independent of megatron-core: the first three steps of the flow.

config.py (GRPOConfig: every --grpo-* flag, the tier and stable-mode names and their
predicates) -> importance.py (|grad| x |w| per unit, measured during backward) -> tiers.py (the
core / dynamic / stable plan, re-planned every --grpo-retier-interval steps) with health.py (the
monitor that sends a dynamic unit back to core), replica.py (elements replicated across ranks),
outer_schedule.py (when the periodic tiers sync) and timing.py (CUDA-event timers). The
controller/ subpackage drives them each step. Nothing here imports megatron-core's private
classes, the per-tier policies (comm/, offload/), megatron/ or training/.
"""
