"""The tiny random models the benchmarks measure on, and what a mode does to one: checkpointing on or off (under the
name each transformers release has for it), and the probe that reads the step's measured peak.

The models are Qwen3-shaped (or a hybrid Jamba stack), random weights from seed 0, a small vocabulary on purpose: a
real 152k-token head makes the logits, not the layers, the largest tensor, and that is a separate problem."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch

from autooffload import MemoryReading

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    head_dim: int
    vocab: int
    dtype: str
    short: int
    long: int
    # The micro-batch size of a scenario that must offload: enough tokens that the step's real peak comes at the
    # start of the backward, with every layer's input alive, where offload lowers it. With fewer, the peak is at the
    # end of the backward (every gradient and the first layer's backward), which no offload lowers.
    offload_batch: int = 1


def build_model(shape: Shape, device: str, kind: str = "qwen3") -> torch.nn.Module:
    """A Qwen3 (``kind="jamba"``: :func:`build_jamba`) of ``shape``: kv heads half the heads, intermediate 3 x hidden,
    sdpa attention, positions up to ``shape.long``."""
    if kind == "jamba":
        return build_jamba(shape, device)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=3 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads // 2,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.long,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return _instantiate(Qwen3ForCausalLM, config, shape, device)


def build_jamba(shape: Shape, device: str) -> torch.nn.Module:
    """A hybrid stack: state-space (Mamba) layers at even positions, attention layers with two experts at odd."""
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=3 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads // 2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=8,
        mamba_expand=2,
        use_mamba_kernels=False,
        max_position_embeddings=shape.long,
        use_cache=False,
    )
    return _instantiate(JambaForCausalLM, config, shape, device)


def _instantiate(model_class: type, config: Any, shape: Shape, device: str) -> torch.nn.Module:
    """Random weights from seed 0, built on ``device``, in the shape's dtype, in training mode."""
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config)
    return model.to(DTYPES[shape.dtype]).train()


def qwen3(
    layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
    dtype: torch.dtype, device: torch.device | str, seed: int = 0,
) -> torch.nn.Module:  # fmt: skip
    """A Qwen3 of any proportions (the GPU check's engines, seed and memory model; tied embeddings), initialised in
    ``dtype`` on ``device`` (seconds, not minutes, at 1.7B parameters), checkpointing on, in training mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        use_cache=False,
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    except Exception:  # a transformers release that will not build under a device context
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.to(device=device, dtype=dtype)
    set_checkpointing(model, True)
    return model.train()


def step_ids(step: int, batch: int, seq: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Step ``step``'s ``batch`` x ``seq`` token ids, drawn on ``device`` (the GPU check's)."""
    generator = torch.Generator(device=device).manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, seq), generator=generator, device=device)


def token_ids(vocab: int, seq: int, seed: int, device: str, batch: int = 1) -> torch.Tensor:
    """``batch`` x ``seq`` random token ids from ``seed``, the same on every device."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=generator).to(device)


# ---- checkpointing on and off ----------------------------------------------------------------------------


def enable_method(model: torch.nn.Module) -> Callable[..., Any]:
    """``activation_checkpointing_enable`` from transformers 5.23, ``gradient_checkpointing_enable`` before (and a
    deprecated alias after)."""
    return getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable


def has_native_offload(model: torch.nn.Module) -> bool:
    """transformers' ``offload=True`` (5.17 and later)."""
    return "offload" in inspect.signature(enable_method(model)).parameters


def set_checkpointing(model: torch.nn.Module, on: bool, kwargs: dict[str, Any] | None = None, **options: Any) -> None:
    """transformers' checkpointing on (torch's non-reentrant checkpoint, or ``kwargs``; ``options``:
    ``every_n_layers``, ``offload``) or off; each call replaces every layer's checkpoint function."""
    kwargs = kwargs or {"use_reentrant": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not on:
            disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
            disable()
        elif getattr(model, "activation_checkpointing_enable", None) is not None:
            model.activation_checkpointing_enable(kwargs, **options)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **options)


def enable_checkpointing(model: torch.nn.Module, native_offload: bool = False) -> None:
    """(Re-)enable checkpointing for a mode installed before each of its steps. transformers 5.x registers an
    input-embedding hook on every enable: the previous one is dropped first, so that hooks do not pile up."""
    if getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None) is not None:
        model.disable_input_require_grads()
    set_checkpointing(model, True, **({"offload": True} if native_offload else {}))


# ---- the device a scenario runs on ------------------------------------------------------------------------


class StepProbe:
    """A device of ``total`` bytes whose reading is the last step's measured peak (``last``), at most the device's
    size: a step that needs more reads as the device full, as a real device (and autooffload's probes) would; a
    reading above the size is no reading to the controller (dropped as garbage). The step's own row keeps what it
    needed. ``separate_host``: offloaded inputs leave torch's CPU allocator for host buffers, as they would leave a
    GPU."""

    def __init__(self, total: int = 1, separate_host: bool = True) -> None:
        self.total, self.separate_host = total, separate_host
        self.last: int | None = None

    def read(self) -> MemoryReading | None:
        return None if self.last is None else MemoryReading(min(self.last, self.total), self.total)
