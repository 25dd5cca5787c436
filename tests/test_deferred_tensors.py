"""A layer's second tensor under a name layers usually share waits for the forward's end before it moves
(:mod:`autooffload.apply.layer_inputs`): what that wait must survive in a real run.

A trainer that disables and enables checkpointing around a reference forward makes autooffload rebuild its functions
as the next forward begins: that forward's end must still settle what it deferred. A forward that raises part way (an
out-of-memory error the rescue reruns) must teach nothing: a tensor the layers after would have received looks like
the first layer's own.
"""

from __future__ import annotations

import contextlib

import torch
from conftest import offloading
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

HIDDEN, VOCAB, LAYERS, BATCH, SEQ = 32, 64, 3, 2, 16
LAYER_INPUT = BATCH * SEQ * HIDDEN * 4


class CrossLayer(GradientCheckpointingLayer):
    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden, encoder_hidden_states):
        return hidden + self.mix(hidden).tanh() * encoder_hidden_states.sigmoid()


class TinyConfig(PretrainedConfig):
    model_type = "tiny-cross"


class TinyCross(PreTrainedModel):
    """Each layer reads cross-attention states (``shared``: one tensor for all, else one of its own each)."""

    config_class = TinyConfig
    supports_gradient_checkpointing = True

    def __init__(self, config: TinyConfig, shared: bool = False) -> None:
        super().__init__(config)
        self.shared = shared
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.project = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        self.layers = torch.nn.ModuleList(CrossLayer() for _ in range(LAYERS))
        self.fail_after_first = False

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        common = self.project[0](hidden)
        for index, (project, layer) in enumerate(zip(self.project, self.layers, strict=True)):
            hidden = layer(hidden, common if self.shared else project(hidden))
            if self.fail_after_first and index == 0:
                raise torch.OutOfMemoryError("out of memory (a stand-in, after the first layer)")
        return hidden.pow(2).mean()


def model(shared: bool = False) -> TinyCross:
    torch.manual_seed(0)
    net = TinyCross(TinyConfig(), shared)
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    return net


IDS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def test_a_forward_after_a_trainers_disable_and_enable_still_moves_what_it_deferred():
    net = model()
    controller = offloading(net)
    moved = []
    for _ in range(3):
        net.gradient_checkpointing_disable()  # TRL's reference forward, between a disable and an enable
        with torch.no_grad():
            net(IDS)
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        net(IDS).backward()
        controller.end_step()
        moved.append(controller.last_step_bytes)
    assert moved == [LAYERS * 2 * LAYER_INPUT] * 3  # every layer's input and its own states, from the first step


def test_a_forward_that_raised_teaches_nothing_about_whose_a_tensor_is():
    net = model(shared=True)
    controller = offloading(net)
    net.fail_after_first = True
    with contextlib.suppress(torch.OutOfMemoryError):
        net(IDS)
    net.fail_after_first = False
    moved = []
    for _ in range(2):
        net(IDS).backward()
        controller.end_step()
        moved.append(controller.last_step_bytes)
    # the failed forward copied its first layer's input before it raised; the shared states never move
    assert moved == [(LAYERS + 1) * LAYER_INPUT, LAYERS * LAYER_INPUT]
    assert controller.sizes.planned_layer_bytes == (LAYER_INPUT,) * LAYERS  # each layer's own input, nothing shared
