"""Stacks beside the text stack (BLT's: a byte encoder, a global transformer on patches, a byte decoder and an entropy
patcher, each a ModuleList of ``GradientCheckpointingLayer``): every one that runs on what the model computes from its
tokens is planned, each with its own length and width, learned from its layers' first call; a stack whose length
nothing gives keeps plain checkpointing with a warning, never silently.

Before, only the stack nearest the token embedding was planned (BLT's one-layer byte encoder: 1 of 10 layers), and
the others kept plain checkpointing without a word.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import offloading, run_steps, same_grads
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from autooffload import AutoOffloadWarning, OffloadController, Settings
from autooffload.apply.host_memory import HostMemory
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


class Tower(torch.nn.Module):
    """A vision tower on ``images``, a name autooffload does not know for a raw input: 4 x 4 patches of 3 channels."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.patches = torch.nn.Linear(3 * 4 * 4, BYTE_WIDTH)
        self.layers = torch.nn.ModuleList(Layer(BYTE_WIDTH) for _ in range(layers))

    def forward(self, images):
        rows, channels, size, _ = images.shape
        hidden = images.reshape(rows, channels, size // 4, 4, size // 4, 4).permute(0, 2, 4, 1, 3, 5)
        hidden = self.patches(hidden.reshape(rows, (size // 4) ** 2, channels * 16))
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class CustomVlm(torch.nn.Module):
    """A decoder-only VLM of one's own: the tower's patches before the text, one text stack; the model takes the
    tokens and the images, the tower the images alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vision = Tower(2)
        self.text = Stack(BYTE_WIDTH, 3, embed=True)
        function = functools.partial(checkpoint, use_reentrant=False)
        for module in self.modules():
            if isinstance(module, GradientCheckpointingLayer):
                module.gradient_checkpointing, module._gradient_checkpointing_func = True, function

    def get_input_embeddings(self):
        return self.text.embed_tokens

    def forward(self, input_ids, images):
        hidden = torch.cat([self.vision(images), self.text.embed_tokens(input_ids)], dim=1)
        return self.text(inputs_embeds=hidden).pow(2).mean()


def test_a_tower_on_an_input_of_a_name_autooffload_does_not_know_is_named_in_a_warning_not_sized_from_the_text():
    """Its layers hold 64 patches an image whatever the text's length: sized from the text they would be wrong for
    every other length, so they keep plain checkpointing, and the warning says so."""
    net = CustomVlm()
    layout = ModelLayout.read(net)
    assert [stack.name for stack in layout.stacks] == ["text.layers"]
    assert [key for key, _ in layout.warnings] == ["stack-length"]
    assert "vision.layers" in layout.warnings[0][1]
    with pytest.warns(AutoOffloadWarning, match="vision.layers"):
        controller = offloading(net)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    images = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    net(ids, images).backward()
    controller.end_step()
    # the text stack's three layers move their input (the patches and the tokens); the tower's stay
    assert controller.last_step_bytes == 3 * BATCH * (64 + SEQ) * BYTE_WIDTH * 4


def test_a_stack_that_reports_before_the_first_stack_is_sized_right_at_the_next_decision():
    """BLT's patcher runs first: before anything moved, its report set the bytes per token, then the byte encoder's
    (the first stack) set them again; what the patcher showed must keep its bytes, not double with the new unit."""
    levels = []

    class NothingThenAll:
        def decide(self, observation):
            levels.append(0 if not levels else 9)
            return levels[-1]

    net = Blt()
    net.train()
    host = HostMemory(pin=True, register=lambda t: None, unregister=lambda t: None, drain=lambda d: None)
    controller = OffloadController(Settings(host_memory="1GiB"), probe=None, policy=NothingThenAll(), host=host)
    controller.attach(net)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    tokens = BATCH * SEQ
    byte, patch, patcher = tokens * BYTE_WIDTH * 4, tokens // PATCH * GLOBAL_WIDTH * 4, tokens * PATCHER_WIDTH * 4
    arithmetic = []
    for _ in range(2):
        net.zero_grad()
        net(ids).backward()
        arithmetic.append(controller.planned_bytes())
        controller.end_step()
    assert levels == [0, 9]
    assert controller.sizes.planned_layer_bytes == (byte, patch, patch, patch, byte, byte, patcher, patcher, patcher)
    assert controller.last_step_bytes == round(arithmetic[-1] or 0) == 3 * byte + 3 * patch + 3 * patcher


class MtpHead(torch.nn.Module):
    """A multi-token-prediction head: its own layers on the text stack's last hidden states."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(BYTE_WIDTH) for _ in range(layers))

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


class WithMtp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.text = Stack(BYTE_WIDTH, 3, embed=True)
        self.mtp = MtpHead(2)
        function = functools.partial(checkpoint, use_reentrant=False)
        for module in self.modules():
            if isinstance(module, GradientCheckpointingLayer):
                module.gradient_checkpointing, module._gradient_checkpointing_func = True, function

    def get_input_embeddings(self):
        return self.text.embed_tokens

    def forward(self, input_ids):
        hidden = self.text(input_ids)
        return hidden.pow(2).mean() + self.mtp(hidden).pow(2).mean()


def test_a_multi_token_prediction_head_on_the_text_hidden_states_is_planned_and_moves():
    """Before, its layers kept plain checkpointing, with a ``stack-length`` warning: its module does not take the
    tokens, and the rule that keeps a custom tower on ``images=`` from being sized by the text took it for one."""
    net = WithMtp()
    layout = ModelLayout.read(net)
    assert [stack.name for stack in layout.stacks] == ["text.layers", "mtp.layers"] and layout.warnings == ()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    _, _, plain = run_steps(WithMtp(), ids)
    moved, arithmetic, grads = run_steps(net, ids, offloading(net))
    assert moved == [round(a) for a in arithmetic] == [5 * BATCH * SEQ * BYTE_WIDTH * 4] * 2
    assert same_grads(grads, plain)


def canine():
    """A tiny CANINE: a one-layer character encoder on the characters' embeddings, a deep encoder on molecules (four
    characters each), a one-layer character encoder on the characters again; each layer checkpointed."""
    from transformers import CanineConfig, CanineForTokenClassification

    config = CanineConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, downsampling_rate=4,
        local_transformer_stride=8, num_hash_buckets=128, upsampling_kernel_size=4, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    net = CanineForTokenClassification(config)
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return net.train()


class Classified(torch.nn.Module):
    """``net``'s loss on a batch of character ids, each labelled: what :func:`run_steps` trains."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids, labels=ids % 2).loss


def test_canines_character_encoders_are_planned_and_every_checkpointed_input_moves():
    """CANINE's character encoders run on what the model computed from its characters (their forward takes
    ``hidden_states``) beside the deep encoder: all three stacks are planned, and mode ``on`` moves every checkpointed
    layer's input, as the arithmetic says. Before, the deep encoder's two layers alone moved (8 of 40 KiB a step)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.conformance.calls import CheckpointCalls

    chars = 64
    ids = torch.randint(5, 120, (BATCH, chars), generator=torch.Generator().manual_seed(1))
    _, _, plain = run_steps(Classified(canine()), ids, skip_unused=True)  # the pooler's: unused
    net = canine()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        controller = offloading(net)
        recorder = CheckpointCalls()
        with recorder.watching():
            moved, arithmetic, grads = run_steps(Classified(net), ids, controller, skip_unused=True)
    assert [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)] == []
    assert [stack.name for stack in controller.layout.stacks] == [
        "canine.encoder.layer", "canine.initial_char_encoder.layer", "canine.final_char_encoder.layer",
    ]  # fmt: skip
    characters, molecules = BATCH * chars * 32 * 4, BATCH * chars // 4 * 32 * 4
    assert [nbytes for _, nbytes in recorder.calls] == [characters, molecules, molecules, characters] * 2
    assert moved == [round(a) for a in arithmetic] == [recorder.bytes // 2] * 2
    assert controller.sizes.planned_layer_bytes == (characters, molecules, molecules, characters)
    assert same_grads(grads, plain)
