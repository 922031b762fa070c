"""CPU mode: what it emulates, that it is idempotent, and that it stays off where CUDA exists.

Each check runs in a fresh interpreter: CPU mode patches torch process-wide on purpose.
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_py(code: str, **env) -> str:
    e = dict(os.environ, PYTHONWARNINGS="ignore", **env)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=e, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_emulation_on_cpu():
    out = run_py("""
import torch
from megatron_grpo.platform import enable_cpu_mode, cpu_mode_active
assert not cpu_mode_active()
assert enable_cpu_mode() is True and enable_cpu_mode() is True   # idempotent
t = torch.empty(3, device='cuda')
u = torch.zeros(2).cuda()
v = torch.ones(2).to('cuda:0')
w = torch.zeros(2, device=torch.cuda.current_device())
s = torch.cuda.Stream(); e = torch.cuda.Event(); e.record(); s.wait_event(e)
with torch.cuda.stream(s):
    pass
torch.cuda.manual_seed(5); a = torch.randn(4)
torch.manual_seed(5); b = torch.randn(4)   # CUDA seeding reseeds the one CPU generator
print(t.device, u.device, v.device, w.device, torch.zeros(1).type(), torch.zeros(1).type(torch.int64).dtype,
      bool(torch.equal(a, b)), torch.cuda.is_available())
""")
    assert out == "cpu cpu cpu cpu torch.cuda.FloatTensor torch.int64 True False"


def test_megatron_rng_tracker_uses_cpu_generator():
    out = run_py("""
import torch
from megatron_grpo.platform import enable_cpu_mode
enable_cpu_mode()
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
tr = get_cuda_rng_tracker(); tr.reset(); tr.add('x', 11)
with tr.fork('x'):
    a = torch.rand(3)
torch.manual_seed(11); b = torch.rand(3)
print(bool(torch.equal(a, b)))
""")
    assert out == "True"


def test_no_op_where_cuda_is_available():
    # Pretend CUDA exists: CPU mode must not activate unless forced.
    out = run_py("""
import torch
torch.cuda.is_available = lambda: True
from megatron_grpo.platform import enable_cpu_mode, cpu_mode_active, cuda_usable
before = torch.Tensor.type
print(enable_cpu_mode(), cpu_mode_active(), cuda_usable(), torch.Tensor.type is before)
""")
    assert out == "False False True True"


def test_forced_by_environment():
    out = run_py("""
import torch
torch.cuda.is_available = lambda: True
from megatron_grpo.platform import enable_cpu_mode, cpu_mode_active, cuda_usable
print(cuda_usable(), enable_cpu_mode(), cpu_mode_active(), torch.cuda.is_available())
""", MEGATRON_GRPO_FORCE_CPU="1")
    assert out == "False True True False"
