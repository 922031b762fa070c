"""Per-tier compute policy: the importance-sampled backward of the tiers below core.

``sampler`` holds the estimator (which token rows a linear layer's weight and data gradients are
computed from, and how they are reweighted so the estimate stays unbiased),
``plan`` each step's plan (which units are sampled, at what keep ratio, from the tiers), ``flops``
the count of what a step computes.
Nothing here knows megatron: the glue (megatron_grpo.megatron.sampled_linear) calls it from
inside megatron's linear layers.
"""
