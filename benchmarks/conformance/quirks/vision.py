"""Fixes for the sweep's vision model types (see :mod:`quirks`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import tiny
from .registry import batch_fix, config_fix, fix_config
from .tokens import before_text, free_ids

# ---- helpers -----------------------------------------------------------------------------------------------


def _text(config: Any, length: int, avoid: Iterable[int] = ()) -> Any:
    """``[BATCH, length]`` random text ids of the config's vocabulary, no special id nor any of ``avoid`` among
    them."""
    import torch

    taken = tiny.special_ids(config) | set(avoid)
    allowed = torch.tensor([i for i in range(tiny.text_vocab(config)) if i not in taken])
    picks = torch.randint(len(allowed), (tiny.BATCH, length), generator=torch.Generator().manual_seed(1))
    return allowed[picks]


# ---- Chameleon -------------------------------------------------------------------------------------------


@config_fix("chameleon")
def _chameleon_tokenizer_names_its_image_codes(config):
    """The model reads its ``<image>`` token and the BPE ids of the VQ-GAN's codes (``IMGIMG<code in letters>Z``)
    from ``vocabulary_map``, the tokenizer's vocabulary that the released config carries and the default leaves
    unset. Here a VQ-GAN of 64 codes at BPE ids 4..67 (the release's 8192 codes also hold one block of low ids) and
    base width 32 (its GroupNorms take 32 groups)."""
    vq = config.vq_config
    vq.num_embeddings, vq.base_channels, vq.latent_channels = 64, 32, 64
    letters = str.maketrans("0123456789", "ABCDEFGHIJ")
    codes = {f"IMGIMG{str(code).translate(letters)}Z": 4 + code for code in range(vq.num_embeddings)}
    config.vocabulary_map = {"<image>": config.image_token_id, **codes}


@batch_fix("chameleon", kind="image")
def _chameleon_batch(model, config, batch):
    """``ChameleonProcessor``'s batch: 64-pixel images (the VQ-GAN's four halvings make 4 x 4 codes; the processor's
    512-pixel crops make 32 x 32) and one ``<image>`` per code before the text, whose ids are no image code (the
    model never predicts one: it masks their logits)."""
    import torch

    codes = set(config.vocabulary_map.values()) - {config.image_token_id}
    framed = before_text(_text(config, tiny.SEQ, codes), [config.image_token_id] * 16)
    pixels = torch.randn(tiny.BATCH, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    return {"pixel_values": pixels, **framed}


# ---- Cohere Compass ----------------------------------------------------------------------------------------


@config_fix("cohere_compass")
def _compass_text_as_released(config):
    """The text model reads one rope per layer type, which the default leaves empty: the text type's own fix
    (``cohere_compass_text``), on the text config."""
    fix_config("cohere_compass_text", "causal", config.text_config)


# ---- DeepSeek-OCR-2 ----------------------------------------------------------------------------------------


@config_fix("deepseek_ocr2")
def _ocr2_dense_then_sparse_layers(config):
    """The text model reads each layer's MLP kind from ``mlp_layer_types``, which the default leaves unset; the
    released DeepSeek-OCR-2 (a DeepSeek-V2 MoE, ``first_k_dense_replace`` 1) has one dense layer, then sparse ones.
    The SAM tower's neck ends at the vision encoder's width (``downsample_channels[-1]`` 896 is the released Qwen2
    encoder's ``hidden_size``), and its MLP width (``mlp_dim``, set from the unshrunk width) follows the shrink;
    1024-pixel images of 16-pixel patches are cut to 16 patches a side."""
    text, sam = config.text_config, config.vision_config.sam_config
    text.mlp_layer_types = ["dense"] + ["sparse"] * (text.num_hidden_layers - 1)
    sam.output_channels = sam.hidden_size
    sam.downsample_channels = [config.vision_config.encoder_config.hidden_size] * 2
    sam.mlp_dim = 2 * sam.hidden_size  # the sweep's MLP ratio
    sam.image_size = 16 * sam.patch_size


# ---- DiffusionGemma --------------------------------------------------------------------------------------


@config_fix("diffusion_gemma")
def _diffusion_gemma_expert_sizes(config):
    """Every layer runs a mixture of experts beside its MLP (Gemma-4 26B-A4B's: 128 experts of width 704, 8 per
    token), whose sizes the default config leaves unset: the sweep's tiny ones."""

    text = config.text_config
    text.num_experts = tiny.SIZE_KEYS["num_experts"]
    text.top_k_experts = tiny.SIZE_KEYS["num_experts_per_tok"]
    text.moe_intermediate_size = tiny.SIZE_KEYS["moe_intermediate_size"]


# ---- ERNIE 4.5 VL ----------------------------------------------------------------------------------------


@config_fix("ernie4_5_vl_moe")
def _ernie_height_and_width_rotate_alike(config):
    """ERNIE interleaves the height and width rotary frequencies pairwise, so its M-RoPE split gives both the same
    share (the released ``[22, 22, 20]`` of a 128-wide head's 64); the sweep's generic 2:3:3 split does not."""
    text = config.text_config
    half = text.hidden_size // text.num_attention_heads // 2
    spatial = round(half * 22 / 64)
    text.rope_parameters["mrope_section"] = [spatial, spatial, half - 2 * spatial]


# ---- Granite 4 Vision ------------------------------------------------------------------------------------


@config_fix("granite4_vision")
def _granite_vision_deepstack_taps(config):
    """The projectors read ``deepstack_layer_map`` (which vision layer feeds which text layer) and
    ``downsample_rate`` (the Window Q-Former's query and key window sides), which the default leaves unset. The
    released granite-vision-4.1 taps four vision layers, deepest into the earliest text layer
    (``[[-19, 9], [-13, 6], [-7, 3], [-1, 0]]``), windows of 8 x 8 patches queried 4 x 4 (``"4/8"``), and the four
    spatial groups into later layers: here the three tiny vision layers into the three text layers the same way,
    the spatial groups into the last two. The tower's image is one window (8 x 8 patches); the Q-Former
    cross-attends to the tower's width."""
    vision = config.vision_config
    config.deepstack_layer_map = [(-1 - i, i) for i in reversed(range(vision.num_hidden_layers))]
    config.downsample_rate = "4/8"
    config.spatial_target_layers = [1, 1, 2, 2]
    vision.image_size = 8 * vision.patch_size
    config.image_grid_pinpoints = [[vision.image_size, vision.image_size]]
    config.qformer_config.encoder_hidden_size = vision.hidden_size


@batch_fix("granite4_vision", kind="image")
def _granite_vision_batch(model, config, batch):
    """``Granite4VisionProcessor``'s batch for one tower-sized image: its overview and its one tile
    (``[batch, 2, C, H, W]``, the any-resolution split of a grid of one), ``image_sizes``, and as many ``<image>``
    tokens before the text as the projectors make of it (read off the model's ``get_image_features``)."""
    import torch

    side = config.vision_config.image_size
    shape = (tiny.BATCH, 2, config.vision_config.num_channels, side, side)
    pixels = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    sizes = torch.tensor([[side, side]] * tiny.BATCH)
    with torch.no_grad():
        features = model.model.get_image_features(pixels, sizes)
    count = len(features.deepstack_features[0][1][0])
    framed = before_text(batch["input_ids"], [config.image_token_index] * count)
    return {"pixel_values": pixels, "image_sizes": sizes, **framed}


# ---- Mistral 4 -------------------------------------------------------------------------------------------


@config_fix("mistral4")
def _mistral4_head_is_nope_plus_rope(config):
    """Mistral 4's MLA head is its no-position part plus its rotary part: the config derives ``head_dim`` from the
    two when built (the rotary embedding's size, of which ``partial_rotary_factor`` rotates the rope share); the
    shrink cut ``head_dim`` to the sweep's 16 on its own, so derive it again."""
    config.head_dim = config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim


# ---- Molmo2 ----------------------------------------------------------------------------------------------


@config_fix("molmo2")
def _molmo2_patch_token_and_small_crops(config):
    """The ``<im_patch>`` id (``image_patch_id``, 151938) is no ``*_token_id`` key, so the shrink left it outside the
    tiny vocabulary: an id no special token holds, as the processor's added token. The adapter reads the ViT's last
    layer and its seventh from last (``vision_feature_layer`` ``[24, 18]`` of 25), which the shrink left beyond the
    three layers: here the last and the first. 378-pixel crops of 14-pixel patches (27 a side) are cut to 16 a side,
    the position table with them."""
    config.image_patch_id = free_ids(config)[0]
    vision = config.vision_config
    vision.image_size = [16 * vision.patch_size] * 2
    vision.num_position_embeddings = 16 * 16
    config.adapter_config.vision_feature_layer = [vision.num_hidden_layers - 1, 0]


def _pooling_windows(side: int, pool: int) -> Any:
    """``[(side // pool) ** 2, pool * pool]``: the indices of each ``pool x pool`` window of a ``side x side`` patch
    grid, row by row (the image processor's ``image_token_pooling`` of one crop)."""
    import torch

    grid = torch.arange(side * side).reshape(side // pool, pool, side // pool, pool)
    return grid.permute(0, 2, 1, 3).reshape(-1, pool * pool)


@batch_fix("molmo2", kind="image")
def _molmo2_batch(model, config, batch):
    """``Molmo2Processor``'s batch for each image's global view alone (no high-resolution crops, as the model reads
    a video's frames): the crop's patches flattened (``[crops, patches, 14 * 14 * 3]``), 2 x 2 windows
    of them pooled into each image token (``image_token_pooling``, ``image_grids`` ``[rows, cols, 0, 0]``), the
    tokens ``<low_res_im_start> (<im_patch> x cols <im_col>) x rows <im_end>`` before the text, and
    ``mm_token_type_ids`` 1 at every one of those (training requires it). ``<im_col>`` is an added token too."""
    import torch

    vision, rows = config.vision_config, tiny.BATCH
    side, pool = vision.image_size[0] // vision.patch_size, 2
    pixels = torch.randn(rows, side * side, vision.patch_size**2 * 3, generator=torch.Generator().manual_seed(2))
    cells = side // pool
    column = free_ids(config, taken=[config.image_patch_id])[0]
    row = [config.image_patch_id] * cells + [column]
    head = [config.low_res_image_start_token_id, *row * cells, config.image_end_token_id]
    framed = before_text(batch["input_ids"], head)
    image = torch.zeros_like(framed["input_ids"])
    image[:, : len(head)] = 1
    return {
        "pixel_values": pixels,
        "image_token_pooling": _pooling_windows(side, pool).repeat(rows, 1),
        "image_grids": torch.tensor([[cells, cells, 0, 0]] * rows),
        "image_num_crops": torch.ones(rows, dtype=torch.long),
        "input_ids": framed["input_ids"],
        "mm_token_type_ids": image,
        "labels": framed["labels"],
    }


# ---- Step-3.7 --------------------------------------------------------------------------------------------


@config_fix("step3p7")
def _step_builds_a_sliding_mask(config):
    """The text model builds a sliding-window mask whatever its layer types, so it needs ``sliding_window``, which a
    released checkpoint with sliding layers sets and the default leaves unset (512 here). The tiny model keeps the
    default's full-attention layers: the window changes no mask of the 48-token batch. 728-pixel images of
    14-pixel patches (52 a side) are cut to 16 a side."""
    config.text_config.sliding_window = 512
    config.vision_config.image_size = 16 * config.vision_config.patch_size


# ---- timm towers -----------------------------------------------------------------------------------------


@config_fix("fast_vlm")
def _fastvit_at_the_tower_width(config):
    """The tower is timm's FastViT-MCi3 (``fastvit_mci3``: five stages of up to 1536 channels, 3072 features); the
    projector reads ``vision_config.hidden_size`` features, the released 3072. Here the same architecture cut to one
    block a stage and to the sweep's width: its last stage's 32 channels, doubled by the final expansion (timm's
    ``cls_ratio`` 2), make the 64 features; the attention stages keep timm's 32-wide heads."""
    config.vision_config.model_args = {
        **(config.vision_config.model_args or {}),
        "layers": (1, 1, 1, 1, 1),
        "embed_dims": (16, 16, 32, 32, config.vision_config.hidden_size // 2),
    }


@config_fix("perception_lm")
def _perception_encoder_tower(config):
    """The tower is timm's Perception Encoder (``vit_pe_core_large_patch14_336`` in the released 1B and 3B, built
    with ``model_args``: width, depth, image size, the rope's reference grid, no pooling or final norm); the default
    config names a ResNet-50 without them, and the projector reads ``model_args["embed_dim"]``. Here the released
    architecture at the sweep's sizes, on 112-pixel images (8 x 8 patches of 14; the released 448 make 32 x 32)."""

    side = 8
    vision = config.vision_config
    vision.architecture = "vit_pe_core_large_patch14_336"
    vision.model_args = {
        "embed_dim": tiny.SIZE_KEYS["hidden_size"],
        "depth": tiny.LAYERS,
        "num_heads": tiny.SIZE_KEYS["num_attention_heads"],
        "img_size": (14 * side, 14 * side),
        "ref_feat_shape": (side, side),
        "global_pool": "",
        "use_post_transformer_norm": False,
        "init_values": 0.1,
    }


@batch_fix("perception_lm", kind="image")
def _perception_lm_batch(model, config, batch):
    """``PerceptionLMProcessor``'s batch: each image as its tiles, ``[batch, tiles, C, H, W]`` (here one tile, the
    thumbnail), and one ``<image>`` token per feature the projector makes of it."""
    import torch

    side = config.vision_config.model_args["img_size"][0]
    pixels = torch.randn(tiny.BATCH, 1, 3, side, side, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        count = model.model.get_image_features(pixels).pooler_output.shape[1]
    framed = before_text(batch["input_ids"], [config.image_token_id] * count)
    return {"pixel_values": pixels, **framed}


# The released MobileNet-V5-300M encoder's stages, one block of each kind a stage at 1/8 to 1/20 of the widths
# (timm's block strings: er = edge residual, uir = universal inverted residual, mqa = multi-query attention).
MOBILENET_V5_TINY = [
    ["er_r1_k3_s2_e4_c16"],
    ["uir_r1_a3_k5_s2_e6_c32"],
    ["uir_r1_a5_k5_s2_e6_c64", "mqa_r1_k3_h4_v2_s1_d16_c64", "uir_r1_a0_k0_s1_e2_c64"],
    ["uir_r1_a5_k5_s2_e6_c64", "mqa_r1_k3_h4_s1_d16_c64", "uir_r1_a0_k0_s1_e2_c64"],
]


@config_fix("gemma3n", mapping="causal")
def _gemma3n_as_released_but_tiny(config):
    """The text model shares keys and values across layer types as the text type's own fix lays them out
    (``gemma3n_text``, on the text config). The tower is timm's ``mobilenetv5_300m_enc`` (about 300M parameters);
    here the same architecture with its stages cut to the blocks of :data:`MOBILENET_V5_TINY` (timm builds it from
    ``block_args``), its fusion adapter's grid to 4 x 4 (the release's 16 x 16: 256 soft tokens an image) and the
    config's soft-token count with it. The adapter's width is fixed at 2048 in timm, which the released config's
    ``hidden_size`` is; the shrink cut it to 64, so it is set back."""
    from timm.models._efficientnet_builder import decode_arch_def

    fix_config("gemma3n_text", "causal", config.text_config)
    vision, side = config.vision_config, 4
    vision.hidden_size = 2048
    args = {"block_args": decode_arch_def(MOBILENET_V5_TINY), "stem_size": 16, "msfa_output_resolution": side}
    vision.model_args = {**(vision.model_args or {}), **args}
    config.vision_soft_tokens_per_image = side * side


@config_fix("muse_glimmer", "muse_spark")
def _merger_at_the_towers_merged_width(config):
    """The merger's input is the tower's width times its 2 x 2 merge (the release's widths agree); its projector
    width was left at the release's 4096."""
    vision = config.vision_config
    config.out_hidden_size = vision.hidden_size * vision.merge_size**2
    config.projector_hidden_size = 64


@config_fix("nemotron_h_omni")
def _projector_reads_the_towers_width(config):
    """The projector reads the vision tower's output: ``vision_hidden_size`` is the tower's width (1280 in the
    release), which the shrink changed in the tower only."""
    config.vision_hidden_size = config.vision_config.hidden_size
