"""Fixes for the sweep's image models whose forward needs more than pixels and tokens (see :mod:`quirks`)."""

from __future__ import annotations

from typing import Any

from .. import tiny
from .registry import batch_fix, checkpointing_fix, config_fix
from .tokens import before_text, free_ids

PATCHES_PER_SIDE = 16  # the largest vision tower the sweep builds: 16 x 16 patches


# ---- helpers -----------------------------------------------------------------------------------------------


def small_images(vision: Any) -> None:
    """A vision config's images cut to at most ``PATCHES_PER_SIDE`` patches a side (its position table follows)."""
    if vision.image_size > PATCHES_PER_SIDE * vision.patch_size:
        vision.image_size = PATCHES_PER_SIDE * vision.patch_size


def random_pixels(vision: Any, *lead: int) -> Any:
    """Random ``[*lead, channels, size, size]`` pixels at the vision config's image size."""
    import torch

    generator = torch.Generator().manual_seed(2)
    channels = getattr(vision, "num_channels", 3)
    return torch.randn(*lead, channels, vision.image_size, vision.image_size, generator=generator)


# ---- the BLIP family -------------------------------------------------------------------------------------


@config_fix("blip")
def _blip_text_attends_to_the_vision_width(config):
    """The caption decoder cross-attends to the vision tower's states: ``BlipConfig`` sets the text's
    ``encoder_hidden_size`` to the vision width, which the shrink changed after. 384-pixel images of 16-pixel
    patches (24 a side) are cut to 16 a side."""
    config.text_config.encoder_hidden_size = config.vision_config.hidden_size
    small_images(config.vision_config)


@batch_fix("blip", kind="image")
def _blip_caption_batch(model, config, batch):
    """``BlipProcessor``'s batch: one image and its caption; the caption is also the labels."""

    pixels = random_pixels(config.vision_config, tiny.BATCH)
    return {"pixel_values": pixels, "input_ids": batch["input_ids"], "labels": batch["input_ids"].clone()}


@config_fix("blip-2", "instructblip", "instructblipvideo")
def _qformer_attends_to_the_vision_width(config):
    """The Q-Former cross-attends to the vision tower's states (``encoder_hidden_size`` 1408 is the released ViT-g's
    width, left unshrunk); the queries replace the OPT decoder's embeddings at an ``<image>`` (``<video>``) token the
    processor adds to the tokenizer, which the default config leaves unset, so those embeddings are the decoder's
    width (``word_embed_proj_dim`` equals ``hidden_size`` in every released BLIP-2 OPT)."""
    config.qformer_config.encoder_hidden_size = config.vision_config.hidden_size
    if getattr(config.text_config, "word_embed_proj_dim", None) is not None:
        config.text_config.word_embed_proj_dim = config.text_config.hidden_size
    small_images(config.vision_config)
    key = "video_token_index" if config.model_type == "instructblipvideo" else "image_token_index"
    if getattr(config, key) is None:
        setattr(config, key, free_ids(config)[0])


@batch_fix("blip-2", kind="image")
def _blip2_batch(model, config, batch):
    """``Blip2Processor``'s batch: one image, ``num_query_tokens`` image tokens before the text."""

    framed = before_text(batch["input_ids"], [config.image_token_index] * config.num_query_tokens)
    pixels = random_pixels(config.vision_config, tiny.BATCH)
    return {"pixel_values": pixels, **framed}


