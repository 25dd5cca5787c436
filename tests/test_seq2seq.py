"""Encoder-decoder models through ``Seq2SeqTrainer``: both stacks planned, each with its own length.

Tiny random T5, BART and Whisper: 3 encoder and 3 decoder layers of hidden 64 in fp32, batch 2. A layer's saved
input is batch x its stack's length x 64 x 4 bytes: the encoder's with the source (Whisper: the input frames over
its convolutions' stride 2), the decoder's with the target (the labels the decoder inputs are built from).
"""

from __future__ import annotations

import json
import warnings
from unittest import mock

import pytest
import torch
import transformers
from conftest import offloading, same_grads, training_args
from torch.utils.data import SequentialSampler
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

from autooffload import AutoOffloadCallback, AutoOffloadWarning, OffloadController, Settings
from autooffload.observe.stacks import plan_stacks
from autooffload.observe.targets import find_targets

LAYERS, HIDDEN, VOCAB, BATCH = 3, 64, 256, 2
# (source, target) per optimizer step: the encoder's layers free the most on the first, the decoder's on the second.
SHAPES = [(96, 32), (16, 48)]
WHISPER_FRAMES = 96  # 2 x max_source_positions: the encoder's layers see 48 positions


def t5() -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=16,
        d_ff=2 * HIDDEN,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config)


def bart() -> torch.nn.Module:
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(config)


