"""A tiny random model of one type: its config (:func:`tiny_config`, with what :mod:`.quirks` adds), the model
built from it (:func:`build`) and its text batch (:func:`make_batch`)."""

from __future__ import annotations

import contextlib
from typing import Any

from .tiny import (
    BATCH,
    ENCODER_DECODER,
    MAPPINGS,
    SEQ,
    SOURCE,
    TARGET,
    _get,
    shrink,
    special_ids,
    text_vocab,
    token_sampler,
)

# ---- tiny configs ---------------------------------------------------------------------------------------


def _fit_image_tokens(config: Any) -> None:
    """A config that pools the vision tower's patches to ``mm_tokens_per_image`` (Gemma-3) must ask for no more
    tokens per side than its default image has patches per side (Gemma-3's default pairs 224-pixel images of
    16-pixel patches with 256 tokens): pool 2x2 where it would pool by 0."""
    tokens, vision = _get(config, "mm_tokens_per_image"), _get(config, "vision_config")
    size, patch = _get(vision, "image_size"), _get(vision, "patch_size")
    if isinstance(tokens, int) and isinstance(size, int) and isinstance(patch, int) and patch > 0:
        side = size // patch
        if round(tokens**0.5) > side:
            with contextlib.suppress(Exception):
                config.mm_tokens_per_image = (side // 2) ** 2


def tiny_config(model_type: str, sizes: bool = True, mapping: str = "causal") -> Any:
    """``model_type``'s default config shrunk (:func:`shrink`), with the ids a processor would set, and what the type
    needs besides (:mod:`quirks`)."""
    from transformers import AutoConfig

    from . import quirks
    from .quirks.tokens import free_ids

    config = AutoConfig.for_model(model_type, **quirks.base_kwargs(model_type))
    shrink(config, sizes=sizes)
    for key in ("use_cache",):
        with contextlib.suppress(Exception):
            setattr(config, key, False)
    with contextlib.suppress(Exception):
        config._attn_implementation = "eager"
    _fit_image_tokens(config)
    vocab, taken = text_vocab(config), special_ids(config)
    for key in ("image_token_id", "audio_token_id"):  # set by the processor where the config leaves it unset
        if key in vars(config) and getattr(config, key) is None and isinstance(vocab, int):
            free = free_ids(config, below=vocab - 1, taken=taken)[0]
            taken.add(free)
            with contextlib.suppress(Exception):
                setattr(config, key, free)
    if getattr(config, "is_encoder_decoder", False):  # labels are shifted right into decoder inputs: both needed
        if getattr(config, "pad_token_id", None) is None:
            with contextlib.suppress(Exception):
                config.pad_token_id = 0
        if getattr(config, "decoder_start_token_id", None) is None:
            with contextlib.suppress(Exception):
                config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    quirks.fix_config(model_type, mapping, config)
    return config


# ---- batches ---------------------------------------------------------------------------------------------


def make_batch(model: Any, config: Any, mapping: str) -> dict[str, Any]:
    import torch

    ids = token_sampler(config)
    generator = torch.Generator().manual_seed(1)

    if mapping in ENCODER_DECODER and getattr(config, "is_encoder_decoder", False) is not True:
        batch = ids(SEQ)  # an audio language model in a seq2seq mapping: text, its labels the same tokens
        return {"input_ids": batch, "labels": batch.clone()}
    if mapping == "seq2seq":
        return {"input_ids": ids(SOURCE), "labels": ids(TARGET)}
    if mapping == "speech":
        main = getattr(model, "main_input_name", "input_features")
        encoder = model.get_encoder() if hasattr(model, "get_encoder") else None
        if main == "input_values" or getattr(encoder, "main_input_name", None) == "input_values":  # raw audio
            source = torch.randn(BATCH, 16 * SOURCE * 10, generator=generator)
        elif isinstance(getattr(config, "num_mel_bins", None), int):
            source = torch.randn(BATCH, config.num_mel_bins, SOURCE, generator=generator)
        else:
            feat = getattr(config, "input_feat_per_channel", None) or getattr(config, "feature_size", None) or 80
            channels = getattr(config, "input_channels", 1) or 1
            source = torch.randn(BATCH, SOURCE, feat * channels, generator=generator)
        return {main: source, "labels": ids(TARGET)}
    batch = ids(SEQ)
    return {"input_ids": batch, "labels": batch.clone()}


def build(model_type: str, mapping: str, sizes: bool) -> tuple[Any, Any]:
    import torch
    import transformers

    config = tiny_config(model_type, sizes, mapping)
    auto = getattr(transformers, MAPPINGS[mapping][1])
    torch.manual_seed(0)
    try:
        model = auto.from_config(config)
    except ValueError as error:  # a type the mapping names but whose config the auto class does not know (Evolla)
        if "Unrecognized configuration class" not in str(error):
            raise
        names = getattr(transformers.models.auto.modeling_auto, MAPPINGS[mapping][0])
        torch.manual_seed(0)
        model = getattr(transformers, names[model_type])._from_config(config)
    return model.float(), config
