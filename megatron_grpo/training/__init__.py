"""The training run: config, builders, step, checkpointing, loop."""
