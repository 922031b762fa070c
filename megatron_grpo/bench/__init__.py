"""The evidence suite: side-by-side benchmarks of the megatron baseline, GRPO and its peers.

Run ``python -m megatron_grpo.bench --help``. A tool downstream of the training entry: it
launches ``launch/pretrain_gpt.py`` runs and reads their metrics, never GRPO internals.
"""
