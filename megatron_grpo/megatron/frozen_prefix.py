"""Frozen units at the bottom of the model cost no backward (Egeria, AutoFreeze).

With ``--grpo-stable-mode frozen`` a stable unit's parameters stop requiring gradients between
updates, which saves their weight gradients. When the frozen parameters include the whole
embedding and every parameter of the lowest layers, the data gradients below the first
trainable layer have no use either. megatron's ``TransformerBlock`` still marks its input as
requiring a gradient (``make_viewless_tensor(requires_grad=True)``), so autograd would carry
data gradients down through the frozen layers to the embedding. A forward pre-hook on the first
trainable layer detaches its input instead, so the backward stops there.

The cut is found at the start of each step, after GRPO has set ``requires_grad``. It is the
number of leading layers on the first pipeline stage whose parameters are all frozen, and it is
0 whenever the embedding trains: the embedding needs the data gradient. Later pipeline stages
never cut, because the stage below needs their input's gradient.
"""

from __future__ import annotations

from typing import List, Optional


def _decoder_and_embedding(module):
    """(the TransformerBlock's layers, the embedding module) of a GPTModel on the first pipeline
    stage; (None, None) elsewhere (no embedding: a later stage)."""
    for _, sub in module.named_modules():
        decoder, embedding = getattr(sub, "decoder", None), getattr(sub, "embedding", None)
        if decoder is not None and hasattr(decoder, "layers"):
            if embedding is None or not getattr(sub, "pre_process", True):
                return None, None
            return list(decoder.layers), embedding
    return None, None


class FrozenPrefix:
    """The backward's cut above the frozen bottom of the model, for one model chunk list."""

    def __init__(self, ddp_chunks: list) -> None:
        self.layers: List = []
        self.embedding = None
        self.cut = 0
        """Leading layers whose backward is skipped this step (0: none)."""
        for chunk in ddp_chunks[:1]:  # virtual pipeline: only the first chunk holds the embedding
            layers, embedding = _decoder_and_embedding(chunk.module)
            if layers:
                self.layers, self.embedding = layers, embedding
        for index, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(self._hook(index), with_kwargs=True)

    def _hook(self, index: int):
        def detach_input(module, args, kwargs):
            if index != self.cut or self.cut == 0:
                return None
            if "hidden_states" in kwargs:
                kwargs = dict(kwargs, hidden_states=kwargs["hidden_states"].detach())
                return args, kwargs
            if args:
                return (args[0].detach(),) + tuple(args[1:]), kwargs
            return None

        return detach_input

    def begin_step(self) -> Optional[int]:
        """Find this step's cut (after GRPO set requires_grad); returns it."""
        self.cut = 0
        if self.embedding is None or any(p.requires_grad for p in self.embedding.parameters()):
            return self.cut
        for layer in self.layers[:-1]:  # the top layer always trains something above the cut
            if any(p.requires_grad for p in layer.parameters()):
                break
            self.cut += 1
        return self.cut
