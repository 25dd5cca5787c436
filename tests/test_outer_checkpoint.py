"""Planned layers inside an outer checkpoint: the outer one's recompute, in the backward, calls their checkpoint
functions again, and torch checks that it saves what its forward saved.

In the forward the first layer's input moves; in the recompute that same tensor (a non-reentrant checkpoint recomputes
with the objects it was given) has moved already in this forward, so nothing of the call moves. The call must still run
under the engine's hooks: without them its saves reach the outer checkpoint, which saw none in its forward, and shift
the saves after it (the next layer's states) to other places; the backward raised ``CheckpointError`` until the hooks
were installed for every offloading call.
"""

from __future__ import annotations

import pytest
import torch
from conftest import offloading, run_steps, same_grads
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

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
    # A reentrant outer checkpoint runs its forward without grad: the layers save, and move, only in its backward's
    # recompute, where no forward's end follows to settle the states, so they move from the second step on.
    first = 1 if reentrant else 2
    assert moved == [first * layers * layer_input, 2 * layers * layer_input]
    assert arithmetic == [first * LAYERS * layer_input, 2 * LAYERS * layer_input]
    assert same_grads(grads, reference)
