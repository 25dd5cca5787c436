"""Image batches for the sweep's image models whose processor shapes the images or the tokens in a way the generic
batch (:func:`media_batches.image_batch`) cannot guess (see :mod:`.quirks`)."""

from __future__ import annotations

from .. import media_batches, tiny
from .registry import batch_fix, config_fix
from .tokens import before_text, free_ids
from .vision_inputs import random_pixels, small_images

# ---- PaliGemma -----------------------------------------------------------------------------------------------


@config_fix("paligemma")
def _paligemma_projects_to_the_text_width(config):
    """The projector maps image features to the language model's width (``projection_dim`` 2048 is the released
    Gemma-2B's ``hidden_size``, left unshrunk)."""
    config.projection_dim = config.vision_config.projection_dim = config.text_config.hidden_size


@batch_fix("paligemma", kind="image")
def _paligemma_batch(model, config, batch):
    """``PaliGemmaProcessor``'s batch with a suffix: ``image_seq_length`` image tokens, ``<bos>``, the prefix, then
    the suffix; ``token_type_ids`` 0 on the prefix (attended both ways) and 1 on the suffix, the only labels."""
    import torch

    vision = config.vision_config
    count = (vision.image_size // vision.patch_size) ** 2
    head = [config.image_token_id] * count + [config.text_config.bos_token_id]
    input_ids = before_text(batch["input_ids"], head)["input_ids"]
    types = torch.zeros_like(input_ids)
    types[:, len(head) + tiny.SEQ // 2 :] = 1  # the second half of the text is the suffix
    return {
        "pixel_values": random_pixels(vision, tiny.BATCH),
        "input_ids": input_ids,
        "token_type_ids": types,
        "labels": input_ids.masked_fill(types == 0, -100),
    }


# ---- Idefics3 and SmolVLM: pixel-shuffled patches --------------------------------------------------------------


@config_fix("idefics3", "smolvlm")
def _patches_a_side_divide_by_the_shuffle(config):
    """The connector's pixel shuffle folds ``scale_factor`` x ``scale_factor`` patches into one token, so the
    patches a side must divide by it (Idefics3-8B: 364-pixel images of 14-pixel patches, 26 a side, shuffled by 2;
    SmolVLM: 512 of 16, 32 a side, by 4); the default 224-pixel image of 32-pixel patches is 7 a side: rounded up to
    the next multiple (8 a side at 2)."""
    vision, scale = config.vision_config, config.scale_factor
    side = -(-vision.image_size // vision.patch_size // scale) * scale
    vision.image_size = side * vision.patch_size
    small_images(vision)


@batch_fix("idefics3", "smolvlm", kind="image")
def _idefics3_batch(model, config, batch):
    """``Idefics3Processor``'s (``SmolVLMProcessor``'s) batch for one unsplit image:
    ``<fake_token_around_image> <global-img> [image_seq_len <image>] <fake_token_around_image>`` before the text,
    the images as ``[batch, images, C, H, W]`` and ``pixel_attention_mask`` (``[batch, images, H, W]``, all
    pixels real). The two tags are the tokenizer's added tokens: here ids no special token holds."""
    import torch

    vision = config.vision_config
    count = (vision.image_size // vision.patch_size // config.scale_factor) ** 2
    fake, glob = free_ids(config, 2)
    pixels = random_pixels(vision, tiny.BATCH, 1)
    return {
        "pixel_values": pixels,
        "pixel_attention_mask": torch.ones(*pixels.shape[:2], *pixels.shape[-2:], dtype=torch.bool),
        **before_text(batch["input_ids"], [fake, glob, *[config.image_token_id] * count, fake]),
    }


# ---- pixel-shuffled tiles between begin and end tokens --------------------------------------------------------


@config_fix("aya_vision", "cohere2_vision")
def _one_tile_of_at_most_16_patches_a_side(config):
    """The released towers see 364-pixel (Aya Vision) and 512-pixel (Command A Vision) tiles; their patches a side
    are cut to 16, which the projector's pixel shuffle (``downsample_factor`` 2) divides. Command A Vision's
    ``alignment_intermediate_size`` (36864, the projector's MLP) is a width the shrink does not know: the sweep's
    MLP width."""
    small_images(config.vision_config)
    if hasattr(config, "alignment_intermediate_size"):
        config.alignment_intermediate_size = 2 * config.text_config.hidden_size


def _shuffled_tokens(config) -> int:
    """Image tokens of one tile: its patches, ``downsample_factor`` x ``downsample_factor`` folded into one."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size // config.downsample_factor) ** 2


@batch_fix("aya_vision", kind="image")
def _aya_vision_batch(model, config, batch):
    """``AyaVisionProcessor``'s batch for an image of one tile (the global one): ``<|START_OF_IMG|> TILE_GLOBAL
    [<|IMG_PATCH|> per token] <|END_OF_IMG|>`` before the text (the tags are added tokens, ``TILE_GLOBAL`` plain
    text: one id each here, none a special token's)."""

    start, tile, end = free_ids(config, 3)
    count = _shuffled_tokens(config)
    framed = before_text(batch["input_ids"], [start, tile, *[config.image_token_index] * count, end])
    return {"pixel_values": random_pixels(config.vision_config, tiny.BATCH), **framed}


@batch_fix("cohere2_vision", kind="image")
def _cohere2_vision_batch(model, config, batch):
    """``Cohere2VisionProcessor``'s batch for an image of one tile: ``<boi> [<image> per token] <line break> <eoi>``
    before the text (the tags are the tokenizer's added tokens: here ids no special token holds)."""

    boi, line, eoi = free_ids(config, 3)
    head = [boi, *[config.image_token_id] * _shuffled_tokens(config), line, eoi]
    framed = before_text(batch["input_ids"], head)
    return {"pixel_values": random_pixels(config.vision_config, tiny.BATCH), **framed}


# ---- LLaVA-OneVision: any-resolution tiles -------------------------------------------------------------------


@config_fix("llava_onevision")
def _pinpoints_are_multiples_of_the_tile(config):
    """The released 384-pixel SigLIP tower (27 patches a side) is cut to 16 a side; ``image_grid_pinpoints``, the
    tile grids an image may be cut into, are multiples of the tile size and follow it."""
    vision = config.vision_config
    old = vision.image_size
    small_images(vision)
    config.image_grid_pinpoints = [
        [h * vision.image_size // old, w * vision.image_size // old] for h, w in config.image_grid_pinpoints
    ]


@batch_fix("llava_onevision", kind="image")
def _llava_onevision_batch(model, config, batch):
    """``LlavaOnevisionProcessor``'s batch for one tile-sized image: ``pixel_values`` ``[batch, tiles, C, H, W]``
    (the whole image, then its one grid tile), ``image_sizes``, ``batch_num_images`` and one ``<image>`` per feature
    (the grid's unpadded features, a newline per row, the base image's), counted by the model as the processor's
    formula does."""
    import torch

    vision = config.vision_config
    pixels = random_pixels(vision, tiny.BATCH, 2)
    extra = {
        "image_sizes": torch.tensor([[vision.image_size, vision.image_size]] * tiny.BATCH),
        "batch_num_images": torch.ones(tiny.BATCH, dtype=torch.long),
    }
    with torch.no_grad():
        features = model.model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            vision_aspect_ratio=config.vision_aspect_ratio,
            **extra,
        )
    count = media_batches._count(features) // tiny.BATCH
    framed = before_text(batch["input_ids"], [config.image_token_index] * count)
    return {"pixel_values": pixels, **extra, **framed}


# ---- Aria: a fixed number of queries per image size ------------------------------------------------------------

ARIA_QUERIES = 16  # the released model reads a 490-pixel image (35 x 35 patches) with 128 queries, 980 with 256


@config_fix("aria")
def _aria_queries_for_the_tiny_image(config):
    """The projector's cross-attention reads an image of ``n`` patches with ``projector_patch_to_query_dict[n]``
    learned queries; the released table knows only the 490- and 980-pixel images of 14-pixel patches, so the tiny
    tower's image (7 x 7 patches of 32 pixels) gets an entry of its own."""
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    config.projector_patch_to_query_dict = {patches: ARIA_QUERIES}
    config.max_value_projector_patch_to_query_dict = ARIA_QUERIES


@batch_fix("aria", kind="image")
def _aria_batch(model, config, batch):
    """``AriaProcessor``'s batch for one uncropped image: one ``<|img|>`` per query (the processor's
    ``size_conversion`` of the image size), ``pixel_values`` and ``pixel_mask`` (every pixel real)."""
    import torch

    pixels = random_pixels(config.vision_config, tiny.BATCH)
    framed = before_text(batch["input_ids"], [config.image_token_id] * ARIA_QUERIES)
    mask = torch.ones(pixels.shape[0], *pixels.shape[-2:], dtype=torch.bool)
    return {"pixel_values": pixels, "pixel_mask": mask, **framed}


# ---- Janus -----------------------------------------------------------------------------------------------------


@config_fix("janus")
def _janus_aligners_project_to_the_text_width(config):
    """Both aligners (the understanding tower's and the image generator's) map into the language model's width
    (``projection_dim`` 2048 is Janus-Pro-1B's ``hidden_size``, left unshrunk). 384-pixel images of 16-pixel patches
    (24 a side) are cut to 16 a side, and the processor's ``num_image_tokens`` (one per patch) follows."""
    width, vision = config.text_config.hidden_size, config.vision_config
    vision.projection_dim = config.vq_config.projection_dim = config.vq_config.image_token_embed_dim = width
    small_images(vision)
    vision.num_image_tokens = (vision.image_size // vision.patch_size) ** 2


@batch_fix("janus", kind="image")
def _janus_batch(model, config, batch):
    """``JanusProcessor``'s batch: ``<begin_of_image> [num_image_tokens <image_placeholder>] <end_of_image>`` before
    the text (the tags are the tokenizer's added tokens: here ids no special token holds)."""

    boi, eoi = free_ids(config, 2)
    vision = config.vision_config
    framed = before_text(batch["input_ids"], [boi, *[config.image_token_id] * vision.num_image_tokens, eoi])
    return {"pixel_values": random_pixels(vision, tiny.BATCH), **framed}


# ---- Florence-2 --------------------------------------------------------------------------------------------------

FLORENCE_IMAGE = 224  # the DaViT tower's stages stride 32 in all: 7 x 7 features (the processor's 768: 24 x 24)


@config_fix("florence2")
def _florence2_projects_to_the_text_width(config):
    """The projector maps the DaViT tower's features to the BART encoder's width (``projection_dim`` is
    ``d_model`` in the released checkpoints: 768 base, 1024 large), which the shrink cut to 64. The tower's
    per-stage lists are sizes the shrink does not read: its stages get the sweep's widths (doubling up to 64, 16
    channels a head and a group, at least one) and depth (3 blocks in the deep stage, as in the released 1-1-9-1)."""
    vision = config.vision_config
    vision.projection_dim = config.text_config.d_model
    vision.embed_dim = [8, 16, 32, 64]
    vision.num_heads = vision.num_groups = [1, 1, 2, 4]
    vision.depths = [1, 1, 3, 1]


@batch_fix("florence2", kind="image")
def _florence2_batch(model, config, batch):
    """``Florence2Processor``'s batch: the encoder reads one ``<image>`` per image feature (the spatial grid's, then
    one for the temporal mean: ``image_seq_length`` 577 at 768 pixels), ``<bos>``, the prompt and ``<eos>``; the
    answer is the labels, shifted into the decoder's inputs by the model."""
    import torch

    text, ids = config.text_config, tiny.token_sampler(config)
    count = (FLORENCE_IMAGE // 32) ** 2 + 1
    prompt = ids(tiny.SEQ // 2)
    prompt = torch.cat([prompt, torch.full_like(prompt[:, :1], text.eos_token_id)], dim=1)
    input_ids = before_text(prompt, [config.image_token_id] * count + [text.bos_token_id])["input_ids"]
    pixels = torch.randn(tiny.BATCH, 3, FLORENCE_IMAGE, FLORENCE_IMAGE, generator=torch.Generator().manual_seed(2))
    return {"pixel_values": pixels, "input_ids": input_ids, "labels": ids(tiny.TARGET)}


# ---- VipLLaVA ----------------------------------------------------------------------------------------------------

VIPLLAVA_TOWER_DEPTH = 24  # the released CLIP ViT-L/14-336: its taps -2, -5, -8, -11 and 6 index 25 hidden states


@config_fix("vipllava")
def _vipllava_taps_within_the_tower(config):
    """The projector concatenates the CLIP tower's hidden states at ``vision_feature_layers``, chosen for a
    24-layer tower; the tiny tower's 3 layers keep five taps at the same relative depths. 336-pixel images of 14-pixel
    patches (24 a side) are cut to 16 a side."""
    depth = config.vision_config.num_hidden_layers
    states = VIPLLAVA_TOWER_DEPTH + 1
    config.vision_feature_layers = [
        round(index % states * depth / VIPLLAVA_TOWER_DEPTH) for index in config.vision_feature_layers
    ]
    small_images(config.vision_config)


@batch_fix("vipllava", kind="image")
def _vipllava_batch(model, config, batch):
    """``LlavaProcessor``'s batch: one ``<image>`` per patch (the CLS state is dropped) before the text."""

    vision = config.vision_config
    count = (vision.image_size // vision.patch_size) ** 2
    framed = before_text(batch["input_ids"], [config.image_token_index] * count)
    return {"pixel_values": random_pixels(vision, tiny.BATCH), **framed}


# ---- Apertus 1.5: images as discrete codes of the shared vocabulary ----------------------------------------------

APERTUS_CODES = 128, 64  # the visual and audio codebooks' sizes (released: 131072 and 4096)
APERTUS_IMAGE = 128  # the image processor's smallest image (min_pixels 128 x 128): 8 x 8 codes of 16 pixels


@config_fix("apertus1p5")
def _apertus_codebooks_inside_the_vocabulary(config):
    """The vision tokenizer's codes are vocabulary ids: ``image_token_offset + code``, the visual range followed by
    the audio one, both at the end of the vocabulary (released: 131272 + 131072 codes, then 4096 audio codes, of
    266752). The shrink cut the vocabulary to 512 and left the ranges beyond it: smaller codebooks placed the same
    way. The VQGAN encoder's widths, which the shrink does not know, get the sweep's (its GroupNorms take 32
    groups), one residual block a stage; its five stages (16-pixel codes) stay."""
    vision, audio = config.vision_config, config.audio_config
    vision.codebook_size, audio.codebook_size = APERTUS_CODES
    config.image_token_offset = config.text_config.vocab_size // 2
    config.audio_token_offset = config.image_token_offset + vision.codebook_size
    vision.base_channels, vision.num_res_blocks = 32, 1
    vision.latent_channels = vision.embed_dim = config.text_config.hidden_size


@batch_fix("apertus1p5", kind="image")
def _apertus_batch(model, config, batch):
    """``Apertus1p5Processor``'s batch for a 128-pixel image: ``<boi> 8*8 <image wrapper>``, the 8 rows of 8
    ``<|image|>`` joined by ``<eol>``, ``<eoi>``, before the text; ``image_sizes``. The tags are the tokenizer's added
    tokens (here ids no special token holds); the size header is text."""
    import torch

    side = APERTUS_IMAGE // 16
    boi, wrapper, eol, eoi = free_ids(config, 4)
    header = tiny.token_sampler(config)(3)[0].tolist()
    rows = ([config.image_token_id] * side + [eol]) * side
    framed = before_text(batch["input_ids"], [boi, *header, wrapper, *rows[:-1], eoi])
    pixels = torch.rand(tiny.BATCH, 3, APERTUS_IMAGE, APERTUS_IMAGE, generator=torch.Generator().manual_seed(2))
    return {
        "pixel_values": pixels * 2 - 1,  # the processor's [-1, 1]
        "image_sizes": torch.tensor([[APERTUS_IMAGE, APERTUS_IMAGE]] * tiny.BATCH),
        **framed,
    }


# ---- Fuyu: image patches straight into the decoder ---------------------------------------------------------------


@batch_fix("fuyu", kind="image")
def _fuyu_batch(model, config, batch):
    """``FuyuProcessor``'s batch for one ``image_size`` image: no vision tower, each patch's raw pixels
    (``[batch, patches, patch x patch x channels]``) linearly projected onto one ``|SPEAKER|`` token; each row of
    patches ends with ``|NEWLINE|`` (a text token: here an id no special token holds), then ``<s>`` and the text."""
    import torch

    side = config.image_size // config.patch_size
    newline = free_ids(config)[0]
    rows = ([config.image_token_id] * side + [newline]) * side
    framed = before_text(batch["input_ids"], [*rows, config.text_config.bos_token_id])
    width = config.patch_size**2 * config.num_channels
    patches = torch.randn(tiny.BATCH, side * side, width, generator=torch.Generator().manual_seed(2))
    return {"pixel_values": patches, **framed}
