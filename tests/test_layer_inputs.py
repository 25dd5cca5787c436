"""A layer's second activation of its own moves with its input; what several layers share stays.

A tiny model whose layers (torch's ``CheckpointWrapper``) take ``(hidden, own, encoder_states)`` positionally: ``own``
is made by the layer before for this layer alone (as ZAYA's router states and Pegasus-X's global tokens are),
``encoder_states`` is one tensor every layer receives (as an encoder-decoder's decoder layers do). Bytes moved must
be every layer's hidden and own tensor, from the first step on, and equal autooffload's arithmetic; losses and
gradients equal plain checkpointing's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import offloading, run_steps, same_grads
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from autooffload import OffloadController, Settings

LAYERS, HIDDEN, OWN, VOCAB, BATCH, SEQ = 3, 32, 8, 64, 2, 16


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)
        self.read_own = torch.nn.Linear(OWN, HIDDEN)
        self.read_shared = torch.nn.Linear(HIDDEN, HIDDEN)
        self.make_own = torch.nn.Linear(HIDDEN, OWN)

    def forward(self, hidden, own, encoder_states):
        mixed = self.mix(hidden).tanh() * self.read_own(own).sigmoid()
        hidden = hidden + mixed + self.read_shared(encoder_states).tanh()
        return hidden, self.make_own(hidden)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.first_own = torch.nn.Linear(HIDDEN, OWN)
        self.shared = torch.nn.Linear(HIDDEN, HIDDEN)
        self.layers = torch.nn.ModuleList(checkpoint_wrapper(Layer(), preserve_rng_state=False) for _ in range(LAYERS))

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        own, shared = self.first_own(hidden), self.shared(hidden)
        for layer in self.layers:
            hidden, own = layer(hidden, own, shared)
        return hidden.pow(2).mean()


def steps(mode: str | None, level: int | None = None):
    class Fixed:
        def decide(self, observation):
            return level

    net = Net()
    net.train()
    controller = None
    if mode is not None:
        controller = OffloadController(Settings(mode=mode), probe=None, policy=Fixed() if level else None)
        controller.attach(net)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return run_steps(net, ids, controller, skip_unused=True)  # the last layer's make_own: its output is unused


def per_layer() -> int:
    return BATCH * SEQ * (HIDDEN + OWN) * 4


def test_every_layer_moves_its_input_and_its_own_second_activation_and_the_shared_tensor_stays():
    _, _, reference = steps(None)
    moved, arithmetic, grads = steps("on")
    assert moved == [LAYERS * per_layer()] * 2
    assert arithmetic == moved
    assert same_grads(grads, reference)


@pytest.mark.parametrize("level", [1, 2])
def test_a_partial_level_counts_each_layers_own_activation(level):
    moved, arithmetic, _ = steps("auto", level)
    assert moved == [level * per_layer()] * 2
    assert arithmetic == moved


def test_nothing_autooffload_notes_keeps_a_moved_input_alive():
    # The host copies stand in for the layer inputs: once the forward returns, nothing holds the originals (a
    # reference kept to learn which tensors layers share would keep every offloaded input on the device).
    import gc
    import weakref

    net = Net()
    net.train()
    controller = offloading(net)
    inputs: list[weakref.ref] = []
    for layer in net.layers:
        layer.register_forward_pre_hook(lambda module, args: inputs.append(weakref.ref(args[0])))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        inputs.clear()
        loss = net(ids)
        gc.collect()
        # the first layer's input is the embedding's output, which the model's own first_own and shared read (their
        # backward holds it); every later one was made by a layer and is held by nothing but the host copy
        assert [ref() is None for ref in inputs] == [False] + [True] * (LAYERS - 1)
        loss.backward()
        controller.end_step()
    assert controller.last_step_bytes == LAYERS * per_layer()


class RereadsOriginal(torch.nn.Module):  # Zamba's layers: the stack's original input, under a name of its own
    def __init__(self) -> None:
        super().__init__()
        self.read = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden, original_hidden_states):
        return hidden + self.read(original_hidden_states).tanh()


class RereadsBlocks(RereadsOriginal):  # Inkling-2's layers: the block states every layer of a block re-reads
    def forward(self, hidden, block_states):
        return hidden + self.read(block_states).tanh()


@pytest.mark.parametrize("layer_class", [RereadsOriginal, RereadsBlocks])
def test_a_tensor_every_layer_rereads_stays_from_the_first_step(layer_class):
    # Passed positionally to every layer, it reaches the first layer before any forward has shown it shared: that
    # layer must not move it (the device copy stays for the others; the host copy would be a wasted one).
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
            self.shared = torch.nn.Linear(HIDDEN, HIDDEN)
            self.layers = torch.nn.ModuleList(
                checkpoint_wrapper(layer_class(), preserve_rng_state=False) for _ in range(LAYERS)
            )

        def get_input_embeddings(self):
            return self.embed

        def forward(self, input_ids):
            hidden = self.embed(input_ids)
            shared = self.shared(hidden)
            for layer in self.layers:
                hidden = layer(hidden, shared)
            return hidden.pow(2).mean()

    net = Net()
    net.train()
    controller = OffloadController(Settings(mode="on"), probe=None)
    controller.attach(net)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    moved = []
    for _ in range(2):
        net(ids).backward()
        controller.end_step()
        moved.append(controller.last_step_bytes)
    assert moved == [LAYERS * BATCH * SEQ * HIDDEN * 4] * 2


class ReadsCrossStates(torch.nn.Module):  # a Q-Former layer: cross-attention states, under a name layers often share
    def __init__(self) -> None:
        super().__init__()
        self.read = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden, encoder_hidden_states):
        return hidden + self.read(encoder_hidden_states).tanh()


class CrossNet(torch.nn.Module):
    """Layer i reads ``states[i]``: each layer's own (``own=True``: Granite-4-Vision runs one Q-Former layer per tower
    feature, each with states of its own), or one tensor that every other layer reads (``own=False``: as Zamba passes
    its original input to every sixth layer, so the call after a reader does not receive it)."""

    def __init__(self, own: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.own = own
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.states = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        self.layers = torch.nn.ModuleList(
            checkpoint_wrapper(ReadsCrossStates(), preserve_rng_state=False) for _ in range(LAYERS)
        )

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        shared = self.states[0](hidden)
        for index, layer in enumerate(self.layers):
            states = self.states[index](hidden.detach() * 2) if self.own else shared
            hidden = layer(hidden, states) if self.own or index % 2 == 0 else layer(hidden, shared.detach())
        return hidden.pow(2).mean()


@pytest.mark.parametrize("engine", ["sync", "stream"])
@pytest.mark.parametrize("own", [True, False])
def test_a_tensor_under_a_shared_name_moves_from_the_first_step_if_it_is_one_layers_own(own, engine):
    # Before any forward has shown whether another layer receives it, the name says shared: it stays on the device
    # through the first forward and moves when that forward ends, if no other call received it. Deciding at the
    # next call would move the every-other-layer tensor (the next layer does not receive it, the one after does).
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    net = CrossNet(own)
    net.train()
    _, _, reference = run_steps(net, ids, skip_unused=True)  # shared: one of the states projections is read
    net = CrossNet(own)
    net.train()
    controller = offloading(net, engine)
    predicted = []
    net.register_forward_pre_hook(lambda *_: predicted.append(controller.sizes.planned_layer_bytes))
    moved, arithmetic, grads = run_steps(net, ids, controller, skip_unused=True)
    layers = LAYERS - 1 if engine == "stream" else LAYERS  # the stream engine keeps the last layer's inputs
    hidden = BATCH * SEQ * HIDDEN * 4
    expected = layers * 2 * hidden if own else layers * hidden
    assert moved == [expected] * 2
    assert arithmetic == [LAYERS * 2 * hidden if own else LAYERS * hidden] * 2
    assert sum(predicted[1]) == arithmetic[0]  # the second decision sizes every layer with what it really held
    assert same_grads(grads, reference)


class FirstLayerOwnsItsStates(CrossNet):
    """The first layer reads states of its own, the others one tensor they share, all under the same shared name."""

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        shared = self.states[1](hidden)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, self.states[0](hidden.detach() * 2) if index == 0 else shared)
        return hidden.pow(2).mean()


def test_a_first_step_that_moves_nothing_still_sizes_each_layer_with_what_it_holds():
    # The first layer's deferred states are known its own only when the forward ends; reported then, they widen that
    # layer alone, not the unit every other layer was measured in (which sized them all at twice their bytes).
    class NothingThenAll:
        def decide(self, observation):
            return 0 if not predicted else LAYERS

    from autooffload.apply.host_memory import HostMemory

    net = FirstLayerOwnsItsStates(True)
    net.train()
    host = HostMemory(pin=True, register=lambda t: None, unregister=lambda t: None, drain=lambda d: None)
    controller = OffloadController(Settings(host_memory="1GiB"), probe=None, policy=NothingThenAll(), host=host)
    controller.attach(net)
    predicted = []
    net.register_forward_pre_hook(lambda *_: predicted.append(controller.sizes.planned_layer_bytes))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    moved, _, _ = run_steps(net, ids, controller, skip_unused=True)
    hidden = BATCH * SEQ * HIDDEN * 4
    assert predicted[1] == (2 * hidden, hidden, hidden)
    assert moved == [0, 4 * hidden]
