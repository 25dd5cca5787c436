"""Planned layers inside an outer checkpoint: the outer one's recompute, in the backward, calls their checkpoint
functions again, and torch checks that it saves what its forward saved.

In the forward the first layer's input moves; in the recompute that same tensor (a non-reentrant checkpoint recomputes
with the objects it was given) has moved already in this forward, so nothing of the call moves. The call must still run
under the engine's hooks: without them its saves reach the outer checkpoint, which saw none in its forward, and shift
the saves after it (the next layer's states) to other places; the backward raised ``CheckpointError`` until the hooks
were installed for every offloading call. Under a reentrant outer checkpoint the layers run without grad in the
forward and save only in its recompute, inside the backward: there nothing moves and nothing counts (issue 50, Swin).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conftest import offloading, run_steps, same_grads
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from autooffload import AutoOffloadWarning

LAYERS, HIDDEN, VOCAB, BATCH, SEQ = 3, 32, 64, 2, 16


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden, encoder_hidden_states):
        return hidden + self.mix(hidden).tanh() * encoder_hidden_states.sigmoid()


class Net(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.project = torch.nn.Linear(HIDDEN, HIDDEN)
        self.layers = torch.nn.ModuleList(checkpoint_wrapper(Layer(), preserve_rng_state=False) for _ in range(LAYERS))

    def get_input_embeddings(self):
        return self.embed

    def run_layers(self, hidden):
        for layer in self.layers:  # each layer's states made beside it, as a Q-Former's are for its layer
            hidden = layer(hidden, self.project(hidden))
        return hidden

    def forward(self, input_ids):
        hidden = checkpoint(self.run_layers, self.embed(input_ids), use_reentrant=self.reentrant)
        return hidden.pow(2).mean()


@pytest.mark.parametrize("engine", ["sync", "stream"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_layers_inside_an_outer_checkpoint_train_as_plain_checkpointing(reentrant, engine):
    # Bytes too: the outer recompute's calls are no new calls (counted, each layer would be planned at twice its
    # input) and move nothing more (their copies would never come back).
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    _, _, reference = run_steps(Net(reentrant).train(), ids)
    net = Net(reentrant).train()
    moved, arithmetic, grads = run_steps(net, ids, offloading(net, engine))
    layer_input = BATCH * SEQ * HIDDEN * 4  # the hidden states, and as much of states each layer owns
    layers = LAYERS - 1 if engine == "stream" else LAYERS  # the stream engine keeps the last layer's inputs
    if reentrant:
        # A reentrant outer checkpoint runs its forward without grad: the layers save only in its backward's
        # recompute, whose own backward follows at once, so a copy there would free nothing (issue 50): none is made,
        # none counted.
        assert moved == [0, 0]
        assert not any(arithmetic)
    else:
        assert moved == [2 * layers * layer_input] * 2
        assert arithmetic == [2 * LAYERS * layer_input] * 2
    assert same_grads(grads, reference)


def swin() -> torch.nn.Module:
    """A tiny random Swin (three stages of 1, 2 and 1 blocks) under reentrant checkpointing: each stage checkpoints
    itself and each of its blocks."""
    from transformers import SwinConfig, SwinModel

    torch.manual_seed(0)
    config = SwinConfig(
        image_size=32, patch_size=2, embed_dim=16, depths=[1, 2, 1], num_heads=[2, 2, 4], window_size=2, mlp_ratio=2.0
    )
    net = SwinModel(config).train()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return net


def swin_steps(net: torch.nn.Module, end_step=None) -> list[list[torch.Tensor]]:
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    grads = []
    for _ in range(2):
        net.zero_grad()
        torch.manual_seed(2)  # drop path
        net(pixel_values=pixels).last_hidden_state.pow(2).mean().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        if end_step is not None:
            end_step()
    return grads


@pytest.mark.parametrize("engine", ["sync", "stream"])
def test_blocks_of_a_stage_left_alone_copy_nothing_in_its_recompute_and_report_only_what_the_forward_moved(engine):
    # Swin's first stage, its function wrapped as transformers' own test wraps it (autooffload leaves a function it
    # does not own), runs its blocks under no_grad in the forward: nothing of theirs moves there. In the stage's
    # recompute, in the backward, they save their inputs; a copy of those frees nothing, and was reported as offloaded
    # (57,344 bytes a step here against the 24,576 the forwards moved).
    net = swin()
    stage = net.encoder.layers[0]
    if not hasattr(stage, "_gradient_checkpointing_func"):
        pytest.skip("this transformers checkpoints Swin's stages from the encoder's loop: no stage function to wrap")
    reference = swin_steps(swin())
    with mock.patch.object(stage, "_gradient_checkpointing_func", side_effect=stage._gradient_checkpointing_func):
        with pytest.warns(AutoOffloadWarning, match="encoder.layers.0"):
            controller = offloading(net, engine)
        moved, arithmetic = [], []

        def end_step():
            arithmetic.append(controller.planned_bytes())
            controller.end_step()
            moved.append(controller.last_step_bytes)

        grads = swin_steps(net, end_step)
        assert stage._gradient_checkpointing_func.call_count == 2  # the stage ran wrapped, once a step
    # The planned layers that run in the forward: stages 1 and 2 (64 tokens of 32, 16 tokens of 64, batch 2, fp32).
    stage_inputs = [2 * 64 * 32 * 4, 2 * 16 * 64 * 4]
    forwards = sum(stage_inputs[:-1]) if engine == "stream" else sum(stage_inputs)  # stream: the last one stays
    assert moved == [forwards] * 2
    assert arithmetic == [sum(stage_inputs)] * 2
    assert same_grads(grads, reference)
