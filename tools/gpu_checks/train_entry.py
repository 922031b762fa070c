"""One rank of a device-check training run: launch/pretrain_gpt.py's ``main`` with what the check
needs installed first, chosen by environment variables (tools/gpu_checks/runs.py sets them):

* ``GPU_CHECK_OPTIMIZER=te|apex|torch_fused|double``: the Adam megatron builds
  (tools/gpu_checks/fused_adam.py); with ``GPU_CHECK_OPT_DUMP=PATH`` its step counters are
  written to PATH after the run;
* ``GPU_CHECK_COALESCE_SHIM=1``: megatron's coalesced bucket collectives issued one by one;
* ``GPU_CHECK_GLOO_CUDA=1``: CUDA device 0 with gloo (two ranks on one device), see
  tools/gpu_checks/gloo_cuda.py.

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python tools/gpu_checks/train_entry.py <launch/pretrain_gpt.py flags>
"""

from __future__ import annotations

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.dirname(HERE)
ROOT = os.path.dirname(TOOLS)
LAUNCH = os.path.join(ROOT, "launch")
for path in (ROOT, TOOLS):
    if path not in sys.path:
        sys.path.insert(0, path)


def main(argv=None) -> int:
    from gpu_checks import fused_adam, gloo_cuda

    kind = os.environ.get("GPU_CHECK_OPTIMIZER", "")
    if kind:
        fused_adam.install(kind)
    if os.environ.get("GPU_CHECK_COALESCE_SHIM") == "1":
        gloo_cuda.install_coalescing_shim()
    if os.environ.get("GPU_CHECK_GLOO_CUDA") == "1":
        gloo_cuda.install_platform()
    else:
        gloo_cuda.check_platform_hook()
    spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(LAUNCH, "pretrain_gpt.py"))
    pretrain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain)
    rc = pretrain.main(sys.argv[1:] if argv is None else argv)
    dump = os.environ.get("GPU_CHECK_OPT_DUMP")
    if kind and dump:
        fused_adam.dump(dump, kind)
    return rc


if __name__ == "__main__":
    sys.exit(main())
