"""Image batches for the sweep's vision-language models whose towers take flattened patches and grids, or tokens
wrapped in begin/end tokens, which the generic image batch cannot build (see :mod:`quirks`).

Each batch is what the model's processor would give it for one small image per row: the pixels in the layout its
image processor makes (patches, grids, positions), its placeholder tokens with the begin/end tokens the processor
or chat template puts around them, and the extra tensors its forward reads.
"""

from __future__ import annotations

from typing import Any

from .. import media_batches, tiny
from .registry import batch_fix, config_fix

# ---- helpers -----------------------------------------------------------------------------------------------


def _randn(*shape: int) -> Any:
    """Random pixels (or patches) of ``shape``, the same for every run."""
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(2))


def _image_rows(model: Any, config: Any, span: list[int], token: int, text: Any = None) -> dict:
    """``input_ids`` with one image's ``span`` (its placeholders and any begin/end tokens) after the first two text
    tokens, as a chat template places the image in the prompt; ``labels`` skip the span; where the forward takes
    them, ``mm_token_type_ids`` marking the placeholders (1), as ``ProcessorMixin.create_mm_token_type_ids`` does."""
    import inspect

    import torch

    text = tiny.token_sampler(config)(tiny.SEQ) if text is None else text
    image = torch.tensor(span, dtype=text.dtype).expand(text.shape[0], -1)
    input_ids = torch.cat([text[:, :2], image, text[:, 2:]], dim=1)
    labels = input_ids.clone()
    labels[:, 2 : 2 + len(span)] = -100
    rows = {"input_ids": input_ids, "labels": labels}
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        rows["mm_token_type_ids"] = (input_ids == token).long()
    return rows


def _grid(rows: int, columns: int) -> Any:
    """``[rows * columns, 2]`` patch positions ``(x, y)`` in raster order, as the Gemma-4 image processors make."""
    import torch

    ys, xs = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
    return torch.stack([xs.flatten(), ys.flatten()], dim=-1)


def _tiny_vision(vision: Any) -> Any:
    """A default vision sub-config shrunk as the sweep shrinks every config, attention as the rest of the model's."""

    tiny.shrink(vision, sizes=True)
    vision._attn_implementation = "eager"
    return vision


# ---- Gemma 4: a vision config the default leaves out -------------------------------------------------------


