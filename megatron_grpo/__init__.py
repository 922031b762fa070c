"""megatron-grpo: Gradient-aware Resource Partitioning Optimization for megatron-core.

Not Group Relative Policy Optimization (the RL algorithm): here GRPO ranks parameters by
gradient importance into core / dynamic / stable tiers and gives each tier its own
communication, compute and memory treatment inside megatron-core's DDP and distributed optimizer.
"""

__version__ = "0.1.0"
