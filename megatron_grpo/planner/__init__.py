"""The memory and communication planner: per-GPU bytes for a model, layout and GRPO setting,
before anything is built (launch/plan.py, --grpo-memory-budget-gb, the benches).

plan.py (the plan: parameters, gradients, optimizer state, GRPO's extra state, bytes on the
wire), grads.py (gradient buffers, release and shards through the memory tier), activations.py
(megatron-core GPTModel's activations, recompute included), format.py (the printed tables),
capacity.py (the largest model that fits), peers.py (megatron-core's own memory options
beside it: CPU optimizer offload, Megatron-FSDP; predictions), internode.py (bytes between
nodes of the hierarchical and periodic tiers). Measured against real runs in tests/multiproc/test_planner_*.
steptime.py models the step time, megatron beside GRPO with the link-aware decision: modelled,
not measured (docs/planner.md, "Step time").
"""
