"""Image batches for the conformance sweep: pixels built from a model's config, with as many image tokens as its
vision tower makes of them.

A VLM is fine-tuned on images: its vision tower (often checkpointed: Qwen2-VL, GLM-4V, Gemma-3, InternVL, ...)
runs on ``pixel_values`` and its language layers on the text with one placeholder token per image feature. The
batch is built from the config alone: the image side from the vision config (``image_size``, ``patch_size``,
``num_channels``; Qwen-style towers take flattened patches and a ``(t, h, w)`` grid), the number of placeholder
tokens by running the model's own ``get_image_features`` on those pixels once (no grad), so no processor is needed.
A model this cannot build for is swept with a text-only batch, and the row says why.
"""

from __future__ import annotations

import inspect
from typing import Any

IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index", "image_token")


def _get(config: Any, key: str) -> Any:
    try:
        return getattr(config, key, None)
    except Exception:  # a per-layer config's global read
        return None


def _int(value: Any) -> int | None:
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def image_token(config: Any) -> int | None:
    for key in IMAGE_TOKEN_KEYS:
        for where in (config, _get(config, "text_config")):
            value = _int(_get(where, key)) if where is not None else None
            if value is not None:
                return value
    return None


def _vision(config: Any) -> Any:
    for key in ("vision_config", "vision_tower_config", "visual_config"):
        sub = _get(config, key)
        if sub is not None:
            return sub
    return None


def _count(features: Any) -> int:
    """Image features' rows (every axis but the last), whatever container the model returns them in."""
    import torch

    if isinstance(features, torch.Tensor):
        return int(features.numel() // features.shape[-1]) if features.dim() >= 2 else int(features.numel())
    for key in ("pooler_output", "image_embeds", "last_hidden_state"):
        value = getattr(features, key, None)
        if value is not None and not isinstance(features, (list, tuple)):
            return _count(value)
    if isinstance(features, (list, tuple)):
        return sum(_count(item) for item in features)
    raise TypeError(f"image features of type {type(features).__name__}")


def image_batch(model: Any, config: Any, ids: Any, seq: int, batch: int) -> dict[str, Any]:
    """A batch of ``batch`` rows, each one image and ``seq`` text tokens (``ids(n)``: ``[batch, n]`` text ids).
    Raises where the config or the model does not say enough."""
    import torch

    parameters = inspect.signature(model.forward).parameters
    if "pixel_values" not in parameters:
        raise ValueError("its forward takes no pixel_values")
    token, vision = image_token(config), _vision(config)
    if token is None or vision is None:
        raise ValueError("no image token id or no vision config")
    generator = torch.Generator().manual_seed(2)
    channels = _int(_get(vision, "num_channels")) or _int(_get(vision, "in_channels")) or 3
    channels = _int(_get(vision, "in_chans")) or channels
    patch = _int(_get(vision, "patch_size")) or 14
    extra: dict[str, Any] = {}
    merge, temporal = _int(_get(vision, "spatial_merge_size")), _int(_get(vision, "temporal_patch_size"))
    if "image_grid_thw" in parameters and merge:
        side = 2 * merge
        grid = torch.tensor([[1, side, side]] * batch)
        pixels = torch.randn(batch * side * side, channels * (temporal or 1) * patch * patch, generator=generator)
        extra["image_grid_thw"] = grid
    else:
        size = _int(_get(vision, "image_size")) or 224
        if size > 16 * patch and "image_sizes" in parameters:  # a tower of any image size (Pixtral's): a small one
            size = 16 * patch
        pixels = torch.randn(batch, channels, size, size, generator=generator)
    inner = getattr(model, "model", model)
    features = getattr(inner, "get_image_features", None) or getattr(model, "get_image_features", None)
    if features is None:
        raise ValueError("no get_image_features")
    sizes = {"image_sizes": torch.tensor([[pixels.shape[-2], pixels.shape[-1]]] * batch)} if pixels.dim() == 4 else {}
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                count = _count(features(pixel_values=pixels, **extra))
            except Exception as error:
                if sizes and "image_sizes" in parameters:
                    extra.update(sizes)  # LLaVA-Next and Pixtral-style towers: each image's size
                elif pixels.dim() == 4 and "expected 5" in str(error):
                    pixels = pixels[:, None]  # Idefics-style: [batch, images, channels, height, width]
                else:
                    raise
                count = _count(features(pixel_values=pixels, **extra))
    finally:
        model.train(was)
    if count % batch:
        raise ValueError(f"{count} image features for {batch} images")
    text = ids(seq)
    per_image = count // batch
    placeholders = torch.full((batch, per_image), token, dtype=text.dtype)
    input_ids = torch.cat([text[:, :2], placeholders, text[:, 2:]], dim=1)
    labels = input_ids.clone()
    labels[input_ids == token] = -100
    out = {"input_ids": input_ids, "labels": labels, "pixel_values": pixels, **extra}
    if "token_type_ids" in parameters:
        out["token_type_ids"] = (input_ids == token).long()
    if "mm_token_type_ids" in parameters:
        out["mm_token_type_ids"] = (input_ids == token).long()
    return out


AUDIO_TOKEN_KEYS = ("audio_token_id", "audio_token_index")


def audio_batch(model: Any, config: Any, ids: Any, seq: int, batch: int, frames: int) -> dict[str, Any]:
    """A batch of ``batch`` rows, each one clip of ``frames`` mel frames and ``seq`` text tokens, for an audio
    language model (Qwen2-Audio, Voxtral, ...): as many audio tokens as its ``get_audio_features`` makes."""
    import torch

    parameters = inspect.signature(model.forward).parameters
    if "input_features" not in parameters:
        raise ValueError("its forward takes no input_features")
    token = None
    for key in AUDIO_TOKEN_KEYS:
        for where in (config, _get(config, "text_config")):
            token = token if token is not None else (_int(_get(where, key)) if where is not None else None)
    audio = _get(config, "audio_config")
    mels = _int(_get(audio, "num_mel_bins")) if audio is not None else None
    if token is None or mels is None:
        raise ValueError("no audio token id or no audio config with num_mel_bins")
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(batch, mels, frames, generator=generator)
    extra: dict[str, Any] = {}
    if "feature_attention_mask" in parameters:
        extra["feature_attention_mask"] = torch.ones(batch, frames, dtype=torch.long)
    inner = getattr(model, "model", model)
    get = getattr(inner, "get_audio_features", None) or getattr(model, "get_audio_features", None)
    if get is None:
        raise ValueError("no get_audio_features")
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            count = _count(get(input_features=features, **extra))
    finally:
        model.train(was)
    if count % batch:
        raise ValueError(f"{count} audio features for {batch} clips")
    text = ids(seq)
    placeholders = torch.full((batch, count // batch), token, dtype=text.dtype)
    input_ids = torch.cat([text[:, :2], placeholders, text[:, 2:]], dim=1)
    labels = input_ids.clone()
    labels[input_ids == token] = -100
    return {"input_ids": input_ids, "labels": labels, "input_features": features, **extra}
