"""Gradient storage per bucket (megatron/grad_storage.py) on plain CPU tensors: the states a
bucket goes through in a step, what the optimizer reads, and the fused-wgrad allocation."""

from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.megatron.grad_storage import EMPTY, FULL, SHARD, BucketGrads, GradStorage, reads_after_sync


def _bucket(sizes=(6, 10), dp=2, rank=0, late=()):
    """A megatron-like bucket: one flat gradient tensor, params whose main_grad are views."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    total = sum(sizes)
    total += (-total) % dp
    grad = torch.zeros(total)
    start = 0
    for p in params:
        p.main_grad = grad[start:start + p.numel()]
        start += p.numel()
    bucket = SimpleNamespace(grad_data=grad, params_list=params)
    return bucket, BucketGrads(bucket, rank, dp, [params[i] for i in late])


def test_states_of_a_step_and_the_bytes_they_hold():
    bucket, g = _bucket()
    assert g.state == FULL and g.resident_bytes() == 16 * 4
    g.drop()
    assert g.state == EMPTY and g.resident_bytes() == 0
    assert bucket.grad_data.untyped_storage().nbytes() == 0   # really freed
    g.ensure()
    assert g.state == FULL and bucket.grad_data.untyped_storage().nbytes() == 64
    assert bool((bucket.grad_data == 0).all())                  # zeroed on allocation
    bucket.params_list[0].main_grad.add_(1.0)                  # the views write into it
    bucket.grad_data[8:].fill_(5.0)                            # rank 1's shard
    g.release()
    assert g.state == SHARD and g.resident_bytes() == 8 * 4   # this rank's shard only
    assert bucket.grad_data.untyped_storage().nbytes() == 0
    assert g.shard.tolist() == [1.0] * 6 + [0.0] * 2


def test_optimizer_reads_the_shard_by_megatron_ranges():
    bucket, g = _bucket(rank=1)
    g.ensure()
    bucket.grad_data.copy_(torch.arange(16, dtype=torch.float32))
    g.release()
    # Param 1 occupies bucket elements 6..16; rank 1 owns 8..16 (its elements 2..10).
    got = g.param_grad(bucket.params_list[1], SimpleNamespace(start=2, end=10),
                       SimpleNamespace(start=8, end=16, size=8))
    assert got.tolist() == list(range(8, 16))
    g.scale(0.5)
    assert g.shard.tolist() == [x / 2 for x in range(8, 16)]


def test_late_params_keep_their_own_copy_until_the_step_ends():
    """megatron all-reduces e.g. sequence-parallel layernorm grads after the DP sync: main_grad
    must stay valid, and what the optimizer reads is the value after that all-reduce."""
    bucket, g = _bucket(late=(1,))
    view = bucket.params_list[1].main_grad
    g.ensure()
    bucket.grad_data.fill_(1.0)
    g.release()
    p = bucket.params_list[1]
    assert p.main_grad is not view and p.main_grad.tolist() == [1.0] * 10
    p.main_grad.mul_(3.0)                                      # finalize_model_grads' all-reduce
    got = g.param_grad(p, SimpleNamespace(start=0, end=2), SimpleNamespace(start=6, end=8, size=2))
    assert got.tolist() == [3.0, 3.0]
    assert g.resident_bytes() == (8 + 10) * 4
    g.drop()
    assert p.main_grad is view and g.resident_bytes() == 0     # restored for the next backward


def test_a_gradient_after_the_sync_is_refused():
    _, g = _bucket()
    g.release()
    with pytest.raises(RuntimeError, match="after its sync had finished"):
        g.ensure()
    g.drop()
    with pytest.raises(RuntimeError, match="had none this step"):
        g.param_grad(g.bucket.params_list[0], SimpleNamespace(start=0, end=1),
                     SimpleNamespace(start=0, end=1, size=1))


def test_storage_tracks_the_step_peak():
    storage = GradStorage(window=2)
    buckets = []
    for _ in range(3):
        b, g = _bucket()
        b.grpo_grads = g
        storage.add(g)
        buckets.append(b)
    storage.reset(buckets)
    assert storage.resident == 0 and storage.peak == 0
    for b in buckets:
        storage.ensure_param(b.params_list[0])
        b.grpo_grads.release()
        storage.released()
    # One full bucket at a time, then its shard: peak = two shards + one full bucket.
    assert storage.peak == 2 * 32 + 64 and storage.resident == 3 * 32
    storage.after_step()
    assert storage.resident == 0 and all(b.grpo_grads.state == EMPTY for b in buckets)


def test_reads_after_sync_follows_finalize_model_grads():
    cfg = SimpleNamespace(sequence_parallel=True, qk_layernorm=False)
    ln = torch.nn.Parameter(torch.zeros(2))
    ln.sequence_parallel = True
    emb = torch.nn.Parameter(torch.zeros(2))
    emb.shared_embedding = True
    plain = torch.nn.Parameter(torch.zeros(2))
    assert reads_after_sync(ln, cfg, tp_size=2, pp_size=1)
    assert not reads_after_sync(ln, cfg, tp_size=1, pp_size=1)
    assert reads_after_sync(emb, cfg, tp_size=1, pp_size=2)
    assert not reads_after_sync(emb, cfg, tp_size=1, pp_size=1)
    assert not reads_after_sync(plain, cfg, tp_size=2, pp_size=2)


class _FusedWgrad(torch.autograd.Function):
    """Stand-in for megatron's linear with gradient_accumulation_fusion: the weight gradient is
    accumulated into main_grad inside the layer's backward, before any grad-accumulation hook."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.weight = weight
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        if ctx.weight.main_grad.untyped_storage().nbytes() == 0:
            # On a real GPU this write lands in freed memory; here it is refused.
            raise RuntimeError("fused wgrad: main_grad has no storage")
        ctx.weight.main_grad.add_((grad_out.t() @ x).view(-1))
        ctx.weight.grad_added_to_main_grad = True
        return grad_out @ weight, None


