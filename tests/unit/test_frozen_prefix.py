"""Frozen units at the bottom of the model cost no backward (megatron_grpo.megatron.frozen_prefix):
with the embedding and the lowest layers frozen, the backward stops at the first trainable
layer; the trainable parameters' gradients are those of the full backward, bit for bit."""

import torch

from megatron_grpo.megatron.frozen_prefix import FrozenPrefix


class Layer(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, hidden_states, attention_mask=None):
        return torch.tanh(self.fc(hidden_states))


class Block(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(i) for i in range(n))

    def forward(self, hidden_states):
        # megatron's TransformerBlock makes its input require a gradient whatever feeds it
        hidden_states = hidden_states.detach().requires_grad_() if not hidden_states.requires_grad \
            else hidden_states
        for layer in self.layers:
            hidden_states = layer(hidden_states=hidden_states, attention_mask=None)
        return hidden_states


class GPT(torch.nn.Module):
    """The shape frozen_prefix reads: .embedding, .decoder.layers, .pre_process."""

    def __init__(self, n=4):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(10, 8)
        self.decoder = Block(n)
        self.pre_process = True

    def forward(self, tokens):
        return self.decoder(self.embedding(tokens)).sum()


def _chunk(model):
    return type("Chunk", (), {"module": model})()


def _freeze(model, layers):
    for p in model.embedding.parameters():
        p.requires_grad_(False)
    for layer in model.decoder.layers[:layers]:
        for p in layer.parameters():
            p.requires_grad_(False)


def _backward(model, prefix=None):
    reached = []
    model.decoder.layers[0].register_full_backward_hook(lambda *a: reached.append(0))
    if prefix is not None:
        prefix.begin_step()
    model(torch.tensor([[1, 2, 3]])).backward()
    return reached, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_backward_stops_at_the_first_trainable_layer_and_trains_the_same_bits():
    full, cut = GPT(), GPT()
    _freeze(full, 2)
    _freeze(cut, 2)
    prefix = FrozenPrefix([_chunk(cut)])
    reached_full, grads_full = _backward(full)
    reached_cut, grads_cut = _backward(cut, prefix)
    assert prefix.cut == 2
    assert reached_full == [0] and reached_cut == []  # layer 0's backward never runs
    assert grads_full.keys() == grads_cut.keys() == {f"decoder.layers.{i}.fc.{w}" for i in (2, 3)
                                                     for w in ("weight", "bias")}
    assert all(torch.equal(grads_full[k], grads_cut[k]) for k in grads_full)


def test_no_cut_while_the_embedding_trains_or_the_lowest_layer_does():
    model = GPT()
    prefix = FrozenPrefix([_chunk(model)])
    assert prefix.begin_step() == 0  # nothing frozen
    for layer in model.decoder.layers[:2]:
        for p in layer.parameters():
            p.requires_grad_(False)
    assert prefix.begin_step() == 0  # the embedding needs the data gradient
    _freeze(model, 0)
    model.decoder.layers[0].fc.bias.requires_grad_(True)  # part of layer 0 trains
    assert prefix.begin_step() == 0
    _freeze(model, 4)
    assert prefix.begin_step() == 3  # the top layer is never cut below itself


def test_a_later_pipeline_stage_never_cuts():
    model = GPT()
    model.pre_process = False
    _freeze(model, 4)
    prefix = FrozenPrefix([_chunk(model)])
    assert prefix.begin_step() == 0 and prefix.layers == []
