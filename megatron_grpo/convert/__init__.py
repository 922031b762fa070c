"""Checkpoint tools (checkpoints/grpo_ckpt.py): read torch_dist checkpoints without the training
job, convert to and from Hugging Face transformers with numerical checks, strip GRPO state.

Flow: reader (torch_dist) -> hf_layout (tensor mapping) -> hf_export / hf_import -> verify;
ckpt_tools (inspect, strip-grpo). Built on the training entry's checkpoint format
(megatron_grpo.training.checkpointing) and model builder; nothing here is imported by training.
"""
