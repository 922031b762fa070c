"""The per-tier communication policy, plain torch.distributed (no megatron-core private class).

Counting: wire.py (the byte counter installed over torch.distributed), wire_rules.py (bytes per
collective), analytic.py (megatron's bucket layout and bytes, re-derived for the tests).
Compressors: compress.py (int4, int8, top-k; the formats), compress_int2.py, compress_base.py,
powersgd.py (a peer). Around them: error_feedback.py (residuals; their storage dtypes in
residual_dtypes.py), accumulators.py (the delayed stable tier's sums), replicated.py (elements
replicated across ranks, sent exact), dynamic.py (the compressed reduce-scatter and parameter
gather), hierarchical.py (between distributed-optimizer instances), outer.py (the periodic
tiers' outer optimizer), streams.py (side-stream lifetimes).
"""