def whisper() -> torch.nn.Module:
    config = transformers.WhisperConfig(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN,
        num_mel_bins=16,
        max_source_positions=WHISPER_FRAMES // 2,
        max_target_positions=64,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.WhisperForConditionalGeneration(config)


MODELS = {"t5": t5, "bart": bart, "whisper": whisper}


def encoder_length(name: str, source: int) -> int:
    return WHISPER_FRAMES // 2 if name == "whisper" else source


class Pairs(torch.utils.data.Dataset):
    """``BATCH`` items per step of the step's (source, target) shape: token ids, or Whisper's mel frames."""

    def __init__(self, name: str, shapes: list[tuple[int, int]]) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = []
        for source, target in shapes:
            for _ in range(BATCH):
                labels = torch.randint(3, VOCAB, (target,), generator=generator)
                if name == "whisper":
                    item = {"input_features": torch.randn(16, WHISPER_FRAMES, generator=generator), "labels": labels}
                else:
                    item = {"input_ids": torch.randint(3, VOCAB, (source,), generator=generator), "labels": labels}
                self.items.append(item)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


class InOrder(Seq2SeqTrainer):
    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


class Record(TrainerCallback):
    def __init__(self, callback: AutoOffloadCallback) -> None:
        self.controller = callback.controller
        self.steps: list[tuple[int, int]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append((self.controller.level, self.controller.last_step_bytes))
        self.layers = len(self.controller.switch.layers)
        self.roles = [stack.role for stack in self.controller.layout.stacks]


class Fixed:
    def __init__(self, level: int) -> None:
        self.level = level

    def decide(self, observation) -> int:
        return self.level


def seq2seq(name: str, tmp_path, **callback_args):
    """Train ``name`` for len(SHAPES) steps; (per-step (level, bytes), losses, parameters, the Record)."""
    net = MODELS[name]()
    args = training_args(tmp_path, len(SHAPES), per_device_train_batch_size=BATCH, arguments=Seq2SeqTrainingArguments)
    callback = AutoOffloadCallback(probe=None, **callback_args)
    record = Record(callback)
    trainer = InOrder(model=net, args=args, train_dataset=Pairs(name, SHAPES), callbacks=[callback, record])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return record.steps, losses, [p.detach().clone() for p in net.parameters()], record


def layer_bytes(seq: int) -> int:
    return BATCH * seq * HIDDEN * 4


@pytest.fixture(scope="module", params=list(MODELS))
def plain(request, tmp_path_factory):
    return request.param, seq2seq(request.param, tmp_path_factory.mktemp("plain"), mode="off")


def test_mode_on_moves_both_stacks_inputs_with_the_gradients_of_plain_checkpointing(tmp_path, plain):
    name, reference = plain
    steps, losses, parameters, record = seq2seq(name, tmp_path, mode="on")
    assert record.layers == 2 * LAYERS
    assert record.roles == ["encoder", "decoder"]
    expected = [LAYERS * (layer_bytes(encoder_length(name, s)) + layer_bytes(t)) for s, t in SHAPES]
    assert steps == [(2 * LAYERS, moved) for moved in expected]
    assert losses == reference[1]
    assert all(torch.equal(p, q) for p, q in zip(parameters, reference[2], strict=True))


def test_a_partial_level_offloads_the_layers_that_free_the_most_first(tmp_path, plain):
    name, reference = plain
    steps, losses, parameters, _ = seq2seq(name, tmp_path, policy=Fixed(2))
    largest = [max(layer_bytes(encoder_length(name, s)), layer_bytes(t)) for s, t in SHAPES]
    assert steps == [(2, 2 * moved) for moved in largest]
    assert losses == reference[1]
    assert all(torch.equal(p, q) for p, q in zip(parameters, reference[2], strict=True))


def test_the_sequence_trigger_reads_the_longer_stack_and_each_micro_batch_is_decided_once(tmp_path):
    seen = []

    class Spy:
        def decide(self, observation):
            seen.append((observation.seq_len, observation.tokens, observation.layer_bytes))
            return 0

    seq2seq("bart", tmp_path, policy=Spy())
    assert [(seq, tokens) for seq, tokens, _ in seen] == [(max(s, t), BATCH * (s + t)) for s, t in SHAPES]
    first = seen[0][2]
    assert first == tuple([layer_bytes(96)] * LAYERS + [layer_bytes(32)] * LAYERS)


def test_hysteresis_switches_on_at_the_longer_of_the_two_lengths(tmp_path):
    steps, *_ = seq2seq("t5", tmp_path, seq_high=90, seq_low=20)
    assert [level for level, _ in steps] == [2 * LAYERS, 2 * LAYERS]  # 96 source tokens, then 48 target tokens


def test_t5_blocks_are_layers_and_its_attention_modules_are_not():
    net = t5()
    net.gradient_checkpointing_enable()
    targets, _ = find_targets(net)
    layers = [t.name for t in targets if t.text]
    expected_kind = "container" if transformers.__version__.startswith("4.") else "layer"
    assert {t.kind for t in targets if t.text} == {expected_kind}
    assert sum(t.size for t in targets if t.text) == 2 * LAYERS
    assert not any("Attention" in name for name in layers)


def test_stacks_that_cannot_be_told_apart_get_one_accurate_warning():
    class NoEncoder(transformers.BartForConditionalGeneration):
        def get_encoder(self):
            raise NotImplementedError

    torch.manual_seed(0)
    net = NoEncoder(bart().config)
    net.gradient_checkpointing_enable()
    stacks, warning = plan_stacks(net, find_targets(net)[0])
    assert [stack.name for stack in stacks] == ["model.decoder.layers"]
    assert warning is not None and warning[0] == "stacks-apart"
    assert "only model.decoder.layers is planned" in warning[1]
    assert "model.encoder.layers run(s) plain checkpointing" in warning[1]
    with pytest.warns(AutoOffloadWarning, match="cannot tell its encoder's") as caught:
        OffloadController(Settings(mode="on"), probe=None).attach(net)
    assert len([w for w in caught if "cannot tell" in str(w.message)]) == 1


def test_a_call_to_the_base_model_alone_is_decided_with_both_lengths():
    net = bart()
    net.gradient_checkpointing_enable()
    net.train()
    controller = OffloadController(Settings(mode="on"), probe=None)
    controller.attach(net)
    source, target = torch.randint(3, VOCAB, (BATCH, 40)), torch.randint(3, VOCAB, (BATCH, 24))
    out = net.model(input_ids=source, decoder_input_ids=target)
    out.last_hidden_state.sum().backward()
    controller.end_step()
    assert controller.sizes.batch.lengths == {
        "model.encoder.layers": (40, BATCH * 40),
        "model.decoder.layers": (24, BATCH * 24),
    }
    assert controller.last_step_bytes == LAYERS * (layer_bytes(40) + layer_bytes(24))
    controller.detach()


def test_after_a_rebuild_that_replans_the_stacks_each_call_is_decided_with_the_new_ones():
    """Checkpointing starts on the decoder alone (the encoder frozen, say), so attach plans one stack; then a
    trainer turns it off and on again for every module (TRL's reference forward), and the rebuild plans both.
    Before: the entry hooks kept what attach planned. The first call after the toggle was read with the old
    stacks (the encoder's layers sized at nothing), and the encoder, an entry only now, was not watched: called
    alone, its micro-batch was never decided. Now every call reads the stacks of the layout it runs with."""
    net = bart()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in net.model.encoder.modules():
        if hasattr(module, "gradient_checkpointing"):
            module.gradient_checkpointing = False
    net.train()
    controller = OffloadController(Settings(mode="on"), probe=None)
    with pytest.warns(AutoOffloadWarning, match="cannot tell its encoder's checkpointed stack from its decoder's"):
        controller.attach(net)  # one stack checkpointed: which one a call's input_ids are for is not told
    assert [stack.name for stack in controller.layout.stacks] == ["model.decoder.layers"]
    net.gradient_checkpointing_disable()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    source, target = torch.randint(3, VOCAB, (BATCH, 40)), torch.randint(3, VOCAB, (BATCH, 24))
    net(input_ids=source, decoder_input_ids=target, labels=target).loss.backward()
    controller.end_step()
    both = {"model.encoder.layers": (40, BATCH * 40), "model.decoder.layers": (24, BATCH * 24)}
    assert controller.sizes.batch.lengths == both
    assert controller.last_step_bytes == LAYERS * (layer_bytes(40) + layer_bytes(24))
    encoded = net.model.encoder(input_ids=torch.randint(3, VOCAB, (BATCH, 32)))
    assert controller.sizes.batch.lengths == {"model.encoder.layers": (32, BATCH * 32)}
    encoded.last_hidden_state.sum().backward()
    controller.end_step()
    assert controller.last_step_bytes == LAYERS * layer_bytes(32)
    controller.detach()


def prophetnet() -> torch.nn.Module:
    config = transformers.ProphetNetConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN,
        num_encoder_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_encoder_attention_heads=4,
        num_decoder_attention_heads=4,
        ngram=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.ProphetNetForConditionalGeneration(config)


def led() -> torch.nn.Module:
    config = transformers.LEDConfig(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN,
        attention_window=16,
        max_encoder_position_embeddings=128,
        max_decoder_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.LEDForConditionalGeneration(config)


@pytest.mark.parametrize("make", [prophetnet, led], ids=["prophetnet", "led"])
def test_the_next_decision_sizes_each_layer_by_what_its_first_call_took(make):
    """ProphetNet's decoder layers take 1 + ngram streams of the target, LED's encoder a source padded to its
    attention window: neither layer input is tokens x hidden. The first step's layer calls say what they are, and
    the second step's decision sizes every layer exactly."""
    net = make()
    net.gradient_checkpointing_enable()
    net.train()
    seen, inputs = [], {}

    class Spy:
        def decide(self, observation):
            seen.append(observation.layer_bytes)
            return 2 * LAYERS

    def record(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        inputs[module] = hidden.numel() * hidden.element_size()

    layers = [m for name, m in net.named_modules() if name.rpartition(".")[0].endswith("layers") and name[-1].isdigit()]
    assert len(layers) == 2 * LAYERS
    for layer in layers:
        layer.register_forward_pre_hook(record, with_kwargs=True)
    controller = OffloadController(Settings(engine="sync"), probe=None, policy=Spy())
    controller.attach(net)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        source = torch.randint(3, VOCAB, (BATCH, 40), generator=generator)
        labels = torch.randint(3, VOCAB, (BATCH, 24), generator=generator)
        net(input_ids=source, labels=labels).loss.backward()
        controller.end_step()
    assert sorted(seen[1]) == sorted(inputs.values())
    assert controller.history[-1].bytes_moved == sum(inputs.values())


def steps_with(make, resume_at=None, reset_at=None, steps=3):
    """(the decision's layer bytes, the bytes moved) of each step of a run that offloads one layer per micro-batch:
    the layer that frees the most. ``resume_at``: a new controller continues from the JSON of the state saved before
    that step; ``reset_at``: the controller starts a new run there (a second ``train()``)."""
    net = make()
    net.gradient_checkpointing_enable()
    net.train()
    seen = []

    class OneLayer:
        def decide(self, observation):
            seen.append(observation.layer_bytes)
            return 1

    controller = OffloadController(Settings(engine="sync"), probe=None, policy=OneLayer())
    controller.attach(net)
    generator = torch.Generator().manual_seed(0)
    moved = []
    for step in range(steps):
        if step == resume_at:
            state = json.loads(json.dumps(controller.state_dict()))
            controller.detach()
            controller = OffloadController(Settings(engine="sync"), probe=None, policy=OneLayer())
            controller.load_state_dict(state)
            controller.attach(net)
        if step == reset_at:
            controller.reset()
        source = torch.randint(3, VOCAB, (BATCH, 40), generator=generator)
        labels = torch.randint(3, VOCAB, (BATCH, 24), generator=generator)
        net(input_ids=source, labels=labels).loss.backward()
        controller.end_step()
        moved.append(controller.last_step_bytes)
    controller.detach()
    return list(zip(seen, moved, strict=True))


@pytest.mark.parametrize("make", [prophetnet, led], ids=["prophetnet", "led"])
def test_a_resumed_run_sizes_each_layer_as_the_uninterrupted_one(make):
    """What the first calls said of each stack (ProphetNet's decoder: 3 streams; LED's encoder: a padded source) is
    part of the saved state: after a resume the same layer is offloaded and sized as without the interruption."""
    assert steps_with(make, resume_at=2)[2] == steps_with(make)[2]


@pytest.mark.parametrize("make", [prophetnet, led], ids=["prophetnet", "led"])
def test_a_new_run_starts_from_the_config_as_the_first_one_did(make):
    """reset() drops the measured bytes per token, and with them what each stack's width was measured against."""
    assert steps_with(make, reset_at=2)[2] == steps_with(make)[0]


def speech_to_text() -> torch.nn.Module:
    config = transformers.Speech2TextConfig(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN,
        input_feat_per_channel=16,
        input_channels=1,
        num_conv_layers=2,
        conv_channels=32,
        conv_kernel_sizes=(5, 5),
        max_source_positions=64,
        max_target_positions=64,
        pad_token_id=0,
        decoder_start_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.Speech2TextForConditionalGeneration(config)


@pytest.mark.parametrize(
    ("make", "features"),
    [(whisper, (BATCH, 16, WHISPER_FRAMES)), (speech_to_text, (BATCH, 45, 16))],
    ids=["whisper", "speech_to_text"],
)
def test_the_first_decision_sizes_a_speech_encoders_layers_from_its_features(make, features):
    """Before any layer call, the speech encoder's layer input is read from the features: Whisper's [batch, mels,
    frames] over a stride-2 convolution, Speech2Text's [batch, frames, features] over two (45 -> 23 -> 12). The
    first step's decision must size each layer as its call then takes (the conformance sweep cannot tell: its
    arithmetic counts what the calls took)."""
    net = make()
    net.gradient_checkpointing_enable()
    net.train()
    seen, inputs = [], {}

    class Spy:
        def decide(self, observation):
            seen.append(observation.layer_bytes or (observation.bytes_per_layer,) * observation.layers)
            return 0

    def record(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        inputs[module] = hidden.numel() * hidden.element_size()

    for module in net.modules():
        if type(module).__name__.endswith(("EncoderLayer", "DecoderLayer")):
            module.register_forward_pre_hook(record, with_kwargs=True)
    controller = OffloadController(Settings(engine="sync"), probe=None, policy=Spy())
    controller.attach(net)
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(3, VOCAB, (BATCH, 24), generator=generator)
    net(input_features=torch.randn(*features, generator=generator), labels=labels).loss.backward()
    controller.end_step()
    assert len(inputs) == 2 * LAYERS
    assert sorted(seen[0]) == sorted(inputs.values())


def test_t5_with_its_first_blocks_function_wrapped_warns_of_no_stack_that_does_not_exist():
    # transformers' own test wraps the first checkpointed layer's function (mock.patch.object with a side_effect):
    # autooffload leaves that block. The attention module inside it carries the checkpointing flag and makes no
    # checkpoint call; taken for a layer, it was a stack "encoder.block.0.layer.0" whose length autooffload could not
    # read, and a warning said that what it saves stays on the device (issue 50).
    ids = torch.randint(1, VOCAB, (BATCH, 24), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(1, VOCAB, (BATCH, 16), generator=torch.Generator().manual_seed(1))

    def steps(net, controller=None):
        grads, moved, arithmetic = [], [], []
        torch.manual_seed(2)  # dropout
        for _ in range(2):
            net.zero_grad()
            net(input_ids=ids, labels=labels).loss.backward()
            grads.append([p.grad.clone() for p in net.parameters() if p.grad is not None])
            if controller is not None:
                arithmetic.append(controller.planned_bytes())
                controller.end_step()
                moved.append(controller.last_step_bytes)
        return grads, moved, arithmetic

    def checkpointed():
        net = t5().train()
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return net

    net = checkpointed()
    block = net.encoder.block[0]
    if not hasattr(block, "_gradient_checkpointing_func"):
        pytest.skip("this transformers checkpoints T5's blocks from the stack's loop: no block function to wrap")
    reference, _, _ = steps(checkpointed())
    with mock.patch.object(block, "_gradient_checkpointing_func", side_effect=block._gradient_checkpointing_func):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            controller = offloading(net)
            grads, moved, arithmetic = steps(net, controller)
        assert block._gradient_checkpointing_func.call_count == 2
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert not [message for message in ours if "stack-length" in message], ours
    assert len(ours) == 1 and "encoder.block.0 is not torch.utils.checkpoint.checkpoint" in ours[0]
    assert [slot.target.name for slot in controller.switch.layers] == [
        *(f"encoder.block.{index}" for index in range(1, LAYERS)),
        *(f"decoder.block.{index}" for index in range(LAYERS)),
    ]
    assert moved == arithmetic and moved[0] > 0
    assert same_grads(grads, reference)
