"""A checkpointed layer that holds another (Zamba's and Zamba2's hybrid layers: each runs its own
``mamba_decoder``, itself a ``GradientCheckpointingLayer``, inside its checkpoint): only the outer layers are
planned; the nested one keeps plain checkpointing, its call runs inside its parent's checkpoint (where the parent's
frame, not the engine's hooks, saves what it receives), so every step moves each outer layer's input once, what the
arithmetic says, and the gradients are plain checkpointing's.

In the backward the parent's recompute runs on its input restored from host memory, a new tensor: the nested call
made there receives that copy, not the object the forward passed (under plain checkpointing the saved input unpacks
to the same object). A sweep that tells layer inputs apart by identity counts that call as one more layer input.
"""

from __future__ import annotations

import functools

import torch
from conftest import offloading, run_steps, same_grads
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from autooffload.observe.targets import find_targets

LAYERS, HIDDEN, VOCAB, BATCH, SEQ = 3, 32, 64, 2, 16


class Inner(GradientCheckpointingLayer):
    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden, side=None):
        return hidden + self.mix(hidden + side).tanh()


class Hybrid(GradientCheckpointingLayer):
    def __init__(self) -> None:
        super().__init__()
        self.side = torch.nn.Linear(HIDDEN, HIDDEN)
        self.inner = Inner()

    def forward(self, hidden):
        return self.inner(hidden, side=self.side(hidden).sigmoid())


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(Hybrid() for _ in range(LAYERS))
        function = functools.partial(checkpoint, use_reentrant=False)
        for module in self.modules():
            if isinstance(module, GradientCheckpointingLayer):
                module.gradient_checkpointing, module._gradient_checkpointing_func = True, function

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden.pow(2).mean()


def test_only_the_outer_layers_are_planned():
    targets, unknown = find_targets(Net())
    assert not unknown
    kinds = {t.name: (t.kind, t.text) for t in targets}
    assert kinds == {
        **{f"layers.{i}": ("layer", True) for i in range(LAYERS)},
        **{f"layers.{i}.inner": ("inner", False) for i in range(LAYERS)},
    }


def steps(on: bool):
    net = Net()
    net.train()
    controller = offloading(net) if on else None
    if on:
        assert len(controller.switch.layers) == LAYERS
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return run_steps(net, ids, controller)


def test_a_nested_checkpointed_layer_moves_nothing_of_its_own():
    *_, reference = steps(on=False)
    moved, arithmetic, grads = steps(on=True)
    assert moved == [LAYERS * BATCH * SEQ * HIDDEN * 4] * 2  # each outer layer's input, once; no second copy
    assert arithmetic == moved
    assert same_grads(grads, reference)
