"""How error-feedback residuals may be stored: the one list, owned by the layer that stores them.

``fp32`` (exact), ``bf16`` (half the bytes, rounded), ``int8`` (a quarter, quantised per chunk;
comm/error_feedback.py). GRPOConfig.residual_dtype (grpo/config.py) checks a flag against this
list, so the configuration reads it from here rather than comm reading it from the configuration
(comm/ sits below grpo/: the import-layout test holds the arrow to that direction).
"""

RESIDUAL_DTYPES = ("fp32", "bf16", "int8")
