"""The device check's parts (tools/gpu_check.py is the runner): one module per phase
(phase_a ... phase_e), the checks phase b runs in worker processes (tensor_checks, stream_checks,
comm_checks), the training runs (runs, specs, train_entry, fused_adam, gloo_cuda) and what they
all share (common). The codec check (``bash tools/gpu_check.sh --codec``) is codec.py, with its
measurements in codec_bench.py."""
