"""Conformance sweep: every model type of the installed transformers, one tiny training step each.

    python benchmarks/conformance.py --out benchmarks/results/$(date +%F)-conformance [--types a,b]
        [--mappings causal,image-text,seq2seq,speech] [--timeout 240] [--jobs 1]

For every model type in the causal-LM, image-text-to-text (text-only batches), seq2seq-LM and speech-seq2seq
mappings: build a tiny random config (:func:`tiny_config`: every size key of the config and of its nested
sub-configs shrunk, lists per layer cut to the new depth), then train one step three times from the same
weights and batch: plain checkpointing, autooffload ``mode="on"``, and autooffload at a partial level (a
fixed policy, about half the layers). autooffload runs the sync engine with real copies into pageable host
buffers (a :class:`~autooffload.apply.host_memory.HostMemory` that "pins" with no-op calls, so the hooks copy
on a CPU as they would into pinned memory on a GPU).

What the sweep measures is its own: it wraps torch's checkpoint entry points
(``torch.utils.checkpoint``'s private functions behind ``checkpoint``, found for the installed torch by a
probe call: :func:`checkpoint_entry_points`; it stops with an error where it finds none), which every checkpointed
call of every stack goes through, and records each grad-enabled call's layer input (its first
positional tensor, once per tensor per forward). With text-only batches only the stacks that consume the
tokens run (a VLM's vision tower does not), so the calls seen are those of the token stacks (both stacks of an
encoder-decoder). Checked per type:

- no exception in any run;
- ``on``: bytes moved == the bytes of every recorded call's input == the arithmetic autooffload reports
  (``planned_bytes()``: each offloaded layer's calls x the bytes its first call reported);
- ``on``, the same batch once more: what the decision sizes all planned layers at *before* that forward (each
  stack's length read from the batch x the bytes per token its layers' calls showed) == the bytes it moves.
  The table also shows the first decision's figure (``first guess``: the config's widths, before any layer
  ran), which is informative only;
- partial: bytes moved == the arithmetic, and equal to the inputs of the very layers it offloaded (every call
  of each; the module's recorded inputs);
- loss and every gradient bit-identical to plain checkpointing, in both runs;
- warnings (``AutoOffloadWarning`` and the ``transformers.autooffload`` log at WARNING) are collected; a
  run that moves what it should must warn nothing, a run left on plain checkpointing must say so once.

Beside the verdict, a second source judges each row that ran: transformers' own test,
``check_training_gradient_checkpointing`` from the source distribution of the installed release, run on the row's
model class, tiny config and batch with autooffload attached in mode ``on`` (:mod:`upstream`; column
``transformers' test``: ``pass``, ``fail`` where it passes without autooffload, ``fails-plain`` where it fails
without autooffload too, ``skipped``). ``--no-upstream`` leaves it out; ``--transformers-sdist PATH`` names the sdist
(else it is fetched once with pip into a cache).

Verdicts: ``correct``; ``plain-with-warning`` (nothing moved, one warning, results identical: the warning's
text is in the table for a reader to judge); ``wrong`` (what differs); ``crash`` (autooffload raised, or the
child process died or timed out); ``skipped`` (no tiny config, no checkpointing support, or the plain
checkpointed step itself fails: why). Every type runs in its own subprocess with a timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import itertools
import json
import logging
import os
import platform
import random
import sys
import tempfile
import time
import traceback
import warnings
import weakref
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's autooffload, not another one installed in the environment

MAPPINGS = {
    "causal": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "image-text": ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "AutoModelForImageTextToText"),
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "speech": ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
}
ENCODER_DECODER = ("seq2seq", "speech")
BATCH, SEQ = 2, 48
SOURCE, TARGET = 96, 32
LAYERS = 3
VOCAB = 512

# Sizes a tiny config gets, by the names configs use for them. Depth keys are set to LAYERS.
DEPTH_KEYS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "encoder_layers",
    "decoder_layers",
    "num_text_layers",
    "depth",
    "vision_layers",
    "audio_layers",
)
SIZE_KEYS = {
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "embed_dim": 64,
    "dim": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_ff": 128,
    "n_inner": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "expert_intermediate_size": 32,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "d_kv": 16,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "rotary_dim": 8,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "state_size": 16,
    "n_groups": 1,
    "expand": 1,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_group": 1,
    "first_k_dense_replace": 1,
    "topk_group": 1,
    "max_position_embeddings": 512,
    "max_source_positions": SOURCE // 2,
    "max_target_positions": 128,
}


# ---- tiny configs ---------------------------------------------------------------------------------------


def _sub_configs(config: Any) -> list[tuple[str, Any]]:
    from transformers import PretrainedConfig

    return [(k, v) for k, v in vars(config).items() if isinstance(v, PretrainedConfig)]


def _get(config: Any, key: str) -> Any:
    """``getattr`` that reads an attribute that raises (a per-layer config's global read) as absent."""
    try:
        return getattr(config, key, None)
    except Exception:
        return None


def _depth(config: Any) -> int | None:
    for key in DEPTH_KEYS:
        value = _get(config, key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _scale_mrope(config: Any) -> None:
    """A multimodal rope section list (Qwen-VL's and GLM-4V's ``mrope_section``) sums to half the rotary size (the
    head size x ``partial_rotary_factor``): scale it with the head. A config whose model falls back to a default
    section sized for the full head when the list is missing (it names ``mrope_section`` among the rope keys it does
    not validate) gets the default's proportions (2:3:3) at the tiny size."""
    head = _get(config, "head_dim")
    hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
    if not isinstance(head, int) and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head = hidden // heads
    if not isinstance(head, int):
        return
    wants = "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ()) or _modeling_reads(
        config, "mrope_section"
    )
    for attr in ("rope_scaling", "rope_parameters"):
        rope = getattr(config, attr, None)
        if not isinstance(rope, dict):
            continue
        partial = rope.get("partial_rotary_factor", _get(config, "partial_rotary_factor"))
        half = int(head * (partial if isinstance(partial, float) and 0 < partial <= 1 else 1)) // 2
        section = rope.get("mrope_section")
        missing = section is None and wants
        section = [2, 3, 3] if missing else section
        if isinstance(section, list) and section and (missing or sum(section) != half):
            total = sum(section)
            scaled = [max(1, s * half // total) for s in section]
            scaled[0] += half - sum(scaled)
            rope["mrope_section"] = scaled
            with contextlib.suppress(Exception):
                setattr(config, attr, rope)  # a config may hand out a copy of its rope dict


def _fill_unset(config: Any) -> None:
    """Sizes a config declares but leaves unset (None) for its model to read as a number: the head size, the
    key-value heads, the experts per token, the layer types (DeepSeek-V2, Hunyuan, Ministral, Nemotron, LFM2-MoE)."""
    values = vars(config)
    hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
    depth = _depth(config)
    fills: dict[str, Any] = {}
    if "head_dim" in values and values["head_dim"] is None and isinstance(hidden, int) and isinstance(heads, int):
        fills["head_dim"] = hidden // heads
    if "num_key_value_heads" in values and values["num_key_value_heads"] is None and isinstance(heads, int):
        fills["num_key_value_heads"] = heads
    expert_keys = ("num_experts", "n_routed_experts", "num_local_experts")
    if "moe_intermediate_size" in values:  # Dots1 leaves its expert counts unset
        for key in expert_keys:
            if key in values and values[key] is None:
                fills[key] = SIZE_KEYS[key]
        if "n_shared_experts" in values and values["n_shared_experts"] is None:
            fills["n_shared_experts"] = 1
    experts = any(isinstance(values.get(key), int) or key in fills for key in expert_keys)
    if experts and "num_experts_per_tok" in values and values["num_experts_per_tok"] is None:
        fills["num_experts_per_tok"] = SIZE_KEYS["num_experts_per_tok"]
    if "layer_types" in values and values["layer_types"] is None and isinstance(depth, int):
        other = "conv" if _modeling_reads(config, '"conv"') else "full_attention"
        fills["layer_types"] = [other] * (depth - 1) + ["full_attention"]
    ssm_heads, ssm_head = values.get("mamba_n_heads"), values.get("mamba_d_head")
    if isinstance(values.get("mamba_d_ssm"), int) and isinstance(ssm_heads, int) and isinstance(ssm_head, int):
        fills["mamba_d_ssm"] = ssm_heads * ssm_head  # Falcon-H1's SSM width is its heads x head size
    for key, value in fills.items():
        with contextlib.suppress(Exception):
            setattr(config, key, value)
    attention = _get(config, "attn_config")  # DBRX's attention config reads a rope_theta it does not have
    rope = _get(config, "rope_parameters")
    if attention is not None and _get(attention, "rope_theta") is None and isinstance(rope, dict):
        with contextlib.suppress(Exception):
            attention.rope_theta = rope.get("rope_theta", 10000.0)
    if attention is not None and "clip_qkv" in vars(attention) and attention.clip_qkv is None:
        with contextlib.suppress(Exception):
            attention.clip_qkv = 8.0  # DBRX clamps with it unconditionally


def _modeling_reads(config: Any, key: str) -> bool:
    """Does the modeling file of ``config``'s family mention ``key``?"""
    import importlib
    import inspect

    try:
        module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
        return key in inspect.getsource(module)
    except Exception:  # no such module, or no source
        return False


def shrink(config: Any, *, sizes: bool, layers: int = LAYERS, vocab: int | None = VOCAB) -> Any:
    """Shrink ``config`` and every nested sub-config in place: depth to ``layers`` (per-layer lists and pattern
    strings cut to match), and with ``sizes`` the width keys of :data:`SIZE_KEYS`; the vocabulary to ``vocab``,
    special token ids above it moved inside it."""
    for _, sub in _sub_configs(config):
        shrink(sub, sizes=sizes, layers=layers, vocab=vocab)
    depth = _depth(config)
    for key in DEPTH_KEYS:
        value = _get(config, key)
        if isinstance(value, int) and not isinstance(value, bool) and value > layers:
            with contextlib.suppress(Exception):
                setattr(config, key, layers)
    if depth is not None and depth > layers:
        for key, value in list(vars(config).items()):
            pattern = isinstance(value, str) and ("pattern" in key or "override" in key)
            if (isinstance(value, (list, tuple)) or pattern) and len(value) == depth:
                with contextlib.suppress(Exception):
                    setattr(config, key, type(value)(value[:layers]) if not isinstance(value, str) else value[:layers])
    if sizes:
        no_gqa = _get(config, "num_key_value_heads") == _get(config, "num_attention_heads")
        for key, size in SIZE_KEYS.items():
            value = _get(config, key)
            if isinstance(value, int) and not isinstance(value, bool) and value > size:
                with contextlib.suppress(Exception):
                    setattr(config, key, size)
        if isinstance(_get(config, "num_key_value_heads"), int) and isinstance(
            _get(config, "num_attention_heads"), int
        ):
            with contextlib.suppress(Exception):
                config.num_key_value_heads = min(config.num_key_value_heads, config.num_attention_heads)
        if no_gqa and isinstance(_get(config, "num_attention_heads"), int):
            with contextlib.suppress(Exception):
                config.num_key_value_heads = config.num_attention_heads
        if isinstance(_get(config, "qk_nope_head_dim"), int) and isinstance(_get(config, "qk_rope_head_dim"), int):
            with contextlib.suppress(Exception):
                config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        _scale_mrope(config)
        _fill_unset(config)
        image, patch = _get(config, "image_size"), _get(config, "patch_size")
        if isinstance(image, int) and isinstance(patch, int) and patch > 0 and image // patch > 32:
            with contextlib.suppress(Exception):
                config.image_size = 32 * patch  # GOT-OCR2's 64x64 patches of global attention: minutes on a CPU
    text = _get(config, "text_config")
    for _, sub in _sub_configs(config):  # a vision tower's output feeds the text stack: the text's width
        for key in ("out_hidden_size", "text_hidden_size"):
            if sizes and text is not None and sub is not text and isinstance(_get(sub, key), int):
                with contextlib.suppress(Exception):
                    setattr(sub, key, _get(text, "hidden_size"))
    current = _get(config, "vocab_size")
    limit = None
    if vocab is not None and isinstance(current, int) and current > vocab:
        with contextlib.suppress(Exception):
            config.vocab_size = vocab
        limit = vocab
    elif vocab is not None and current is None and _sub_configs(config):  # a VLM's image token: in the text's
        limit = text_vocab(config)
    if limit is not None:
        taken = set().union(*(special_ids(sub) for _, sub in _sub_configs(config)))
        vocab = limit
        free = vocab - 1
        for key, value in sorted(vars(config).items()):
            if (key.endswith("_token_id") or key.endswith("_token_index")) and isinstance(value, int):
                if value >= vocab:
                    while free in taken:
                        free -= 1
                    setattr(config, key, free)
                    value = free
                taken.add(value)
    return config


def special_ids(config: Any) -> set[int]:
    ids: set[int] = set()
    for key, value in vars(config).items():
        if (key.endswith("_token_id") or key.endswith("_token_index") or key.endswith("_id")) and isinstance(
            value, int
        ):
            ids.add(value)
    for _, sub in _sub_configs(config):
        ids |= special_ids(sub)
    return ids


def text_vocab(config: Any) -> int | None:
    sizes = [_get(config, "vocab_size")]
    for name, sub in _sub_configs(config):
        if "text" in name or "decoder" in name or "language" in name:
            sizes.append(_get(sub, "vocab_size"))
    sizes = [s for s in sizes if isinstance(s, int) and s > 0]
    return min(sizes) if sizes else None


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
    import quirks
    from quirks.tokens import free_ids
    from transformers import AutoConfig

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


# ---- batches and one step --------------------------------------------------------------------------------


def token_sampler(config: Any) -> Any:
    """``ids(length)``: ``[BATCH, length]`` random text ids of the config's vocabulary, no special token among them."""
    import torch

    vocab = text_vocab(config) or VOCAB
    avoid = special_ids(config)
    allowed = torch.tensor([i for i in range(min(vocab, 4096)) if i not in avoid][:1000] or [0])
    generator = torch.Generator().manual_seed(1)

    def ids(length: int) -> torch.Tensor:
        return allowed[torch.randint(len(allowed), (BATCH, length), generator=generator)]

    return ids


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


def _first_tensor(args: tuple) -> Any:
    import torch

    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def _storage(tensor: Any) -> int:
    try:
        return tensor.untyped_storage().data_ptr() or id(tensor)
    except Exception:  # no storage of its own (a tensor subclass)
        return id(tensor)


def _own(tensor: Any) -> bool:
    """An activation with a storage of its own: floating-point, requiring grad, the whole of its storage."""
    try:
        whole = (
            tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        )
    except Exception:
        return False
    return tensor.is_floating_point() and tensor.requires_grad and whole


def _owner(function: Any) -> Any:
    """The module a checkpointed function belongs to: a bound method's, or the first argument of a partial over a
    plain ``forward`` (Dory's layers); None where neither."""
    import functools

    import torch

    while isinstance(function, functools.partial):
        if function.args and isinstance(function.args[0], torch.nn.Module):
            return function.args[0]
        function = function.func
    return getattr(function, "__self__", None)


def _owner_name(function: Any) -> str:
    """The module class a checkpointed function belongs to, for the report."""
    owner = _owner(function)
    return type(owner).__name__ if owner is not None else getattr(function, "__qualname__", "?")


# Where torch's checkpoint hands a call to its implementation, newest first. Private names, which move between
# releases (torch 2.14's checkpoint calls ``_checkpoint_without_reentrant_generator_impl``; 2.13's the generator
# without the suffix): each is tried with a probe call, and only the ones that see it are wrapped.
NON_REENTRANT = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")


def _wrap_generator(original: Any, record: Any) -> Any:
    """A wrapper of a non-reentrant entry point that records ``(fn, args)``, whatever its signature: ``args`` is
    its parameter of that name (a ``*args`` in 2.13, a tuple in 2.14), bound to the call as the original would."""
    import inspect

    signature = inspect.signature(original)

    def watched(*call_args: Any, **call_kwargs: Any) -> Any:
        bound = signature.bind(*call_args, **call_kwargs)
        function = call_args[0] if call_args else call_kwargs.get("fn")
        record(function, tuple(bound.arguments.get("args", ())))
        return original(*call_args, **call_kwargs)

    return watched


def _wrap_function_class(original: Any, record: Any) -> Any:
    """A stand-in for ``CheckpointFunction`` (the reentrant path) whose ``apply(fn, preserve, *args)`` records."""

    class WatchedFunction:
        @staticmethod
        def apply(fn: Any, preserve: Any, *args: Any) -> Any:
            record(fn, args)
            return original.apply(fn, preserve, *args)

    return WatchedFunction


_ENTRY_POINTS: list[tuple[str, Any]] | None = None


def checkpoint_entry_points() -> list[tuple[str, Any]]:
    """(name in ``torch.utils.checkpoint``, wrapper factory) of the entry points this torch's ``checkpoint`` really
    calls, one for each path (non-reentrant, reentrant), found once per process by a probe call through each
    candidate. Raises ``RuntimeError`` where a path reaches none of them: the sweep cannot count on this torch."""
    global _ENTRY_POINTS
    if _ENTRY_POINTS is not None:
        return _ENTRY_POINTS
    import torch
    import torch.utils.checkpoint as cp

    def sees(name: str, make: Any, reentrant: bool) -> bool:
        seen: list[Any] = []
        original = getattr(cp, name, None)
        if original is None:
            return False
        setattr(cp, name, make(original, lambda fn, args: seen.append(args)))
        try:
            probe = torch.ones(2, requires_grad=True)
            with torch.enable_grad():
                cp.checkpoint(torch.sin, probe, use_reentrant=reentrant).sum().backward()
        except Exception:  # a candidate whose signature this wrapper does not bind
            return False
        finally:
            setattr(cp, name, original)
        return any(any(a is probe for a in args) for args in seen)

    found = []
    candidates = [(name, _wrap_generator, False) for name in NON_REENTRANT]
    candidates.append(("CheckpointFunction", _wrap_function_class, True))
    for reentrant in (False, True):
        path = [(name, make) for name, make, kind in candidates if kind == reentrant and sees(name, make, reentrant)]
        if not path:
            names = ", ".join(name for name, _, kind in candidates if kind == reentrant)
            raise RuntimeError(
                f"torch {torch.__version__}: torch.utils.checkpoint.checkpoint(use_reentrant={reentrant}) reaches none "
                f"of {names}; the sweep cannot count checkpointed calls on it (add this torch's entry point to "
                "benchmarks/conformance.py)"
            )
        found.append(path[0])
    _ENTRY_POINTS = found
    return found


class CheckpointCalls:
    """Records every grad-enabled call of torch's checkpoint: the bytes of what belongs to that layer alone (its
    input, the first positional tensor, each tensor once per step; and every other positional tensor that is an
    activation, floating-point and requiring grad, whose storage no other call receives: ZAYA's router states,
    Pegasus-X's global tokens; not an encoder's states every decoder layer receives, T5's position bias, masks, or
    slices of one tensor that holds every layer's) and the module class it checkpoints. Wraps the two entry points
    ``torch.utils.checkpoint.checkpoint`` dispatches to, so any caller (transformers, autooffload, a container's
    loop) is seen, without reading autooffload. What is shared is known at the end: :meth:`finish` counts."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.per_module: dict[int, int] = {}  # bytes of every call of one module (a layer called twice: both)
        self.extras = 0  # bytes of second activations of a layer's own, among those of ``calls``
        self._seen: list[weakref.ref] = []
        self._recorded: list[tuple[str, int, int, list[Any]]] = []  # owner, key, input bytes, other tensors
        self._storages: dict[int, int] = {}  # storage -> calls that receive it
        # Every tensor recorded, held until :meth:`finish`: a storage freed within the step (an input offloaded to
        # the host) may have its address taken by a later tensor, which would then count as the same storage.
        self._held: list[Any] = []

    def record(self, function: Any, args: tuple) -> None:
        import torch

        if not torch.is_grad_enabled():
            return
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self._held.extend(tensors)
        for storage in {_storage(t) for t in tensors}:
            self._storages[storage] = self._storages.get(storage, 0) + 1
        tensor = tensors[0] if tensors else None
        nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
        if tensor is not None and any(ref() is tensor for ref in self._seen):
            return
        if tensor is not None:
            self._seen.append(weakref.ref(tensor))
        self._recorded.append((_owner_name(function), id(_owner(function) or function), nbytes, tensors[1:]))

    def finish(self) -> None:
        """Count what was recorded: a second tensor is a layer's own where no other call received its storage."""
        for name, key, nbytes, others in self._recorded:
            own = sum(t.numel() * t.element_size() for t in others if _own(t) and self._storages[_storage(t)] == 1)
            self.extras += own
            self.calls.append((name, nbytes + own))
            self.per_module[key] = self.per_module.get(key, 0) + nbytes + own
        self._recorded, self._storages, self._held = [], {}, []

    @contextlib.contextmanager
    def watching(self):
        """Record every checkpointed call while inside. The entry points are found for the installed torch
        (:func:`checkpoint_entry_points`); a torch whose checkpoint reaches none of them raises here, loudly,
        rather than a sweep that sees no call and judges every row by nothing."""
        import torch.utils.checkpoint as cp

        patched = [(name, getattr(cp, name), make) for name, make in checkpoint_entry_points()]
        for name, original, make in patched:
            setattr(cp, name, make(original, self.record))
        try:
            yield self
        finally:
            for name, original, _ in patched:
                setattr(cp, name, original)
            self.finish()

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.calls)


class FixedLevel:
    """A policy that asks for ``level`` layers on every micro-batch: the sweep's partial level."""

    def __init__(self, level: int) -> None:
        self.level = level

    def decide(self, observation: Any) -> int:
        return self.level


@dataclasses.dataclass
class StepResult:
    loss: Any = None
    grads: dict[str, Any] = dataclasses.field(default_factory=dict)
    calls: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    per_module: dict[int, int] = dataclasses.field(default_factory=dict)
    extras: int = 0  # of the bytes of ``calls``, second activations of a layer's own
    layers: int | None = None
    moved: int | None = None
    arithmetic: float | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    logs: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    first_guess: int | None = None  # the first decision's bytes for every planned layer (the config's widths)
    predicted: int | None = None  # the same, decided again for the same batch once the layer calls were seen
    moved_again: int | None = None
    offloaded: list[Any] = dataclasses.field(default_factory=list)  # the modules the partial level offloaded


def _predicted(controller: Any) -> int | None:
    """What the running micro-batch's decision sized the planned layers that ran at, before the forward ran them
    (a layer that LayerDrop skipped in this forward is left out: no decision can know it in advance)."""
    sizes, switch = controller.sizes.planned_layer_bytes, controller.switch
    if sizes is None or switch is None:
        return None
    return sum(size for size, calls in zip(sizes, switch.forward.counts, strict=True) if calls)


def _slot_module(slot: Any) -> Any:
    """The module a planned layer position runs: the target itself, or a container's block ``index``."""
    target = slot.target
    if target.kind != "container":
        return target.module
    prefix = target.name + "." if target.name else ""
    try:
        return target.module.get_submodule(target.stack[len(prefix) :])[slot.index]
    except Exception:  # a container laid out otherwise
        return None


class _Logs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


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


def train_step(model: Any, batch: dict[str, Any], mode: str, level: int | None = None) -> StepResult:
    """One forward and backward from ``model``'s weights: ``mode`` plain (no autooffload), on, or partial."""
    import numpy
    import torch

    from autooffload import OffloadController, Settings
    from autooffload.apply.host_memory import HostMemory
    from autooffload.warn import AutoOffloadWarning

    result = StepResult()
    handler = _Logs()
    logger = logging.getLogger("transformers.autooffload")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    controller = None
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode != "plain":
                host = HostMemory(pin=True, register=lambda t: None, unregister=lambda t: None, drain=lambda d: None)
                settings = Settings(mode="on" if mode == "on" else "auto", engine="sync", host_memory="1GiB")
                policy = FixedLevel(level or 0) if mode == "partial" else None
                controller = OffloadController(settings, probe=None, policy=policy, host=host)
                controller.attach(model)
                result.layers = len(controller.switch.layers) if controller.switch is not None else 0
            model.train()
            recorder = CheckpointCalls()
            torch.manual_seed(0)
            random.seed(0)
            numpy.random.seed(0)  # BigBird's random attention blocks draw from numpy
            with recorder.watching():  # the forward's calls: a recompute's nested calls in the backward are not
                output = model(**batch)  # new layers (Zamba's hybrid layers checkpoint their Mamba layer inside)
                loss = output.loss if getattr(output, "loss", None) is not None else output[0].float().mean()
            loss.backward()
            result.loss = loss.detach().clone()
            result.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            if controller is not None:
                switch = controller.switch
                result.arithmetic = controller.planned_bytes()  # what the layer calls reported they took
                result.first_guess = _predicted(controller)
                if switch is not None:
                    result.offloaded = [_slot_module(switch.layers[p]) for p in switch.order[: switch.offloaded]]
                controller.end_step()
                record = controller.history[-1] if controller.history else None
                result.moved = record.bytes_moved if record is not None else controller.last_step_bytes
                if mode == "on":  # the same batch again: what the decision predicts now, before the forward
                    torch.manual_seed(0)
                    output = model(**batch)
                    (output.loss if getattr(output, "loss", None) is not None else output[0].float().mean()).backward()
                    result.predicted = _predicted(controller)
                    controller.end_step()
                    result.moved_again = controller.history[-1].bytes_moved if controller.history else None
                controller.detach()
        result.calls, result.per_module, result.extras = recorder.calls, recorder.per_module, recorder.extras
        result.warnings = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
        result.logs = [f"{r.levelname}: {r.getMessage()}" for r in handler.records]
        result.warnings += [r.getMessage() for r in handler.records if r.levelno >= logging.WARNING]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        result.seconds = time.perf_counter() - start
    return result


def _same(a: StepResult, b: StepResult) -> str | None:
    import torch

    if not torch.equal(a.loss, b.loss):
        return f"loss {a.loss.item()!r} != {b.loss.item()!r}"
    if set(a.grads) != set(b.grads):
        return f"gradients of different parameters ({len(a.grads)} vs {len(b.grads)})"
    differ = [n for n in a.grads if not torch.equal(a.grads[n], b.grads[n])]
    return f"{len(differ)} gradient(s) differ, e.g. {differ[0]}" if differ else None


def _subset_sums(sizes: list[int], k: int) -> set[int] | None:
    if len(sizes) > 18:
        return None
    return {sum(c) for c in itertools.combinations(sizes, k)}


def _with_media(model: Any, config: Any, batch: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """An image batch for a model that takes ``pixel_values``, an audio batch for an audio language model that
    takes ``input_features`` (:mod:`media_batches`), where one builds and takes a plain checkpointed step; else
    ``batch`` (text only), with the reason in the row."""
    import inspect

    import media_batches

    parameters = inspect.signature(model.forward).parameters
    if "pixel_values" in parameters:
        kind, build = "image", lambda: media_batches.image_batch(model, config, token_sampler(config), SEQ, BATCH)
    elif "input_features" in parameters and getattr(config, "is_encoder_decoder", False) is not True:
        kind, build = "audio", lambda: media_batches.audio_batch(model, config, token_sampler(config), SEQ, BATCH, 96)
    else:
        return batch
    state = copy.deepcopy(model.state_dict())
    try:
        media = build()
        train_step(model, media, "plain")
    except Exception as error:
        row["batch"] = f"text only ({kind} batch: {type(error).__name__}: {str(error)[:160]})"
        return batch
    finally:
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
    row["batch"] = kind
    return media


# transformers' own test per row (:mod:`upstream`): run it, and the sdist to read it from (None: found or fetched).
UPSTREAM: dict[str, Any] = {"run": False, "sdist": None}


def check_type(model_type: str, mapping: str) -> dict[str, Any]:
    """Build, run plain/on/partial, and judge one model type (and, with ``UPSTREAM["run"]``, run transformers' own
    checkpointing test on it: :mod:`upstream`). Runs in the child process."""
    import quirks

    row: dict[str, Any] = {"type": model_type, "mapping": mapping}
    start = time.perf_counter()
    plain = model = batch = None
    errors = []
    for sizes in (True,):  # a full-size fallback builds models of gigabytes: a type that needs it is skipped
        try:
            model, config = build(model_type, mapping, sizes)
        except ImportError as error:  # a model of a package this environment lacks (timm's vision towers)
            row.update(verdict="skipped", reason=f"needs a package not installed: {str(error).strip().splitlines()[0]}")
            return _finish(row, start)
        except Exception as error:
            errors.append(f"tiny config: {type(error).__name__}: {error}")
            continue
        if not getattr(model, "supports_gradient_checkpointing", False):
            row.update(verdict="skipped", reason="the model does not support gradient checkpointing")
            return _finish(row, start)
        try:
            quirks.enable_checkpointing(model_type, model)
            batch = make_batch(model, config, mapping)
            state = copy.deepcopy(model.state_dict())
            kind, fixed = quirks.fix_batch(model_type, mapping, model, config, batch)
            if kind is None:
                batch = _with_media(model, config, batch, row)
            else:
                batch, row["batch"] = fixed, kind
            train_step(model, batch, "plain")  # a first forward may change the model (BigBird's attention type)
            model.load_state_dict(state)
            model.zero_grad(set_to_none=True)
            plain = train_step(model, batch, "plain")
            break
        except Exception as error:
            errors.append(f"plain checkpointed step: {type(error).__name__}: {str(error)[:300]}")
            plain = None
    if plain is None:
        row.update(verdict="skipped", reason=errors[-1] if errors else "no model")
        return _finish(row, start)
    row["params"] = sum(p.numel() for p in model.parameters())
    row["calls"] = len(plain.calls)
    row["extras"] = plain.extras
    row["call_owners"] = sorted({o for o, _ in plain.calls})
    row["measured"] = plain.bytes if hasattr(plain, "bytes") else sum(n for _, n in plain.calls)
    problems: list[str] = []
    runs: dict[str, StepResult] = {}
    for mode in ("on", "partial"):
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        level = None
        if mode == "partial":
            layers = runs["on"].layers or 0
            if layers < 2:
                row["partial"] = "n/a (fewer than 2 layers planned)"
                continue
            level = layers // 2
        try:
            runs[mode] = train_step(model, batch, mode, level)
        except Exception as error:
            row.update(
                verdict="crash",
                reason=f"mode {mode}: {type(error).__name__}: {str(error)[:300]}",
                traceback=traceback.format_exc()[-2000:],
            )
            return _finish(row, start)
    on = runs["on"]
    measured = sum(n for _, n in plain.calls)
    row.update(
        layers=on.layers,
        moved=on.moved,
        arithmetic=on.arithmetic,
        first_guess=on.first_guess,
        predicted=on.predicted,
        warnings=sorted(set(on.warnings) | set(runs["partial"].warnings if "partial" in runs else [])),
        logs=on.logs[:6],
        measured=measured,
    )
    for mode, run in runs.items():
        differ = _same(plain, run)
        if differ:
            problems.append(f"{mode}: {differ}")
        if sum(n for _, n in run.calls) != measured:
            problems.append(f"{mode}: checkpointed inputs {sum(n for _, n in run.calls)} != plain's {measured}")
    if "partial" in runs:
        partial = runs["partial"]
        row.update(partial_level=partial.layers and partial.layers // 2, partial_moved=partial.moved)
        row["partial_arithmetic"] = partial.arithmetic
        if on.moved == measured and measured > 0:
            if partial.arithmetic is None or partial.moved != round(partial.arithmetic):
                problems.append(f"partial: moved {partial.moved} != arithmetic {partial.arithmetic}")
            # a layer that did not run (a vision tower on a text-only batch) holds nothing
            chosen = [None if module is None else plain.per_module.get(id(module), 0) for module in partial.offloaded]
            if partial.offloaded and None not in chosen:
                if partial.moved != sum(chosen):
                    problems.append(
                        f"partial: moved {partial.moved} != the inputs of the layers it offloaded, {sum(chosen)}"
                    )
            else:
                sums = _subset_sums(list(plain.per_module.values()), row["partial_level"])
                if sums is not None and partial.moved not in sums:
                    problems.append(f"partial: moved {partial.moved} is not the input of {row['partial_level']} layers")
    warned = row["warnings"]
    if on.moved == 0 and measured > 0 and not problems:
        if len(warned) == 1 and "no checkpointed layers found" not in warned[0]:
            row.update(verdict="plain-with-warning", reason=warned[0])
        elif not warned:
            problems.append(f"on: moved 0 of {measured} bytes with no warning (silent miss); L={on.layers}")
        else:
            problems.append(f"on: moved 0 of {measured} bytes; warnings: {' | '.join(warned)}")
    elif measured == 0:
        problems.append("no checkpointed call with a positional input seen (nothing to move)")
    else:
        if on.moved != measured:
            problems.append(
                f"on: moved {on.moved} != measured {measured} ({len(plain.calls)} checkpointed calls, L={on.layers})"
            )
        if on.arithmetic is None or round(on.arithmetic) != on.moved:
            problems.append(f"on: arithmetic {on.arithmetic} != moved {on.moved}")
        if (
            on.predicted is None
            or on.moved_again is None
            or abs(on.predicted - on.moved_again) > max(on.layers or 0, 1)
        ):
            problems.append(f"on: decided again for the same batch, predicted {on.predicted} != moved {on.moved_again}")
        if warned and not problems:
            problems.append(f"warned while moving everything: {' | '.join(warned)}")
    if "verdict" not in row:
        row.update(verdict="wrong", reason="; ".join(problems)) if problems else row.update(verdict="correct")
    if UPSTREAM["run"]:
        import upstream

        row["upstream"] = upstream.run_upstream(type(model), model.config, batch, UPSTREAM["sdist"])
    return _finish(row, start)


def _finish(row: dict[str, Any], start: float) -> dict[str, Any]:
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


# ---- the sweep ------------------------------------------------------------------------------------------


def model_types(mappings: list[str]) -> list[tuple[str, str]]:
    """(type, mapping) for every type of the named mappings of the installed transformers (a type in both the
    causal-LM and the image-text mapping runs once, as a causal LM; an encoder-decoder type that also has a
    causal-LM class, its decoder alone, runs in both)."""
    from transformers.models.auto import modeling_auto

    pairs: list[tuple[str, str]] = []
    for mapping in mappings:
        for model_type in getattr(modeling_auto, MAPPINGS[mapping][0], {}):
            if mapping == "image-text" and (model_type, "causal") in pairs:
                continue
            pairs.append((model_type, mapping))
    return pairs


def _child_row(model_type: str, mapping: str, path: Path) -> None:
    """In a forked child: judge one type, write its row to ``path``, and leave without cleanup."""
    try:
        row = check_type(model_type, mapping)
    except BaseException as error:  # anything the sweep itself hits is that type's crash
        row = {"type": model_type, "mapping": mapping, "verdict": "crash", "reason": f"{type(error).__name__}: {error}"}
    path.write_text(json.dumps(row, default=str))
    os._exit(0)


def sweep(pairs: list[tuple[str, str]], timeout: float, jobs: int, scratch: Path) -> Any:
    """Yield one row per (type, mapping), each judged in a process of its own, ``jobs`` at a time: a fork of
    this process (torch and transformers already imported, which saves seconds per type), killed after
    ``timeout`` seconds. A child that dies or hangs is that type's crash; the sweep goes on."""
    import signal

    import torch  # noqa: F401 - imported once here, shared by every fork
    import transformers

    if UPSTREAM["run"]:  # transformers' own test, read and compiled once, shared too
        import upstream

        with contextlib.suppress(upstream.SdistUnavailable):  # each row says so
            UPSTREAM["sdist"] = str(upstream.sdist_path(transformers.__version__, UPSTREAM["sdist"]))
            upstream.load_check(UPSTREAM["sdist"])

    scratch.mkdir(parents=True, exist_ok=True)
    waiting, running = list(pairs), {}
    while waiting or running:
        while waiting and len(running) < jobs:
            model_type, mapping = waiting.pop(0)
            path = scratch / f"{model_type}.{mapping}.json"
            path.unlink(missing_ok=True)
            pid = os.fork()
            if pid == 0:
                _child_row(model_type, mapping, path)
            running[pid] = (model_type, mapping, path, time.perf_counter())
        time.sleep(0.2)
        for pid, (model_type, mapping, path, start) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            elapsed = time.perf_counter() - start
            if done == 0 and elapsed < timeout:
                continue
            if done == 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            del running[pid]
            if done and path.exists():
                row = json.loads(path.read_text())
            elif done:
                row = {"verdict": "crash", "reason": f"child died ({_status(status)})"}
            else:
                row = {"verdict": "crash", "reason": f"timeout after {timeout:.0f} s"}
            row.update(type=model_type, mapping=mapping, wall_seconds=round(elapsed, 1))
            yield row


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.WEXITSTATUS(status)}"


VERDICTS = ("correct", "plain-with-warning", "wrong", "crash", "skipped")
UPSTREAM_VERDICTS = ("pass", "fail", "fails-plain", "skipped", "unavailable")


def write_tables(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    upstream = {v: sum(r.get("upstream", {}).get("verdict") == v for r in rows) for v in UPSTREAM_VERDICTS}
    upstream["not run"] = sum("upstream" not in r for r in rows)
    summary = {"meta": meta, "counts": counts, "upstream_counts": upstream, "rows": rows}
    (out / "conformance.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [
        f"# Conformance sweep, transformers {meta['transformers']}, torch {meta['torch']}",
        "",
        f"Command: `{meta['command']}`; wall time {meta['wall_seconds']:.0f} s on {meta['machine']}.",
        "",
        "Counts: " + ", ".join(f"{v} {n}" for v, n in counts.items()),
        "",
        "transformers' own test (`check_training_gradient_checkpointing`, autooffload on): "
        + ", ".join(f"{v} {n}" for v, n in upstream.items()),
        "",
        "| type | mapping | verdict | L | calls | measured | moved | arithmetic | first guess | predicted "
        "| partial moved | transformers' test | s | reason |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        arithmetic, check = r.get("arithmetic"), r.get("upstream", {})
        reasons = [str(r.get("reason", "")), f"transformers' test: {check['reason']}" if check.get("reason") else ""]
        reason = "; ".join(part for part in reasons if part).replace("|", "/").replace("\n", " ")[:400]
        cells = [r["type"], r["mapping"], r["verdict"], r.get("layers", ""), r.get("calls", ""), r.get("measured", "")]
        cells += [r.get("moved", ""), "" if arithmetic is None else round(arithmetic), r.get("first_guess") or ""]
        cells += [r.get("predicted") or "", r.get("partial_moved", ""), check.get("verdict", "")]
        cells += [r.get("seconds", r.get("wall_seconds", ""))]
        lines.append("| " + " | ".join(str(c) for c in [*cells, reason]) + " |")
    (out / "conformance.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--types", help="comma-separated model types (default: every type of the mappings)")
    parser.add_argument("--mappings", default=",".join(MAPPINGS), help=f"comma-separated, of {', '.join(MAPPINGS)}")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per type")
    parser.add_argument("--jobs", type=int, default=1, help="types run at once")
    parser.add_argument("--no-upstream", action="store_true", help="do not run transformers' own checkpointing test")
    parser.add_argument("--transformers-sdist", help="the installed transformers' sdist (.tar.gz or unpacked)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--mapping", default="causal", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    UPSTREAM.update(run=not args.no_upstream, sdist=args.transformers_sdist)
    if args.one:
        print(json.dumps(check_type(args.one, args.mapping), default=str))
        return 0
    mappings = args.mappings.split(",")
    pairs = model_types(mappings)
    if args.types:
        wanted = args.types.split(",")
        pairs = sorted((p for p in pairs if p[0] in wanted), key=lambda p: wanted.index(p[0]))  # in the order given
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    scratch = Path(tempfile.mkdtemp(prefix="conformance-"))
    for row in sweep(pairs, args.timeout, max(1, args.jobs), scratch):
        rows.append(row)
        print(f"{row['type']:32s} {row['mapping']:10s} {row['verdict']:18s} {str(row.get('reason', ''))[:150]}")
        sys.stdout.flush()
        if args.out:  # as it goes: an interrupted sweep keeps its rows
            write_tables(rows, args.out, _meta(argv, mappings, args.timeout, start))
    meta = _meta(argv, mappings, args.timeout, start)
    if args.out:
        write_tables(rows, args.out, meta)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    print(json.dumps(counts), f"{meta['wall_seconds']:.0f} s")
    return 0


def _meta(argv: list[str] | None, mappings: list[str], timeout: float, start: float) -> dict[str, Any]:
    import torch
    import transformers

    return {
        "date": datetime.date.today().isoformat(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} core(s), shared",
        "command": "python " + " ".join([Path(__file__).name] + (argv if argv is not None else sys.argv[1:])),
        "wall_seconds": time.perf_counter() - start,
        "mappings": mappings,
        "timeout_s": timeout,
        "autooffload": str(Path(__import__("autooffload").__file__).parent),
    }


if __name__ == "__main__":
    sys.exit(main())
