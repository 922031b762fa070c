"""megatron_grpo.platform.deferred_compile: on the CPU path torch.compile waits for a function's
first call, so megatron-core's import-time fusion decorations cost nothing, and a function that
runs is compiled with exactly the options it was decorated with."""

import os
import subprocess
import sys

import torch

from megatron_grpo.platform import deferred_compile as dc


def _with_fake_real(monkeypatch):
    calls = []

    def real(model, **kwargs):
        calls.append((model, kwargs))
        return lambda *a, **k: ("compiled", model(*a, **k))

    monkeypatch.setattr(dc, "_real_compile", real)
    return calls


def test_a_function_is_compiled_once_at_its_first_call_with_its_options(monkeypatch):
    calls = _with_fake_real(monkeypatch)

    @dc.deferred_compile
    def add(a, b):
        return a + b

    @dc.deferred_compile(mode="max-autotune", dynamic=False)
    def mul(a, b):
        return a * b

    assert calls == [] and add.__name__ == "add" and add.deferred_compile_of.__name__ == "add"
    assert add(2, 3) == ("compiled", 5) and add(1, 1) == ("compiled", 2)
    assert mul(2, 3) == ("compiled", 6)
    assert [(fn.__name__, kw) for fn, kw in calls] == [("add", {}), ("mul", {"mode": "max-autotune", "dynamic": False})]


def test_modules_go_straight_to_torch_compile(monkeypatch):
    calls = _with_fake_real(monkeypatch)
    layer = torch.nn.Linear(2, 2)
    dc.deferred_compile(layer, fullgraph=True)
    assert calls == [(layer, {"fullgraph": True})]


def test_the_real_torch_compile_runs_at_the_first_call():
    if dc._real_compile is None:
        dc.install()
    fn = dc.deferred_compile(lambda x: x * 2 + 1, backend="eager")
    assert torch.equal(fn(torch.arange(3.0)), torch.tensor([1.0, 3.0, 5.0]))


def test_cpu_path_imports_megatron_without_inductor():
    """In a fresh CPU process, importing megatron-core's tensor-parallel layers (which decorate
    its fusions with torch.compile) leaves torch._inductor unimported: the fusions are deferred."""
    code = (
        "import sys, torch\n"
        "import megatron_grpo.platform.cpu\n"
        "from megatron_grpo.platform import deferred_compile as dc\n"
        "import megatron.core.tensor_parallel, megatron.core.fusions.fused_bias_gelu as g\n"
        "print('installed', dc.installed(), 'inductor', 'torch._inductor' in sys.modules,\n"
        "      'deferred', g.bias_gelu.deferred_compile_of.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "MEGATRON_GRPO_FORCE_CPU": "1"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "installed True inductor False deferred bias_gelu" in out.stdout, out.stdout