def _instructblip_batch(config, token: int, frames: int | None) -> dict:
    """``InstructBlip(Video)Processor``'s batch: the prompt twice, in the Q-Former's vocabulary and in the
    language model's after ``num_query_tokens`` placeholders per image (per frame of a video)."""

    text = tiny.token_sampler(config)(tiny.SEQ)
    qformer_ids = tiny.token_sampler(config.qformer_config)(tiny.SEQ // 2)
    count = config.num_query_tokens * (frames or 1)
    framed = before_text(text, [token] * count)
    lead = (tiny.BATCH, frames) if frames else (tiny.BATCH,)
    return {
        "pixel_values": random_pixels(config.vision_config, *lead),
        "qformer_input_ids": qformer_ids,
        **framed,
    }


@batch_fix("instructblip", kind="image")
def _instructblip_image_batch(model, config, batch):
    """One image per row; the Q-Former reads the prompt too (``qformer_input_ids``)."""
    return _instructblip_batch(config, config.image_token_index, None)


@batch_fix("instructblipvideo", kind="video")
def _instructblip_video_batch(model, config, batch):
    """A video of 4 frames per row, ``[batch, frames, C, H, W]``: the processor's (and the model's) fixed count."""
    return _instructblip_batch(config, config.video_token_index, 4)


# ---- image towers read beside the text -------------------------------------------------------------------


@batch_fix("kosmos-2", kind="image")
def _kosmos2_batch(model, config, batch):
    """``Kosmos2Processor``'s batch: ``<s> <image> [latent_query_num placeholders] </image>`` before the text,
    and ``image_embeds_position_mask`` marking the placeholders the image's latent queries replace (the tokenizer's
    ``<image>``/``</image>`` are added tokens: here two ids no special token holds)."""
    import torch

    queries = config.latent_query_num
    boi, eoi = free_ids(config, 2)
    head = [config.text_config.bos_token_id, boi, *[boi] * queries, eoi]
    input_ids = before_text(batch["input_ids"], head)["input_ids"]
    mask = torch.zeros_like(input_ids)
    mask[:, 2 : 2 + queries] = 1
    return {
        "pixel_values": random_pixels(config.vision_config, tiny.BATCH),
        "input_ids": input_ids,
        "image_embeds_position_mask": mask,
        "labels": input_ids.masked_fill(mask.bool(), -100),
    }


@batch_fix("idefics", kind="image")
def _idefics_batch(model, config, batch):
    """``IdeficsProcessor``'s batch: ``<fake_token_around_image> <image> <fake_token_around_image>`` before the text,
    the images as ``[batch, images, C, H, W]``, and ``image_attention_mask`` ``[batch, seq, images]``: 1 from the
    ``<image>`` token on (the tokens that cross-attend to it). Both tokens are the tokenizer's added ones: here two
    ids no special token holds."""
    import torch

    image, fake = free_ids(config, 2)
    framed = before_text(batch["input_ids"], [fake, image, fake])
    attends = torch.ones(*framed["input_ids"].shape, 1, dtype=torch.long)
    attends[:, 0] = 0
    return {
        "pixel_values": random_pixels(config.vision_config, tiny.BATCH, 1),
        "input_ids": framed["input_ids"],
        "image_attention_mask": attends,
        "labels": framed["labels"],
    }


@batch_fix("vision-encoder-decoder", kind="image")
def _image_to_text_batch(model, config, batch):
    """An image encoder and a text decoder (TrOCR, Donut, ViT-GPT2 captioners): the image processor's
    ``pixel_values`` and the caption as labels, which the model shifts into the decoder's inputs."""

    return {"pixel_values": random_pixels(config.encoder, tiny.BATCH), "labels": batch["labels"]}


@config_fix("pp_formulanet")
def _formulanet_widths_chain(config):
    """The SAM-style tower's neck (``output_channels``) feeds the projector's convolutions
    (``post_conv_in_channels``), whose output is the decoder's width (``decoder_hidden_size`` == the text's
    ``d_model``), as in the released checkpoints; the shrink left these and the MLP width at full size. 512-pixel
    images of 16-pixel patches (32 a side) are cut to 16 a side."""
    vision, width = config.vision_config, config.vision_config.hidden_size
    vision.output_channels = vision.post_conv_in_channels = width
    vision.post_conv_mid_channels = vision.post_conv_out_channels = width
    vision.mlp_dim = 2 * width  # the sweep's MLP ratio
    vision.decoder_hidden_size = config.text_config.d_model
    small_images(vision)


@batch_fix("pp_formulanet", kind="image")
def _formulanet_batch(model, config, batch):
    """The image processor's ``pixel_values`` and the formula's tokens: the model shifts ``input_ids`` right into
    the decoder's inputs and scores ``labels`` position by position."""

    pixels = random_pixels(config.vision_config, tiny.BATCH)
    return {"pixel_values": pixels, "input_ids": batch["input_ids"], "labels": batch["input_ids"].clone()}


def _word_boxes(batch: int, seq: int) -> Any:
    """``[batch, seq, 4]`` word boxes ``(x0, y0, x1, y1)`` in 0..1000, as a layout processor normalizes OCR boxes."""
    import torch

    generator = torch.Generator().manual_seed(4)
    corners = torch.randint(0, 900, (batch, seq, 2), generator=generator)
    sizes = torch.randint(10, 100, (batch, seq, 2), generator=generator)
    return torch.cat([corners, corners + sizes], dim=-1)


@batch_fix("udop", kind="image")
def _udop_document_batch(model, config, batch):
    """``UdopProcessor``'s batch: the page image, its OCR words' ids and their ``bbox`` (the encoder's 2-D relative
    position biases need them), and the target text as labels."""

    text = batch["input_ids"]
    return {
        "pixel_values": random_pixels(config, tiny.BATCH),
        "input_ids": text,
        "bbox": _word_boxes(*text.shape),
        "labels": tiny.token_sampler(config)(tiny.TARGET),
    }


# ---- robot policies ------------------------------------------------------------------------------------


def _policy_batch(config, batch: dict) -> dict:
    """``PI0Processor``'s batch for one camera: its image, one ``<image>`` token per patch then ``<bos>`` and the
    task text, and the chunk of ``actions`` to learn; the flow-matching ``noise`` and ``timestep`` a training loop
    draws (given here so that every run sees the same). transformers 5.25 cannot train these checkpointed: the
    prefix reaches the action expert only as a KV cache, which checkpointing turns off (``use_cache=False``), so
    the step fails on a None cache; the row stays skipped with that reason."""
    import torch

    vlm, vision = config.vlm_config, config.vlm_config.vision_config
    generator = torch.Generator().manual_seed(5)
    rows = tiny.BATCH
    head = [vlm.image_token_id] * (vision.image_size // vision.patch_size) ** 2 + [vlm.text_config.bos_token_id]
    input_ids = before_text(batch["input_ids"], head)["input_ids"]
    chunk = (rows, config.chunk_size, config.max_action_dim)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": random_pixels(vision, rows, 1),
        "pixel_attention_mask": torch.ones(rows, 1, dtype=torch.bool),
        "actions": torch.randn(*chunk, generator=generator),
        "noise": torch.randn(*chunk, generator=generator),
        "timestep": torch.rand(rows, generator=generator) * config.time_sampling_scale + config.time_sampling_offset,
    }


@config_fix("pi0", "pi05")
def _paligemma_projects_to_the_text_width(config):
    """PaliGemma's projector maps image features to the language model's width (``projection_dim`` 2048 is the
    released Gemma-2B's ``hidden_size``, left unshrunk)."""
    vlm = config.vlm_config
    vlm.projection_dim = vlm.vision_config.projection_dim = vlm.text_config.hidden_size


@checkpointing_fix("pi0", "pi05")
def _checkpoint_the_vision_tower(model):
    """PI0's action expert reads the prompt only through the cache the VLM fills (``use_cache=True``), which
    checkpointing the VLM turns off (the forward then fails on a missing cache), and checkpointing the expert fails
    too: its recompute meets a cache its forward grew. What checkpoints and trains is the SigLIP vision tower."""
    model.model.vlm.vision_tower.gradient_checkpointing_enable()


@batch_fix("pi0", kind="image+robot")
def _pi0_batch(model, config, batch):
    """PI0 also reads the robot's ``state`` (padded to ``max_state_dim``) as the action expert's first token."""
    import torch

    state = torch.randn(tiny.BATCH, config.max_state_dim, generator=torch.Generator().manual_seed(6))
    return {**_policy_batch(config, batch), "state": state}


@batch_fix("pi05", kind="image+robot")
def _pi05_batch(model, config, batch):
    """PI0.5 reads the state as discretized tokens of the prompt (``state_in_prompt``): text ids here."""
    return _policy_batch(config, batch)
