"""The sweep's tiny sizes and what applies them: the mappings swept, the batch and sequence sizes, the size every
config key gets (:func:`shrink`), the special token ids a config holds, and random text ids that avoid them
(:func:`token_sampler`). The bottom layer: imports nothing of the sweep's."""

from __future__ import annotations

import contextlib
from typing import Any

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
