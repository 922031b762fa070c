"""The GRPO controller: one per run, driven by the megatron glue's bucket groups each step.

core.py (GRPOController: measures importance, re-plans the tiers, owns the error feedback and
the health monitor), state.py (what it checkpoints: common and per-rank state, and the restore),
report.py (its fields of the iteration's metrics record). state.py and report.py are mixins of
GRPOController and read its attributes.
"""
