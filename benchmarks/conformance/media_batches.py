"""Image batches for the conformance sweep: pixels built from a model's config, with as many image tokens as its
vision tower makes of them.

A VLM is fine-tuned on images: its vision tower (often checkpointed: Qwen2-VL, GLM-4V, Gemma-3, InternVL, ...)
runs on ``pixel_values`` and its language layers on the text with one placeholder token per image feature. The
batch is built from the config alone: the image side from the vision config (``image_size``, ``patch_size``,
``num_channels``; Qwen-style towers take flattened patches and a ``(t, h, w)`` grid), the number of placeholder
tokens by running the model's own ``get_image_features`` on those pixels once (no grad), so no processor is needed.
Where a model takes no square images, the other layouts processors hand over are tried (:func:`_other_layouts`),
each with what else ``get_image_features`` requires, given by name as a processor would give it (grids, masks of
ones, sizes). Audio batches likewise (:func:`audio_batch`). A model this cannot build for is swept with a
text-only batch, and the row says why.
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


def _required(function: Any) -> list[str]:
    """``function``'s parameters that have no default (what a caller must pass), by name."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        name
        for name, p in inspect.signature(function).parameters.items()
        if p.kind in kinds and p.default is inspect.Parameter.empty
    ]


def _merge(vision: Any) -> int | None:
    return _int(_get(vision, "spatial_merge_size")) or _int(_get(vision, "merge_size"))


def _grids(names: Any, count: int, height: int, width: int, merge: int | None) -> dict[str, Any]:
    """The per-image grid tensors a processor returns, for those of ``names`` the model takes: ``count`` images of
    ``height x width`` patches, one frame each."""
    import torch

    known = {
        "image_grid_thw": [[1, height, width]] * count,
        "image_grid_hw": [[height, width]] * count,
        "spatial_shapes": [[height, width]] * count,
        "target_sizes": [[height, width]] * count,
        "image_merge_sizes": [merge or 1] * count,  # VideoLLaMA3's image processor: 1 for images
    }
    return {name: torch.tensor(known[name]) for name in names if name in known}


