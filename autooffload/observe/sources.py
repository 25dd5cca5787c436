"""Observe: stacks whose length no token count gives, such as a speech encoder on raw audio or a vision tower on
pixels.

A stack's length is read from its entry's call when the call carries tokens (:mod:`.stacks`, :mod:`.inputs`). Some
stacks run on what a model computes from a raw input instead: Moonshine's and SpeechT5's encoders, and wav2vec2's
feature extractor and transformer inside a speech encoder-decoder, run on frames a convolution makes from
``input_values`` (audio samples); a VLM's vision tower runs on patches of ``pixel_values``; an audio language model's
audio tower on ``input_features``. Such a stack is planned from its *source*: the raw input the deciding call
carries, by one of the names listed here. How many elements the source has is read per micro-batch; what each of
the stack's layers saves per element of it, and the stack's length per element, are learned from that layer's
first call (:mod:`.sizes`), the way every layer's bytes already are. Until a layer has run once, it is sized at 0:
mode ``on`` needs no size, and a partial level offloads first what is known to free most. A stack on what the model
computes from another tower (Unlimited-OCR's CLIP encoder on the ``patch_embeds`` its SAM tower makes) is sized per
element of the raw input of its modality that the model takes: no deciding call carries what it runs on.
"""

from __future__ import annotations

import inspect

import torch

# Raw inputs a stack may run on, by the names model forwards give them (a model's own ``main_input_name`` first).
RAW_PARAMETERS = (
    "input_values",
    "inputs",
    "pixel_values",
    "flattened_patches",  # Kosmos-2.5's and Pix2Struct's image patches
    "pixel_values_videos",
    "input_features",
    "input_audio_embeds",
    "audio_input_features",
    "audio_values",
)
TOKEN_IDS = ("input_ids", "inputs_embeds")
# What each raw input is, by the modality names of transformers' ``input_modalities``.
MODALITIES = {
    "pixel_values": "image",
    "flattened_patches": "image",
    "pixel_values_videos": "video",
    "input_values": "audio",
    "input_features": "audio",
    "input_audio_embeds": "audio",
    "audio_input_features": "audio",
    "audio_values": "audio",
}


def raw_source(modules: dict[str, torch.nn.Module], owner: str) -> tuple[str, tuple[str, ...]] | None:
    """(entry name, source names) of a stack owned by ``owner`` that runs on a raw input; None where no module at or
    above the owner takes one. The entry is the nearest module at or above the owner whose ``forward`` takes a raw
    input (:data:`RAW_PARAMETERS`, or the ``main_input_name`` of a module on the way up); the source names are those
    it takes, then the ``main_input_name`` of the modules above it (a speech encoder-decoder's call names the audio
    ``inputs``), then, for an input the model computes, the raw input it is computed from (:func:`_computed_from`).
    Only these: another raw input a model above takes may feed another stack (phi4's audio and
    image inputs reach one embedding module)."""
    chain = []
    name = owner
    while True:
        if name in modules:
            chain.append(name)
        if not name:
            break
        name = name.rpartition(".")[0]
    mains: list[str] = []
    for name in chain:
        main = getattr(modules[name], "main_input_name", None)
        if isinstance(main, str) and main not in TOKEN_IDS and main not in mains:
            mains.append(main)
    candidates = mains + [name for name in RAW_PARAMETERS if name not in mains]
    for index, name in enumerate(chain):
        taken = [source for source in candidates if source in _parameters(modules[name])]
        if taken:
            above = [main for entry in chain[index:] for main in _main(modules[entry]) if main not in taken]
            return name, tuple(dict.fromkeys(taken + above + _computed_from(modules, chain[index:], taken)))
    return None


def _computed_from(modules: dict[str, torch.nn.Module], chain: list[str], taken: list[str]) -> list[str]:
    """For an entry (``chain[0]``, then its ancestors) whose input ``taken`` no ancestor takes: the model computes
    that input (Unlimited-OCR's CLIP encoder runs on ``patch_embeds`` its SAM tower makes from ``pixel_values``), so
    no deciding call above the entry carries it, and the stack is sized per element of the raw input it is computed
    from: that of the entry's own modality (``input_modalities``: image, video, audio) the nearest ancestor takes.
    Empty where an ancestor takes ``taken`` (a vision tower on the model's own ``pixel_values``), where the entry
    declares no modality, and for a raw input of another modality (phi4's image tower, under a module that takes
    only the audio by a name known here): that input feeds another stack."""
    entry, above = modules[chain[0]], [_parameters(modules[name]) for name in chain[1:]]
    if any(source in names for names in above for source in taken):
        return []
    declared = getattr(entry, "input_modalities", ())
    modalities = {declared} if isinstance(declared, str) else set(declared)
    for names in above:
        found = [source for source in RAW_PARAMETERS if source in names]
        if found:
            return [source for source in found if MODALITIES.get(source) in modalities]
    return []


def _main(module: torch.nn.Module) -> list[str]:
    main = getattr(module, "main_input_name", None)
    return [main] if isinstance(main, str) and main not in TOKEN_IDS else []


def source_elements(bound: dict, names: tuple[str, ...]) -> int | None:
    """The elements of the floating-point tensors of a call's arguments ``bound`` under ``names`` (images and
    videos both); None where the call carries none (a text-only batch of a VLM: its vision tower does not run)."""
    found: list[torch.Tensor] = []
    for name in names:
        value = bound.get(name)
        if torch.is_tensor(value) and value.is_floating_point() and not any(value is seen for seen in found):
            found.append(value)
    total = sum(int(value.numel()) for value in found)
    return total or None


def input_shape(tensor: torch.Tensor) -> tuple[int, int]:
    """(sequence length, tokens) of a layer input: ``[batch, seq, hidden]`` (or more leading axes), ``[tokens,
    hidden]`` (a vision tower's patches of every image), or a flat tensor."""
    if tensor.dim() >= 3:
        return int(tensor.shape[-2]), int(tensor.numel() // max(int(tensor.shape[-1]), 1))
    if tensor.dim() == 2:
        return int(tensor.shape[0]), int(tensor.shape[0])
    return int(tensor.numel()), int(tensor.numel())


def _parameters(module: torch.nn.Module) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return ()
