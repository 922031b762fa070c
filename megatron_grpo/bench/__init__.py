"""The evidence suite: side-by-side benchmarks of the megatron baseline, GRPO and its peers.

Run ``python -m megatron_grpo.bench --help``. A tool downstream of the training entry: it
launches ``launch/pretrain_gpt.py`` runs (and, for the slow link, the sbatch script on the local
2-node SLURM cluster of slurm_cluster.py, which the multinode tests use too) and reads their
metrics, never GRPO internals.
"""