def _anyres(pinpoints: Any, size: int, channels: int, batch: int, generator: Any) -> tuple[Any, dict]:
    """One ``size x size`` image as an "anyres" processor hands it over (LLaVA-NeXT's ``image_grid_pinpoints``):
    the whole image and the crops of the grid resolution it is fitted to, ``[batch, 1 + crops, channels, size,
    size]``, with its ``image_sizes``."""
    import torch
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution((size, size), [tuple(point) for point in pinpoints])
    crops = 1 + -(-height // size) * -(-width // size)
    pixels = torch.randn(batch, crops, channels, size, size, generator=generator)
    return pixels, {"image_sizes": torch.tensor([[size, size]] * batch)}


def _channels(vision: Any) -> int:
    channels = _int(_get(vision, "num_channels")) or _int(_get(vision, "in_channels")) or 3
    return _int(_get(vision, "in_chans")) or channels


def _square_size(vision: Any, parameters: Any) -> int:
    """The square images' side: the vision config's ``image_size``, smaller for a tower of any size."""
    patch = _int(_get(vision, "patch_size")) or 14
    size = _int(_get(vision, "image_size")) or 224
    if size > 16 * patch and "image_sizes" in parameters:  # a tower of any image size (Pixtral's): a small one
        size = 16 * patch
    return size


def _other_layouts(config: Any, vision: Any, parameters: Any, required: list[str], batch: int) -> Any:
    """Other ways a processor hands over ``batch`` images, tried where the square ones fail; each
    ``(pixel_values, extra inputs)``, the extras named as the forward takes them:

    - a tower of one fixed size (CLIP's) at its own ``image_size`` where the square one was made smaller;
    - LLaVA-NeXT's "anyres" crops of such an image (:func:`_anyres`);
    - flattened patches with a per-image grid (``image_grid_thw`` / ``image_grid_hw``, ``image_merge_sizes``) where
      the vision config names no ``spatial_merge_size`` (``merge_size``, or none: pixel-shuffle towers);
    - NaFlex-style patches per image (``[batch, patches, channels * patch**2]``) with ``spatial_shapes`` and a
      patch mask (SigLIP-2 towers: LFM2-VL);
    - tiles (``[batch, 1, channels, size, size]``) with a mask of real tiles (Granite-Docling), or of real pixels
      (Idefics3);
    - all images' patches packed in one row (``[1, channels, patch, patches * patch]``) with ``target_sizes``
      (MiniCPM-V's packing)."""
    import torch

    generator = torch.Generator().manual_seed(2)
    channels, patch = _channels(vision), _int(_get(vision, "patch_size")) or 14
    size, square = _int(_get(vision, "image_size")), _square_size(vision, parameters)
    names = [name for name in parameters if name != "pixel_values"]
    if size and square < size:
        full = torch.randn(batch, channels, size, size, generator=generator)
        yield full, ({"image_sizes": torch.tensor([[size, size]] * batch)} if "image_sizes" in required else {})
    pinpoints = _get(config, "image_grid_pinpoints")
    if pinpoints and size and "image_sizes" in parameters:
        yield _anyres(pinpoints, size, channels, batch, generator)
    merge = _merge(vision)
    side = 2 * (merge or 2)
    temporal = _int(_get(vision, "temporal_patch_size")) or _int(_get(vision, "patch_temporal")) or 1
    if "image_grid_thw" in parameters or "image_grid_hw" in parameters:
        flat = torch.randn(batch * side * side, channels * temporal * patch * patch, generator=generator)
        yield flat, _grids(names, batch, side, side, merge)
    mask = "pixel_attention_mask"
    if "spatial_shapes" in parameters:
        patches = torch.randn(batch, side * side, channels * patch * patch, generator=generator)
        masks = {mask: torch.ones(batch, side * side, dtype=torch.long)} if mask in parameters else {}
        yield patches, {**_grids(names, batch, side, side, merge), **masks}
    if mask in required:
        tiles = torch.randn(batch, 1, channels, square, square, generator=generator)
        yield tiles, {mask: torch.ones(batch, 1, dtype=torch.bool)}
        yield tiles, {mask: torch.ones(batch, 1, square, square, dtype=torch.bool)}
    if "target_sizes" in parameters:
        packed = torch.randn(1, channels, patch, batch * side * side * patch, generator=generator)
        yield packed, _grids(names, batch, side, side, merge)


def _square_layout(vision: Any, parameters: Any, batch: int, features: Any) -> tuple[Any, dict, int]:
    """Square images (``[batch, channels, size, size]``), or Qwen-style flattened patches and their grid where the
    forward takes ``image_grid_thw`` and the vision config a ``spatial_merge_size``: pixels, extras, feature count."""
    import torch

    generator = torch.Generator().manual_seed(2)
    channels, patch = _channels(vision), _int(_get(vision, "patch_size")) or 14
    extra: dict[str, Any] = {}
    merge, temporal = _int(_get(vision, "spatial_merge_size")), _int(_get(vision, "temporal_patch_size"))
    if "image_grid_thw" in parameters and merge:
        side = 2 * merge
        grid = torch.tensor([[1, side, side]] * batch)
        pixels = torch.randn(batch * side * side, channels * (temporal or 1) * patch * patch, generator=generator)
        extra["image_grid_thw"] = grid
    else:
        size = _square_size(vision, parameters)
        pixels = torch.randn(batch, channels, size, size, generator=generator)
    sizes = {"image_sizes": torch.tensor([[pixels.shape[-2], pixels.shape[-1]]] * batch)} if pixels.dim() == 4 else {}
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
    return pixels, extra, count


def _first_other_layout(
    config: Any, vision: Any, parameters: Any, batch: int, features: Any, error: Exception
) -> tuple[Any, dict, int]:
    """The first of :func:`_other_layouts` the model's ``get_image_features`` takes, whole images' features for
    ``batch`` images. Where none is, raises ``error`` (the square images'), or the first other layout's error where
    the square images could not even be passed (``get_image_features`` requires more: a ``TypeError``)."""
    required = [name for name in _required(features) if name in parameters]
    first = None
    for pixels, extra in _other_layouts(config, vision, parameters, required, batch):
        if not set(required) <= {"pixel_values", *extra}:
            continue
        try:
            count = _count(features(pixel_values=pixels, **extra))
        except Exception as other:
            first = first or other
            continue
        if count and count % batch == 0:
            return pixels, extra, count
    raise (first if first is not None and isinstance(error, TypeError) else error) from None


def image_batch(model: Any, config: Any, ids: Any, seq: int, batch: int) -> dict[str, Any]:
    """A batch of ``batch`` rows, each one image and ``seq`` text tokens (``ids(n)``: ``[batch, n]`` text ids).
    Square images first (:func:`_square_layout`); where the model takes none of them, the layouts of
    :func:`_other_layouts`, with what else its ``get_image_features`` requires (grids, masks of ones, sizes) given
    by name. Raises where the config or the model does not say enough."""
    import torch

    parameters = inspect.signature(model.forward).parameters
    if "pixel_values" not in parameters:
        raise ValueError("its forward takes no pixel_values")
    token, vision = image_token(config), _vision(config)
    if token is None or vision is None:
        raise ValueError("no image token id or no vision config")
    inner = getattr(model, "model", model)
    features = getattr(inner, "get_image_features", None) or getattr(model, "get_image_features", None)
    if features is None:
        raise ValueError("no get_image_features")
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                pixels, extra, count = _square_layout(vision, parameters, batch, features)
            except Exception as error:
                pixels, extra, count = _first_other_layout(config, vision, parameters, batch, features, error)
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
FRAME_MASKS = ("input_features_mask", "feature_attention_mask")
HOP = 160  # raw-audio samples per mel frame: the Whisper-style feature extractors' hop_length


def _tower_count(inner: Any, batch: int, frames: int) -> int:
    """Audio features of ``batch`` clips of ``frames`` frames by the audio tower's own output lengths, where the
    count cannot come from ``get_audio_features`` alone (Qwen2-Audio has none; Music Flamingo's needs the text)."""
    import torch

    lengths = getattr(getattr(inner, "audio_tower", None), "_get_feat_extract_output_lengths", None)
    if lengths is None:
        raise ValueError("no get_audio_features and no audio tower output lengths")
    out = lengths(torch.tensor([frames] * batch))
    out = out[-1] if isinstance(out, tuple) else out
    return int(out.sum())


def _frames(audio: Any, frames: int) -> int:
    """``frames`` rounded up to the encoder's window (Qwen3-ASR's ``n_window``: its feature extractor pads the mel
    frames to a multiple of ``2 * n_window``)."""
    window = _int(_get(audio, "n_window"))
    return -(-frames // (2 * window)) * (2 * window) if window else frames


def _audio_extras(get: Any, parameters: Any, batch: int, frames: int) -> dict[str, Any]:
    """What a processor gives besides the features and ``get_audio_features`` requires: masks of real mel frames
    (``input_features_mask``), of real raw-audio samples (``padding_mask``), all ones for full clips."""
    import torch

    extra: dict[str, Any] = {}
    for name in _required(get):
        if name in FRAME_MASKS and name in parameters:
            extra[name] = torch.ones(batch, frames, dtype=torch.long)
        elif name == "padding_mask" and name in parameters:
            extra[name] = torch.ones(batch, frames * HOP, dtype=torch.long)
    return extra


def _with_placeholders(text: Any, count: int, batch: int, token: int) -> Any:
    """``text`` with ``count // batch`` placeholder tokens after its first two tokens in each row."""
    import torch

    placeholders = torch.full((batch, count // batch), token, dtype=text.dtype)
    return torch.cat([text[:, :2], placeholders, text[:, 2:]], dim=1)


def audio_batch(model: Any, config: Any, ids: Any, seq: int, batch: int, frames: int) -> dict[str, Any]:
    """A batch of ``batch`` rows, each one clip of ``frames`` mel frames and ``seq`` text tokens, for an audio
    language model (Qwen2-Audio, Voxtral, ...): as many audio tokens as its ``get_audio_features`` makes. Features
    are ``[batch, mel bins, frames]``, or ``[batch, frames, input_size]`` where the encoder takes stacked frames
    time-major (Fun-ASR's low-frame-rate stacking)."""
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
    frames = _frames(audio, frames)
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(batch, mels, frames, generator=generator)
    extra: dict[str, Any] = {}
    if "feature_attention_mask" in parameters:
        extra["feature_attention_mask"] = torch.ones(batch, frames, dtype=torch.long)
    inner = getattr(model, "model", model)
    get = getattr(inner, "get_audio_features", None) or getattr(model, "get_audio_features", None)
    text = ids(seq)
    if get is None:
        count = _tower_count(inner, batch, frames)
    else:
        extra.update(_audio_extras(get, parameters, batch, frames))
        given = {}
        if "input_ids" in _required(get):  # the placeholders' positions time the features (Music Flamingo)
            given["input_ids"] = _with_placeholders(text, _tower_count(inner, batch, frames), batch, token)
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                try:
                    count = _count(get(input_features=features, **extra, **given))
                except Exception:
                    width = _int(_get(audio, "input_size"))
                    if not width or width == mels:
                        raise
                    features = torch.randn(batch, frames, width, generator=generator)
                    count = _count(get(input_features=features, **extra, **given))
        finally:
            model.train(was)
    if count % batch:
        raise ValueError(f"{count} audio features for {batch} clips")
    input_ids = _with_placeholders(text, count, batch, token)
    labels = input_ids.clone()
    labels[input_ids == token] = -100
    return {"input_ids": input_ids, "labels": labels, "input_features": features, **extra}
