"""Stacks that run on what a model computes from a raw input: a speech encoder on audio samples, wav2vec2's feature
extractor and transformer inside a speech encoder-decoder, a VLM's vision tower on pixels.

No token count gives their length before the forward. Mode ``on`` needs none: every layer of every stack moves. In
``auto`` each layer's bytes per element of the raw input, and the stack's length per element, are learned from its
first call, so the next micro-batch of the same input is sized exactly before its forward. What should move is
counted here by hooks on the layers themselves (each grad-enabled call's first positional tensor in the forward),
not by autooffload.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from autooffload import AutoOffloadWarning, OffloadController, Settings

BATCH, SAMPLES, TARGET, HIDDEN, VOCAB = 2, 6000, 12, 64, 256
# Checkpointing is turned on non-reentrantly, as transformers 5 does by default: transformers 4.52's Moonshine fails
# its own backward under its default, reentrant checkpointing ("Trying to backward through the graph a second time",
# with or without autooffload).
NON_REENTRANT = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
# The floor of the speech encoder-decoder (wav2vec2 inside SpeechEncoderDecoderModel): on transformers 4.52.4 it moves
# more than its layers' inputs (596,608 bytes against 462,464 in the model below; not yet explained), so it is
# supported from transformers 5 (docs/coverage.md).
SPEECH_ENCODER_DECODER_FLOOR = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="a speech encoder-decoder is supported from transformers 5 (on 4.52.4 it moves more than its layers' input)",
)


def moonshine() -> torch.nn.Module:
    config = transformers.MoonshineConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        encoder_num_hidden_layers=2,
        decoder_num_hidden_layers=3,
        encoder_num_attention_heads=4,
        decoder_num_attention_heads=4,
        encoder_num_key_value_heads=4,
        decoder_num_key_value_heads=4,
        pad_token_id=0,
        decoder_start_token_id=1,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.MoonshineForConditionalGeneration(config)


def speech_encoder_decoder() -> torch.nn.Module:
    encoder = transformers.Wav2Vec2Config(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=2 * HIDDEN,
        conv_dim=(16, 16, 16),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        layerdrop=0.0,
    )
    decoder = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * HIDDEN
    )
    config = transformers.SpeechEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    torch.manual_seed(0)
    return transformers.SpeechEncoderDecoderModel(config=config)


class LayerInputs:
    """Bytes of each planned layer's input in the forward (its first grad-enabled call), by the layers' own hooks."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.bytes: dict[int, int] = {}
        self.forward = True
        self.handles = [layer.register_forward_pre_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def _hook(self, index: int):
        def hook(module, args):
            if self.forward and torch.is_grad_enabled() and index not in self.bytes:
                tensor = next(a for a in args if torch.is_tensor(a))
                self.bytes[index] = tensor.numel() * tensor.element_size()

        return hook


def step(net, controller, batch, inputs: LayerInputs) -> None:
    inputs.bytes, inputs.forward = {}, True
    loss = net(**batch).loss
    inputs.forward = False
    loss.backward()
    controller.end_step()


def audio(samples: int = SAMPLES) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(3, VOCAB, (BATCH, TARGET), generator=generator)
    return {"input_values": torch.randn(BATCH, samples, generator=generator), "labels": labels}


def attached(net, **settings) -> tuple[OffloadController, LayerInputs]:
    net.gradient_checkpointing_enable(**NON_REENTRANT)
    net.train()
    controller = OffloadController(Settings(**settings), probe=None)
    assert controller.attach(net)
    layers = [slot.target.module for slot in controller.switch.layers]
    return controller, LayerInputs(layers)


def test_moonshine_mode_on_moves_every_layer_of_both_stacks_without_a_warning():
    net = moonshine()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        controller, inputs = attached(net, mode="on")
        assert [slot.target.stack for slot in controller.switch.layers] == ["model.encoder.layers"] * 2 + [
            "model.decoder.layers"
        ] * 3
        for samples in (SAMPLES, SAMPLES // 2):
            step(net, controller, audio(samples), inputs)
            assert len(inputs.bytes) == 5
            assert controller.last_step_bytes == sum(inputs.bytes.values())
    assert not [w for w in caught if issubclass(w.category, AutoOffloadWarning)]


def test_moonshine_auto_reads_the_encoders_length_from_what_its_first_layer_received():
    seen = []

    class Spy:
        def decide(self, observation):
            seen.append((observation.seq_len, observation.tokens))
            return 5

    net = moonshine()
    net.gradient_checkpointing_enable(**NON_REENTRANT)
    net.train()
    controller = OffloadController(Settings(), probe=None, policy=Spy())
    controller.attach(net)
    frames = []
    net.model.encoder.layers[0].register_forward_pre_hook(lambda m, args: frames.append(args[0].shape[1]))
    inputs = LayerInputs([slot.target.module for slot in controller.switch.layers])
    for _ in range(2):
        step(net, controller, audio(), inputs)
        # the decision before the forward sized every layer as its first call then showed
        assert controller.last_step_bytes == sum(inputs.bytes.values())
    assert controller.sizes.planned_layer_bytes == tuple(inputs.bytes[i] for i in range(5))
    assert frames[0] > TARGET
    # the first decision knew the target alone; the second the encoder's frames too, learned from its first layer
    assert seen == [(TARGET, BATCH * TARGET), (frames[0], BATCH * (frames[0] + TARGET))]
    assert controller.history[-1].seq_lens == [frames[0]]


@SPEECH_ENCODER_DECODER_FLOOR
def test_a_speech_encoder_decoder_moves_its_feature_extractor_encoder_and_decoder():
    net = speech_encoder_decoder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        controller, inputs = attached(net, mode="on")
        stacks = [slot.target.stack for slot in controller.switch.layers]
        assert (
            stacks
            == ["encoder.feature_extractor.conv_layers"] * 3
            + ["encoder.encoder.layers"] * 2
            + ["decoder.bert.encoder.layer"] * 2
        )
        batch = audio()
        batch["inputs"] = batch.pop("input_values")
        for _ in range(2):
            step(net, controller, batch, inputs)
            assert len(inputs.bytes) == 7
            assert controller.last_step_bytes == sum(inputs.bytes.values())
    assert not [w for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert controller.sizes.planned_layer_bytes == tuple(inputs.bytes[i] for i in range(7))


@SPEECH_ENCODER_DECODER_FLOOR
def test_a_partial_level_of_a_speech_encoder_decoder_offloads_what_frees_most_first():
    net = speech_encoder_decoder()

    class Half:
        def decide(self, observation):
            return 3

    net.gradient_checkpointing_enable(**NON_REENTRANT)
    net.train()
    controller = OffloadController(Settings(), probe=None, policy=Half())
    controller.attach(net)
    inputs = LayerInputs([slot.target.module for slot in controller.switch.layers])
    batch = audio()
    for _ in range(2):
        step(net, controller, batch, inputs)
    largest = sorted(inputs.bytes.values(), reverse=True)[:3]
    assert controller.last_step_bytes == sum(largest)
    assert any(controller.layout.layer_stacks[p].startswith("encoder") for p in controller.switch.offloading)


@pytest.mark.xfail(
    strict=True,
    reason="open: under torch.compile a recomputing layer's function counts nothing, so a stack sized from a raw "
    "input is never sized while nothing offloads (counting each layer's first call eagerly fixes it, but makes the "
    "first micro-batch give up transformers 4.52's whole graph: the compile budget's tests no longer hold there)",
)
def test_a_compiled_moonshine_that_offloads_nothing_still_learns_its_encoders_length():
    """Under torch.compile a recomputing layer's function counts no calls (no graph break) once its layer is sized;
    before, its first call must still say its input's bytes: an encoder on audio is sized from nothing else, and a
    policy that never offloaded would never see its frames."""
    torch_dynamo = pytest.importorskip("torch._dynamo")
    seen = []

    class Spy:
        def decide(self, observation):
            seen.append((observation.seq_len, observation.tokens))
            return 0

    torch_dynamo.reset()
    net = moonshine()
    net.gradient_checkpointing_enable(**NON_REENTRANT)
    net.train()
    compiled = torch.compile(net, backend="aot_eager")
    controller = OffloadController(Settings(), probe=None, policy=Spy())
    assert controller.attach(net, compiled=True)
    frames = []
    net.model.encoder.layers[0].register_forward_pre_hook(lambda m, args: frames.append(args[0].shape[1]))
    inputs = LayerInputs([slot.target.module for slot in controller.switch.layers])
    try:
        for _ in range(3):
            step(compiled, controller, audio(), inputs)
    finally:
        torch_dynamo.reset()
    assert seen[1:] == [(frames[0], BATCH * (frames[0] + TARGET))] * 2
    assert controller.sizes.planned_layer_bytes == tuple(inputs.bytes[i] for i in range(5))


def unlimited_ocr() -> torch.nn.Module:
    """A tiny Unlimited-OCR: a SAM tower on the pixels, whose downsampled features are the ``patch_embeds`` of a
    CLIP encoder (as wide as the SAM tower's last downsample), then the language model."""
    sam = {"hidden_size": HIDDEN, "output_channels": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4}
    sam.update(image_size=256, patch_size=16, mlp_dim=2 * HIDDEN, downsample_channels=(HIDDEN, HIDDEN))
    clip = {"hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4}
    text = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": 2}
    text.update(num_attention_heads=4, num_key_value_heads=4, head_dim=16, mlp_layer_types=["dense", "dense"])
    config = transformers.UnlimitedOcrConfig(
        vision_config={"sam_config": sam, "encoder_config": clip}, text_config=text, image_token_id=VOCAB - 1
    )
    config.use_cache = False
    torch.manual_seed(0)
    return transformers.UnlimitedOcrForConditionalGeneration(config)


def page(images: int = BATCH) -> dict[str, torch.Tensor]:
    """``images`` rows of one 256-pixel image each: its 4 x 4 features a row and a newline, and the view separator
    (21 image tokens), then text."""
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(3, VOCAB - 1, (images, TARGET), generator=generator)
    input_ids = torch.cat([text[:, :2], torch.full((images, 4 * 5 + 1), VOCAB - 1), text[:, 2:]], dim=1)
    pixels = torch.randn(images, 3, 256, 256, generator=generator)
    labels = input_ids.masked_fill(input_ids == VOCAB - 1, -100)
    return {"input_ids": input_ids, "labels": labels, "pixel_values": pixels}


@pytest.mark.skipif(not hasattr(transformers, "UnlimitedOcrConfig"), reason="Unlimited-OCR is in transformers 5.25")
def test_a_tower_on_what_another_tower_computes_is_sized_per_image_before_the_forward():
    """Unlimited-OCR's CLIP encoder runs on ``patch_embeds`` the SAM tower computes from ``pixel_values``: no call
    that decides carries them, so its layers are sized per element of the pixels, as their first call showed; the
    decision for the next batch sizes every layer as its forward then holds, more images or fewer."""
    net = unlimited_ocr()

    class Every:
        def decide(self, observation):
            return 6

    net.gradient_checkpointing_enable(**NON_REENTRANT)
    net.train()
    controller = OffloadController(Settings(), probe=None, policy=Every())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert controller.attach(net)
        assert [slot.target.stack for slot in controller.switch.layers] == [
            "model.vision_tower.sam_encoder.layers"
        ] * 2 + ["model.vision_tower.vision_encoder.encoder.layers"] * 2 + ["model.language_model.layers"] * 2
        inputs = LayerInputs([slot.target.module for slot in controller.switch.layers])
        for images in (BATCH, BATCH, 1):
            step(net, controller, page(images), inputs)
            assert controller.last_step_bytes == sum(inputs.bytes.values())
            assert len(inputs.bytes) == 6
    assert not [w for w in caught if issubclass(w.category, AutoOffloadWarning)]
    clip = [inputs.bytes[2], inputs.bytes[3]]
    assert clip == [(1 + 4 * 4) * HIDDEN * 4] * 2  # the class token and 4 x 4 patches of one image, float32
    assert controller.sizes.planned_layer_bytes == tuple(inputs.bytes[i] for i in range(6))


def vit() -> torch.nn.Module:
    """A tiny random ViT (the sizes of transformers' ViTModelTester): its only input is ``pixel_values``."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=30,
        patch_size=2,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        hidden_dropout_prob=0.1,
    )
    return transformers.ViTModel(config, add_pooling_layer=False)


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_a_call_without_tokens_warns_of_the_sequence_trigger_only_where_the_trigger_would_decide(mode):
    # Issue 50: every vision and audio model warned in mode "on" that only the memory reading decides, where neither
    # the trigger nor the reading decides anything. In "auto" the trigger would decide, and the warning stays.
    net = vit()
    pixels = torch.randn(BATCH, 3, 30, 30, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        controller, inputs = attached(net, mode=mode)
        for _ in range(2):
            inputs.bytes, inputs.forward = {}, True
            loss = net(pixel_values=pixels).last_hidden_state.pow(2).mean()
            inputs.forward = False
            loss.backward()
            controller.end_step()
            if mode == "on":
                assert len(inputs.bytes) == 2
                assert controller.last_step_bytes == sum(inputs.bytes.values())
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    warned = [message for message in ours if "sequence-length trigger" in message]
    assert len(warned) == (1 if mode == "auto" else 0), ours