@config_fix("gemma4")
def _gemma4_has_a_vision_tower(config):
    """``Gemma4Config()`` leaves ``vision_config`` unset (the text-only default); the released image-text Gemma-4
    checkpoints have one (a ViT with 3x3 pooling): the default ``Gemma4VisionConfig``, shrunk."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig

    config.vision_config = _tiny_vision(Gemma4VisionConfig())


@batch_fix("gemma4", kind="image")
def _gemma4_batch(model, config, batch):
    """``Gemma4Processor``'s batch for a 192-pixel image: 12x12 patches of 16 pixels, flattened
    (``[batch, patches, 3 * 16 * 16]``), their ``(x, y)`` ``image_position_ids``, and ``<boi>`` + one ``<image>``
    per 3x3 pooled patch (16) + ``<eoi>`` in the text."""

    vision, side, rows = config.vision_config, 12, tiny.BATCH
    tokens = (side // vision.pooling_kernel_size) ** 2
    span = [config.boi_token_id] + [config.image_token_id] * tokens + [config.eoi_token_id]
    return {
        **_image_rows(model, config, span, config.image_token_id),
        "pixel_values": _randn(rows, side * side, 3 * vision.patch_size**2).clamp(0, 1),
        "image_position_ids": _grid(side, side).expand(rows, -1, -1),
    }


@config_fix("gemma4_unified")
def _gemma4_unified_has_a_vision_embedder(config):
    """As Gemma-4: the default leaves ``vision_config`` unset. The encoder-free embedder's width
    (``mm_embed_dim``) and its projection's input (``output_proj_dims``) are the text width in the released
    checkpoints (3840 both), left unshrunk."""
    from transformers.models.gemma4_unified.configuration_gemma4_unified import Gemma4UnifiedVisionConfig

    vision = Gemma4UnifiedVisionConfig()
    vision.mm_embed_dim = vision.output_proj_dims = config.text_config.hidden_size
    config.vision_config = _tiny_vision(vision)


@batch_fix("gemma4_unified", kind="image")
def _gemma4_unified_batch(model, config, batch):
    """``Gemma4UnifiedProcessor``'s batch for a 192-pixel image: 4x4 model patches of 48 pixels (3x3 merged
    16-pixel patches), flattened, their ``image_position_ids``, and ``<boi>`` + one ``<image>`` per model patch +
    ``<eoi>``."""

    vision, side, rows = config.vision_config, 4, tiny.BATCH
    span = [config.boi_token_id] + [config.image_token_id] * side * side + [config.eoi_token_id]
    return {
        **_image_rows(model, config, span, config.image_token_id),
        "pixel_values": _randn(rows, side * side, 3 * vision.model_patch_size**2),
        "image_position_ids": _grid(side, side).expand(rows, -1, -1),
    }


# ---- T5Gemma 2: a Gemma-3 tower in the encoder ----------------------------------------------------------


@config_fix("t5gemma2")
def _t5gemma2_encoder_reads_the_image_tokens(config):
    """``T5Gemma2Config`` copies its ``image_token_index`` into the encoder's and takes ``eoi_token_index`` from it;
    the shrink moved each id on its own, so the two disagree. Pool the tower's 14x14 patches 2x2 (49 tokens): the
    default's 256 tokens are 16 a side, more than the tiny image has (the released 896-pixel images have 64)."""
    encoder = config.encoder
    encoder.image_token_index = config.image_token_index
    config.eoi_token_index = encoder.eoi_token_index
    side = encoder.vision_config.image_size // encoder.vision_config.patch_size
    encoder.mm_tokens_per_image = (side // 2) ** 2


@batch_fix("t5gemma2", kind="image")
def _t5gemma2_batch(model, config, batch):
    """``Gemma3Processor``'s batch (T5Gemma 2 uses it): the image, and ``<start_of_image>`` + ``mm_tokens_per_image``
    image tokens + ``<end_of_image>`` in the encoder's text; the decoder's ``labels`` are the batch's."""

    encoder = config.encoder
    span = [encoder.boi_token_index] + [encoder.image_token_index] * encoder.mm_tokens_per_image
    span += [encoder.eoi_token_index]
    rows = _image_rows(model, config, span, encoder.image_token_index, batch["input_ids"])
    vision = encoder.vision_config
    pixels = _randn(tiny.BATCH, vision.num_channels, vision.image_size, vision.image_size)
    return {"input_ids": rows["input_ids"], "labels": batch["labels"], "pixel_values": pixels}


# ---- towers whose projector widths the shrink left behind ------------------------------------------------


@config_fix("minimax_m3_vl")
def _minimax_m3_projects_to_the_text_width(config):
    """The projector's hidden width (``projector_hidden_size`` 6144, the released text width) is left unshrunk, and
    ``merged_hidden_size`` (the text width x ``spatial_merge_size`` squared) was computed from the full-size text
    config before the shrink."""
    width = config.text_config.hidden_size
    config.projector_hidden_size = width
    config.merged_hidden_size = width * config.vision_config.spatial_merge_size**2


# ---- patch-list towers with a (t, h, w) grid -------------------------------------------------------------


@config_fix("kimi_k25")
def _kimi_k25_normalizes_the_vision_width(config):
    """The projector's pre-norm runs over the tower's width (``projection_hidden_size`` 1152 is the released
    MoonViT's ``hidden_size``, left unshrunk)."""
    config.projection_hidden_size = config.vision_config.hidden_size


@batch_fix("kimi_k25", kind="image")
def _kimi_k25_batch(model, config, batch):
    """``Kimi_K25Processor``'s batch for a 112-pixel image: 8x8 patches of 14 pixels as ``[patches, 3, 14, 14]``,
    ``image_grid_thw`` ``[1, 8, 8]``, and one ``<|media_pad|>`` per 2x2 merged patch (16) between the begin/end
    tokens the chat template puts around it (``vision_start_token_id`` / ``vision_end_token_id``)."""
    import torch

    vision, side, rows = config.vision_config, 8, tiny.BATCH
    tokens = side * side // (vision.merge_kernel_size[0] * vision.merge_kernel_size[1])
    span = [config.vision_start_token_id] + [config.image_token_id] * tokens + [config.vision_end_token_id]
    return {
        **_image_rows(model, config, span, config.image_token_id),
        "pixel_values": _randn(rows * side * side, 3, vision.patch_size, vision.patch_size),
        "image_grid_thw": torch.tensor([[1, side, side]] * rows),
    }


@batch_fix("paddleocr_vl", kind="image")
def _paddleocr_vl_batch(model, config, batch):
    """``PaddleOCRVLProcessor``'s batch for a 112-pixel image: 8x8 patches of 14 pixels as ``[patches, 3, 14, 14]``,
    ``image_grid_thw`` ``[1, 8, 8]``, one image token per 2x2 merged patch (16) between the chat template's
    begin/end tokens (``vision_start_token_id`` / ``vision_end_token_id``), and the ``mm_token_type_ids`` its
    M-RoPE reads."""
    import torch

    vision, side, rows = config.vision_config, 8, tiny.BATCH
    tokens = side * side // vision.spatial_merge_size**2
    span = [config.vision_start_token_id] + [config.image_token_id] * tokens + [config.vision_end_token_id]
    return {
        **_image_rows(model, config, span, config.image_token_id),
        "pixel_values": _randn(rows * side * side, vision.num_channels, vision.patch_size, vision.patch_size),
        "image_grid_thw": torch.tensor([[1, side, side]] * rows),
    }


@batch_fix("ovis2_5", kind="image")
def _ovis2_5_batch(model, config, batch):
    """The generic image batch (Qwen-style flattened patches and grid), with the image's placeholders between the
    start/end tokens (``image_start_token_id`` / ``image_end_token_id``) as ``Ovis2_5Processor`` puts them: the
    model gives those two tokens the visual indicator embeddings and checks one pair per image."""

    ids, token = tiny.token_sampler(config), config.image_token_id
    media = media_batches.image_batch(model, config, ids, tiny.SEQ, tiny.BATCH)
    text = media["input_ids"]
    span = [config.image_start_token_id] + [token] * int((text[0] == token).sum()) + [config.image_end_token_id]
    plain = text[text != token].view(text.shape[0], -1)
    return {**media, **_image_rows(model, config, span, token, plain)}


# ---- Inkling: patches in their image processors' layouts ----------------------------------------------------


@batch_fix("inkling2", "inkling2_loop", kind="image")
def _inkling2_batch(model, config, batch):
    """``Inkling2ImageProcessor``'s batch for a 160-pixel image: one ``[40, 40, 3]`` tile (2x2 patches of 20 pixels)
    per language-model image token, 4x4 of them (``image_grid_thw`` ``[1, 4, 4]``, counted in those tokens), and
    one ``<image>`` per tile (``Inkling2Processor`` adds no begin/end tokens)."""
    import torch

    vision, side, rows = config.vision_config, 4, tiny.BATCH
    tile = vision.patch_size * vision.spatial_merge_size
    span = [config.image_token_id] * side * side
    return {
        **_image_rows(model, config, span, config.image_token_id),
        "pixel_values": _randn(rows * side * side, tile, tile, vision.num_channels).clamp(-1, 1),
        "image_grid_thw": torch.tensor([[1, side, side]] * rows),
    }


@batch_fix("inkling_mm_model", kind="image")
def _inkling_batch(model, config, batch):
    """``InklingImageProcessor``'s batch for a 160-pixel image: 4x4 patches of 40 pixels, each repeated over the
    ``temporal_patch_size`` (2) frames, ``[patches, 2, 40, 40, 3]``; one ``<image>`` per patch after the chat
    template's ``<|content_image|>`` (``image_bos_token_id``)."""

    vision, patches, rows = config.vision_config, 16, tiny.BATCH
    size = vision.patch_size
    span = [config.image_bos_token_id] + [config.image_token_id] * patches
    frames = _randn(rows * patches, 1, size, size, vision.num_channels).expand(
        -1, vision.temporal_patch_size, -1, -1, -1
    )
    return {**_image_rows(model, config, span, config.image_token_id), "pixel_values": frames.contiguous()}


# ---- SAM-based high-resolution towers ----------------------------------------------------------------------


@config_fix("unlimited_ocr")
def _unlimited_ocr_sam_feeds_the_clip_width(config):
    """The SAM tower's downsampled features are the CLIP encoder's patch embeddings: the last of
    ``downsample_channels`` (1024) is the released CLIP-L's width, and its neck (``output_channels`` 256), the first
    downsample (512) and the MLP (``mlp_dim`` 3072) are left at SAM-B's full size. The 512-pixel images of 16-pixel
    patches (32 a side) are cut to 256 (16 a side)."""
    sam, width = config.vision_config.sam_config, config.vision_config.encoder_config.hidden_size
    sam.output_channels = sam.hidden_size
    sam.downsample_channels = (sam.hidden_size, width)
    sam.mlp_dim = 2 * sam.hidden_size  # the sweep's MLP ratio
    sam.image_size = 16 * sam.patch_size


@batch_fix("unlimited_ocr", kind="image")
def _unlimited_ocr_batch(model, config, batch):
    """``UnlimitedOcrProcessor``'s batch for an image no larger than one view (no local tiles): the global view at
    the SAM tower's size, and its image tokens: ``q`` rows of ``q`` features and a newline, and the view separator,
    ``q = size / patch / 4`` (the two stride-2 downsamples)."""

    sam, rows = config.vision_config.sam_config, tiny.BATCH
    queries = sam.image_size // sam.patch_size // 4
    span = [config.image_token_id] * (queries * (queries + 1) + 1)
    pixels = _randn(rows, sam.num_channels, sam.image_size, sam.image_size)
    return {**_image_rows(model, config, span, config.image_token_id), "pixel_values": pixels}


@config_fix("deepseek_vl_hybrid")
def _deepseek_vl_hybrid_small_high_res_images(config):
    """The high-resolution SAM tower's 1024-pixel images (cut to 512 by the sweep: 32 patches a side, global
    attention) are cut to 256 (16 a side)."""
    high = config.high_res_vision_config
    high.image_size = 16 * high.patch_size


@batch_fix("deepseek_vl_hybrid", kind="image")
def _deepseek_vl_hybrid_batch(model, config, batch):
    """``DeepseekVLHybridImageProcessor``'s batch: each image at the SigLIP tower's size (``pixel_values``) and at
    the SAM tower's (``high_res_pixel_values``), and one ``<image_placeholder>`` per SigLIP patch (the processor's
    ``num_image_tokens``, 576 for the released 384-pixel tower)."""

    low, high, rows = config.vision_config, config.high_res_vision_config, tiny.BATCH
    span = [config.image_token_id] * (low.image_size // low.patch_size) ** 2
    return {
        **_image_rows(model, config, span, config.image_token_id),
        "pixel_values": _randn(rows, low.num_channels, low.image_size, low.image_size),
        "high_res_pixel_values": _randn(rows, high.num_channels, high.image_size, high.image_size),
    }
