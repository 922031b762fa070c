"""The Triton kernels of the codec (megatron_grpo/comm/triton_codec.py) against the eager codec,
on the CPU: byte-identical payloads and residuals and bit-identical sums under Triton's
interpreter (triton_codec_cases.py, in a child process with TRITON_INTERPRET=1), division and
rounding as compiled for sm_90 (PTX, no GPU needed), and the choice between the fused and the
eager path (comm/fused_codec.py): eager for CPU tensors."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch
import triton_codec_cases as cases

from megatron_grpo.comm import fused_codec as fc
from megatron_grpo.comm.compress import Int4Compressor, Int8Compressor, TopKCompressor
from megatron_grpo.comm.error_feedback import ErrorFeedback

HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAVE_TRITON, reason="triton is not installed (launch/setup_env.sh installs triton==3.7.1, "
                            "the version torch 2.13.0's CUDA wheels pin)")


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, cases.__file__], env=env, capture_output=True,
                          text=True, timeout=600, cwd=os.path.dirname(cases.__file__))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["results"]


@needs_triton
@pytest.mark.parametrize("name", list(cases.CASES))
def test_kernel_matches_the_eager_codec_under_the_interpreter(interpreted, name):
    assert interpreted[name] == "ok", interpreted[name]


# ---- compiled for an H100 / H200 (sm_90), on the CPU ----------------------------------------

def _compile(kernel, signature, constexprs):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"enable_fp_fusion": False, "num_warps": 4}).asm["ptx"]


def _payload_args(*names):
    return {name: "*u8" if name.endswith("u8") else "*fp32" for name in names}


PAYLOAD = _payload_args("pay_u8", "pay_f32")
KERNELS = {  # name -> (signature without constexprs, constexprs, divides)
    "encode_rows_int4": ("encode_rows_kernel", dict(
        {"a_ptr": "*fp32", "b_ptr": "*bf16"}, **PAYLOAD,
        **dict.fromkeys(("N", "n_c", "code_bytes", "P", "P4"), "i32")),
        dict(C=256, BITS=4, BLOCK_H=128, SUB=True), True),
    "encode_feedback_int4": ("encode_feedback_kernel", dict(
        {"g_ptr": "*fp32"}, **_payload_args("old_u8", "old_f32", "pay_u8", "pay_f32", "new_u8",
                                            "new_f32"), zero_ptr="*u8",
        **dict.fromkeys(("total", "N", "n_c", "code_bytes", "P", "P4"), "i32")),
        dict(C=256, BITS=4, BLOCK_H=128, RC=256, BLOCK_R=256, W=260, HAS_RES=True, HAS_ZERO=True), True),
    "encode_feedback_int8": ("encode_feedback_kernel", dict(
        {"g_ptr": "*fp32"}, **_payload_args("old_u8", "old_f32", "pay_u8", "pay_f32", "new_u8",
                                            "new_f32"), zero_ptr="*u8",
        **dict.fromkeys(("total", "N", "n_c", "code_bytes", "P", "P4"), "i32")),
        dict(C=256, BITS=8, BLOCK_H=128, RC=256, BLOCK_R=256, W=260, HAS_RES=False, HAS_ZERO=False), True),
    "decode_sum_int4": ("decode_sum_kernel", dict(
        PAYLOAD, out_ptr="*fp32", **dict.fromkeys(("R", "N", "n_c", "P", "P4"), "i32")),
        dict(C=256, BITS=4, BLOCK=1024), False),
    "decode_add_bf16": ("decode_add_kernel", dict(
        PAYLOAD, dst_ptr="*bf16", **dict.fromkeys(("N", "n_c", "P", "P4"), "i32")),
        dict(C=256, BITS=8, BLOCK=1024), False),
}


@pytest.fixture(scope="module")
def jit_kernels():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the kernels are not compiled")
    return fc.kernels()


@needs_triton
@pytest.mark.parametrize("name", list(KERNELS))
def test_sm90_ptx_divides_correctly_rounded_and_never_fuses(jit_kernels, name):
    """The eager codec's scale is a correctly rounded max|x| / L (an H200 once showed 1-ulp
    scale differences from an approximate division, Triton's default ``/`` on fp32), and each
    product and sum is rounded on its own (an fma rounds once and changes codes and sums)."""
    kernel, signature, constexprs, divides = KERNELS[name]
    ptx = _compile(getattr(jit_kernels, kernel), signature, constexprs)
    assert ("div.rn.f32" in ptx) == divides
    for approximate in ("div.approx", "div.full", "rcp.approx"):
        assert approximate not in ptx, f"{name}: {approximate} in its PTX"
    assert not re.findall(r"\b(?:fma|mad)\.[a-z.]*f(?:16|32)", ptx), f"{name}: a fused multiply-add"
    assert "mul.rn.f32" in ptx  # with fusion off, products are marked rounded: ptxas keeps them


# ---- which path runs ------------------------------------------------------------------------

@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a fused kernel was launched")
    monkeypatch.setattr(fc, "_launch", refuse)


def _eager_feedback(ef, grad, dp, comp):
    send = comp.compress_rows(ef.owed("b", grad).view(dp, -1))
    ef.stage("b", grad, send, 0, comp)
    return send


def test_cpu_tensors_take_the_eager_path(no_launch):
    """Nothing changes on the CPU: every entry point is the eager codec, bit for bit."""
    comp, dp = Int4Compressor(8), 3
    assert not fc.fused_enabled(torch.zeros(1))
    ef, ref = ErrorFeedback("int8", 8), ErrorFeedback("int8", 8)
    for step in range(2):
        g = cases.values(dp, 20, 8, seed=step).view(-1)
        grad, grad_ref = g.clone(), g.clone()
        send = fc.compress_with_feedback("b", grad, dp, ef, comp, 0)
        assert torch.equal(send, _eager_feedback(ref, grad_ref, dp, comp))
        assert cases.same_floats(grad, grad_ref)  # c = g + r left in the buffer, as eager owed does
        assert torch.equal(ef.staged("b").payload, ref.staged("b").payload)
        ef.commit()
        ref.commit()
    out = torch.empty(20)
    assert fc.sum_rows(comp, send, 20, out=out) is out
    assert cases.same_floats(out, comp.decompress_rows_sum(send, 20))
    master, copy = torch.randn(20), torch.randn(20).to(torch.bfloat16)
    assert torch.equal(fc.compress_delta(comp, master, copy),
                       comp.compress_rows((master - copy.float()).view(1, -1)))
    rows = torch.randn(3, 20).to(torch.bfloat16)
    want = rows.clone().add_(comp.decompress_rows(send, 20).to(torch.bfloat16))
    fc.add_decoded(comp, send, rows)
    assert torch.equal(rows.view(torch.int16), want.view(torch.int16))


def test_fused_only_with_cuda_tensors_triton_and_the_switch_on(monkeypatch):
    cuda = types.SimpleNamespace(is_cuda=True)
    monkeypatch.delenv(fc.SWITCH, raising=False)
    assert fc.fused_enabled(cuda) == HAVE_TRITON
    assert not fc.fused_enabled(cuda, torch.zeros(1))  # one CPU tensor: eager
    monkeypatch.setenv(fc.SWITCH, "0")
    assert not fc.fused_enabled(cuda)
    monkeypatch.delenv(fc.SWITCH)
    # where triton does not import, CUDA tensors take the eager path too
    import megatron_grpo.comm

    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "megatron_grpo.comm.triton_codec", raising=False)
    monkeypatch.delattr(megatron_grpo.comm, "triton_codec", raising=False)
    fc.kernels.cache_clear()
    try:
        assert fc.kernels() is None and not fc.fused_enabled(cuda)
    finally:
        fc.kernels.cache_clear()


@pytest.mark.parametrize("case", ["stats", "fp32 residual", "topk", "odd int4 chunk"])
def test_cases_the_kernels_do_not_cover_stay_eager(monkeypatch, no_launch, case):
    """With the fused path forced on, what the kernels do not cover still runs the eager codec."""
    monkeypatch.setattr(fc, "fused_enabled", lambda *tensors: True)
    comp = {"topk": TopKCompressor(0.3), "odd int4 chunk": Int4Compressor(7)}.get(case, Int8Compressor(8))
    ef = ErrorFeedback("fp32" if case == "fp32 residual" else "int8", 8)
    grad, seen = cases.values(2, 16, 8, seed=5, special=False).view(-1), []
    stats = (lambda applied, owed: seen.append(1)) if case == "stats" else None
    fc.compress_with_feedback("b", grad, 2, ef, comp, 0, torch.tensor([3]), stats=stats)
    assert ef.staged("b") is not None and (case != "stats" or seen)


def test_the_summing_order_is_the_eager_pairwise_tree_for_every_row_count():
    """decode_sum_kernel's binary counter (_push, _fold), in Python: the tree it builds is
    decompress_rows_sum's (adjacent rows added, an odd last row carried) for rows counts past
    what the interpreter cases run, up to the kernel's limit."""
    def pairwise(rows):
        level = list(range(rows))
        while len(level) > 1:
            level = [(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)] + \
                    ([level[-1]] if len(level) % 2 else [])
        return level[0]

    def counter(rows):
        stack = [None] * fc.SUM_LEVELS
        for i in range(rows):
            c = i
            for k in range(fc.SUM_LEVELS):
                bits = i & ((2 << k) - 1)
                if bits == (2 << k) - 1:
                    c = (stack[k], c)
                if bits == (1 << k) - 1:
                    stack[k] = c
        total = None
        for k in range(fc.SUM_LEVELS):
            if (rows >> k) & 1:
                total = stack[k] if rows & ((1 << k) - 1) == 0 else (stack[k], total)
        return total

    counts = set(range(1, 300)) | {2 ** k + d for k in range(9, fc.SUM_LEVELS) for d in (-1, 0, 1)}
    counts.add(2 ** fc.SUM_LEVELS - 1)
    for rows in sorted(counts):
        if rows < 2 ** fc.SUM_LEVELS:
            assert counter(rows) == pairwise(rows), rows


