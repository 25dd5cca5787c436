"""Stacks beside the text stack (BLT's: a byte encoder, a global transformer on patches, a byte decoder and an entropy
patcher, each a ModuleList of ``GradientCheckpointingLayer``): every one that runs on what the model computes from its
tokens is planned, each with its own length and width, learned from its layers' first call; a stack whose length
nothing gives keeps plain checkpointing with a warning, never silently.

Before, only the stack nearest the token embedding was planned (BLT's one-layer byte encoder: 1 of 10 layers), and
the others kept plain checkpointing without a word.
"""

from __future__ import annotations

import functools

import torch
from conftest import offloading, run_steps, same_grads
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from autooffload.observe.layout import ModelLayout

VOCAB, BATCH, SEQ, PATCH = 64, 2, 16, 4
BYTE_WIDTH, GLOBAL_WIDTH, PATCHER_WIDTH = 16, 48, 8


class Layer(GradientCheckpointingLayer):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(width, width)

    def forward(self, hidden):
        return hidden + self.mix(hidden).tanh()


class Stack(torch.nn.Module):
    def __init__(self, width: int, layers: int, embed: bool = False) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, width) if embed else None
        self.layers = torch.nn.ModuleList(Layer(width) for _ in range(layers))

    def forward(self, input_ids=None, inputs_embeds=None):
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class Blt(torch.nn.Module):
    """BLT's shape: the embedding inside the byte encoder (one layer); the global transformer on patches (a quarter
    of the length, wider); the byte decoder; the patcher, first in the forward, under grad, last in module order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.local_encoder = Stack(BYTE_WIDTH, 1, embed=True)
        self.global_transformer = Stack(GLOBAL_WIDTH, 3)
        self.to_global = torch.nn.Linear(PATCH * BYTE_WIDTH, GLOBAL_WIDTH)
        self.from_global = torch.nn.Linear(GLOBAL_WIDTH, PATCH * BYTE_WIDTH)
        self.local_decoder = Stack(BYTE_WIDTH, 2)
        self.patcher = Stack(PATCHER_WIDTH, 3, embed=True)
        function = functools.partial(checkpoint, use_reentrant=False)
        for module in self.modules():
            if isinstance(module, GradientCheckpointingLayer):
                module.gradient_checkpointing, module._gradient_checkpointing_func = True, function

    def get_input_embeddings(self):
        return self.local_encoder.embed_tokens

    def forward(self, input_ids):
        entropy = self.patcher(input_ids).mean()
        hidden = self.local_encoder(input_ids)
        patches = self.to_global(hidden.reshape(BATCH, -1, PATCH * BYTE_WIDTH))
        patches = self.global_transformer(inputs_embeds=patches)
        hidden = hidden + self.from_global(patches).reshape(hidden.shape)
        return self.local_decoder(inputs_embeds=hidden).pow(2).mean() + entropy


def test_every_stack_beside_the_text_stack_is_planned():
    layout = ModelLayout.read(Blt())
    assert [stack.name for stack in layout.stacks] == [
        "local_encoder.layers",
        "global_transformer.layers",
        "local_decoder.layers",
        "patcher.layers",
    ]
    assert len(layout.layers) == 1 + 3 + 2 + 3
    assert not layout.warnings


def steps(on: bool):
    net = Blt()
    net.train()
    controller = offloading(net) if on else None
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return run_steps(net, ids, controller)


def test_every_layer_of_every_stack_moves_its_own_input():
    *_, reference = steps(on=False)
    moved, arithmetic, grads = steps(on=True)
    tokens = BATCH * SEQ
    inputs = (1 + 2) * tokens * BYTE_WIDTH + 3 * tokens // PATCH * GLOBAL_WIDTH + 3 * tokens * PATCHER_WIDTH
    assert moved == [inputs * 4] * 2
    # each stack sized with its own length and width, though no config gives a guess of the bytes per token
    assert [round(a) for a in arithmetic] == moved
    assert same_grads(grads, reference)


class Blocks(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(BYTE_WIDTH) for _ in range(layers))

    def forward(self, hidden):
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class NoTokens(torch.nn.Module):
    """Two stacks under a forward that takes no tokens and no raw input autooffload knows: the longer one is planned
    (the text rule's fallback, as before); the other cannot be sized."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Blocks(3)
        self.second = Blocks(2)
        function = functools.partial(checkpoint, use_reentrant=False)
        for module in self.modules():
            if isinstance(module, GradientCheckpointingLayer):
                module.gradient_checkpointing, module._gradient_checkpointing_func = True, function

    def forward(self, signal):
        return self.second(self.first(signal)).mean()


def test_a_stack_whose_length_nothing_gives_is_named_in_a_warning():
    layout = ModelLayout.read(NoTokens())
    assert [stack.name for stack in layout.stacks] == ["first.layers"]
    assert [key for key, _ in layout.warnings] == ["stack-length"]
    assert "second.layers" in layout.warnings[0][1]