def _released_unit_of(weight):
    """One bucket holding ``weight``, its flat main_grad released (zero bytes), as after
    zero_grad_buffer: (the flat gradient, its BucketGrads, the GradStorage)."""
    grad = torch.zeros(weight.numel())
    weight.main_grad = grad  # flat, as the fused double writes it
    bucket = SimpleNamespace(grad_data=grad, params_list=[weight])
    g = BucketGrads(bucket, 0, 1, [])
    bucket.grpo_grads = g
    storage = GradStorage(window=1)
    storage.add(g)
    storage.reset([bucket])
    assert grad.untyped_storage().nbytes() == 0
    return grad, g, storage


def test_fused_wgrad_finds_its_storage_allocated():
    """With fusion the allocation must come from the module's output gradient: the same hook
    GRPODistributedDataParallel registers (_grpo_pre_backward_hooks) on a real module."""
    from megatron_grpo.megatron.ddp import GRPODistributedDataParallel

    lin = torch.nn.Linear(4, 3, bias=False)
    grad, g, storage = _released_unit_of(lin.weight)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return _FusedWgrad.apply(x, self.lin.weight)

    fake = SimpleNamespace(module=Holder())
    lin.forward = lambda x: _FusedWgrad.apply(x, lin.weight)
    x = torch.randn(5, 4)
    with pytest.raises(RuntimeError, match="no storage"):  # without the hooks
        fake.module.lin(x).sum().backward()
    GRPODistributedDataParallel._grpo_pre_backward_hooks(fake, storage)
    fake.module.lin(x).sum().backward()
    assert g.state == FULL
    assert torch.allclose(grad.view(3, 4), torch.ones(5, 3).t() @ x)


def test_fused_wgrad_through_a_shared_weight_finds_its_storage_allocated():
    """Tied embeddings (megatron's default, PP 1): the output layer owns no parameter and is
    handed the word embedding's weight as ``weight=``. Its fused wgrad GEMM is the first op of
    backward and writes the embedding's ``main_grad``; the embedding's own gradient is added
    later by DDP's hook. Both must land in allocated storage, and neither may wipe the other."""
    from megatron_grpo.megatron.ddp import GRPODistributedDataParallel

    emb = torch.nn.Embedding(7, 4)
    grad, g, storage = _released_unit_of(emb.weight)

    class OutputLayer(torch.nn.Module):
        """megatron's ColumnParallelLinear with skip_weight_param_allocation: no parameter."""

        def forward(self, x, weight=None):
            return _FusedWgrad.apply(x, weight)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = emb
            self.output_layer = OutputLayer()

        def forward(self, tokens):
            return self.output_layer(self.embedding(tokens), weight=self.embedding.weight)

    def ddp_hook(p):  # GRPODistributedDataParallel's allocate_then_hook + megatron's own
        storage.ensure_param(p)
        p.main_grad.add_(p.grad.view(-1))
        p.grad = None
    emb.weight.register_post_accumulate_grad_hook(ddp_hook)

    fake = SimpleNamespace(module=Model())
    assert list(fake.module.output_layer.parameters()) == []
    tokens = torch.tensor([1, 2, 3, 1])
    GRPODistributedDataParallel._grpo_pre_backward_hooks(fake, storage)
    upstream = torch.randn(4, 7)
    (fake.module(tokens) * upstream).sum().backward()
    assert g.state == FULL

    # The exact sum of both contributions, computed without any of the machinery.
    w = emb.weight.detach().clone().requires_grad_(True)
    x = w[tokens]
    ((x @ w.t()) * upstream).sum().backward()
    assert torch.allclose(grad.view(7, 4), w.grad, atol=1e-6)


def test_tied_head_with_a_bias_runs_its_first_forward():
    """A BERT/T5-style head: it owns a bias and is called with the tied word embedding's weight.
    The forward hook gathers the parameters a module is called with; gathering them with a
    list's ``in`` compared the weight [7, 4] with the bias [7] by ``==`` and raised."""
    from megatron_grpo.megatron.ddp import GRPODistributedDataParallel

    emb = torch.nn.Embedding(7, 4)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(7))

        def forward(self, x, weight=None):
            return x @ weight.t() + self.bias

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = emb
            self.head = Head()

        def forward(self, tokens):
            return self.head(self.embedding(tokens), weight=self.embedding.weight)

    model = Model()
    grad = torch.zeros(7 * 4 + 7)
    emb.weight.main_grad = grad[:28]
    model.head.bias.main_grad = grad[28:]
    bucket = SimpleNamespace(grad_data=grad, params_list=[emb.weight, model.head.bias])
    g = BucketGrads(bucket, 0, 1, [])
    bucket.grpo_grads = g
    storage = GradStorage(window=1)
    storage.add(g)
    storage.reset([bucket])
    GRPODistributedDataParallel._grpo_pre_backward_hooks(SimpleNamespace(module=model), storage)
    out = model(torch.tensor([1, 2, 3]))
    assert out.shape == (3, 7)
    out.sum().backward()
    assert g.state == FULL  # the head's output gradient made the shared bucket resident