@needs_triton
def test_both_modules_agree_on_the_sum_limit(jit_kernels):
    assert jit_kernels.SUM_LEVELS == fc.SUM_LEVELS


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU runs the "
                    "kernels under the interpreter above)")
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_compiled_kernels_on_cuda_match_the_eager_codec(fmt):
    """On a GPU: the compiled kernels through the real selection, at bucket-like sizes (a shard
    not a multiple of the chunk), against the eager codec on the same device and on the CPU."""
    comp, dp, shard = cases.CODECS[fmt](256), 8, 300_000 + 128
    assert fc.fused_enabled(torch.zeros(1, device="cuda"))
    efs = {name: ErrorFeedback("int8", 256) for name in ("fused", "eager", "cpu")}
    exact = torch.tensor([0, 1000, 299_999, 1_000_003])
    for step in range(3):
        g = cases.values(dp, shard, 256, seed=step, special=step == 2).view(-1)
        g[exact] = 0.0
        sends = {}
        for name, ef in efs.items():
            device = "cpu" if name == "cpu" else "cuda"
            grad, zero = g.to(device, copy=True), exact.to(device)
            if name == "fused":
                sends[name] = fc.compress_with_feedback("b", grad, dp, ef, comp, 0, zero)
            else:
                sends[name] = comp.compress_rows(ef.owed("b", grad).view(dp, -1))
                ef.stage("b", grad, sends[name], 0, comp, zero)
        assert torch.equal(sends["fused"].cpu(), sends["eager"].cpu())
        assert torch.equal(sends["fused"].cpu(), sends["cpu"])
        staged = [ef.staged("b").payload.cpu() for ef in efs.values()]
        assert torch.equal(staged[0], staged[1]) and torch.equal(staged[0], staged[2])
        for ef in efs.values():
            ef.commit()
        got = fc.sum_rows(comp, sends["fused"], shard)
        assert cases.same_floats(got.cpu(), comp.decompress_rows_sum(sends["eager"], shard).cpu())
        assert cases.same_floats(got.cpu(), comp.decompress_rows_sum(sends["cpu"], shard))
