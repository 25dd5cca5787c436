"""Which stacks of checkpointed layers autooffload plans, and where each micro-batch's lengths are read.

A decoder-only model plans its text stack: the layers that run on the token embeddings' output. An encoder-decoder
model (``config.is_encoder_decoder``: T5, BART, Whisper) plans two, the encoder's and the decoder's, each with
its own length (source and target) and its own bytes per token. A model whose language layers come in several
stacks under the module that embeds the tokens (HRM's ``L_module`` and ``H_module``, run in cycles) plans all of
them. A stack that runs on what the model computes from a raw input (a VLM's vision tower on ``pixel_values``, a
speech encoder on audio samples: :mod:`.sources`) is planned too, sized from that input. In a decoder-only model, a
stack beside the text stack that runs on what the model computes from its tokens (BLT's global transformer on
patches, its byte decoder and its entropy patcher) is planned too, read from the deciding call's tokens: what its
layers hold per token (their length relative to the tokens, their width) is learned from their first call
(:mod:`.sizes`); only where its entry's call carries the tokens it runs on (:func:`_carries_tokens`). A stack whose
length none of these gives keeps plain checkpointing, with a warning.

Each planned stack has an *entry*: the nearest module at or above the stack's owner whose ``forward`` takes the
tokens (``input_ids``, ``inputs_embeds`` or ``input_features``). The controller decides at the first entry a
micro-batch reaches (the attached model, an encoder-decoder's base model, or an entry called directly: TRL's
Liger-loss path calls ``model.model``), once per micro-batch for every stack that entry runs; what each stack's
length is, read from that call, is :mod:`~autooffload.observe.inputs`'.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from .sources import raw_source

TOKEN_PARAMETERS = ("input_ids", "inputs_embeds", "input_features")
DECODER_PARAMETERS = ("decoder_input_ids", "decoder_inputs_embeds", "labels")
DECODER_TOKENS = DECODER_PARAMETERS[:2]


@dataclasses.dataclass
class Stack:
    """A planned stack. ``name``: the ModuleList path (or a container's stack); ``role``: ``"text"``,
    ``"encoder"`` or ``"decoder"``; ``entry``: the module whose call carries this stack's tokens;
    ``hidden``: the hidden size of its layer input (None: unknown); ``convs``: (kernel, stride, padding,
    dilation) of each strided 1-D convolution the entry runs on ``input_features`` before the layers (Whisper's
    and Speech2Text's subsamplers), and ``features``: the feature size the first of them takes (which axis of
    ``input_features`` holds the frames: the last for Whisper, the middle one for Speech2Text). ``sources``: for a
    stack that runs on a raw input rather than tokens (:mod:`.sources`), the names that input may have in the
    deciding call (empty for a stack read from its tokens); its ``role`` is ``"encoder"`` or ``"tower"``."""

    name: str
    role: str
    entry: torch.nn.Module
    entry_name: str
    hidden: int | None = None
    convs: tuple[tuple[int, int, int, int], ...] = ()
    features: int | None = None
    sources: tuple[str, ...] = ()


def stack_sizes(targets: list[Any]) -> dict[str, int]:
    """Layers per stack, in module order, of the layer and container targets."""
    sizes: dict[str, int] = {}
    for target in targets:
        if target.kind in ("layer", "container"):
            sizes[target.stack] = sizes.get(target.stack, 0) + target.size
    return sizes


def plan_stacks(model: torch.nn.Module, targets: list[Any]) -> tuple[list[Stack], tuple[str, str] | None]:
    """The stacks to plan, in module order, and a warning (its key and text) where an encoder-decoder's stacks
    cannot be told apart (then the text rule alone picks, and the other stack keeps plain checkpointing) or a
    stack's length cannot be read (SpeechT5's speech encoder takes ``input_values``: nothing is planned; a stack
    under no module that takes the tokens or a raw input: that stack alone keeps plain checkpointing)."""
    sizes = stack_sizes(targets)
    if not sizes:
        return [], None
    names = {id(module): name for name, module in model.named_modules()}
    modules = dict(model.named_modules())
    owners = {t.stack: (t.name if t.kind == "container" else t.stack.rpartition(".")[0]) for t in targets}
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) is True:
        halves = [_part(model, "get_encoder", names), _part(model, "get_decoder", names)]
        encoder_stacks = [s for s in sizes if _under(s, halves[0])]
        decoder_stacks = [s for s in sizes if _under(s, halves[1]) and s not in encoder_stacks]  # Florence-2's
        # get_decoder() returns the language model that holds the encoder too
        planned: list[Stack] | None = [] if all(half is not None for half in halves) else None
        for role, found in (("encoder", encoder_stacks), ("decoder", decoder_stacks)):
            half = _half(model, modules, role, found, sizes, names, owners) if planned is not None else None
            planned = None if half is None else [*planned, *half]  # type: ignore[misc]
        if planned is not None:
            planned += _towers(modules, sizes, owners, planned)
            taken = {stack.name for stack in planned}
            return planned, _unplanned(model, [name for name in sizes if name not in taken])
        if all(half is not None for half in halves) and encoder_stacks and decoder_stacks:
            return [], (
                "stack-length",
                f"{type(model).__name__}'s encoder runs on an input whose length autooffload cannot read (its forward "
                f"takes none of {', '.join(TOKEN_PARAMETERS)}, nor a raw input it knows), so autooffload plans no "
                "layer of this model: every checkpointed layer keeps plain checkpointing",
            )
        found = (_text_stacks(model, list(sizes), sizes, names) or [])[-1:]
        others = [name for name in sizes if name not in found]
        warning = (
            f"{type(model).__name__} is an encoder-decoder model, but autooffload cannot tell its encoder's "
            f"checkpointed stack from its decoder's: only {found[0]} is planned, with the input_ids length; "
            f"{', '.join(others) or 'no other stack'} run(s) plain checkpointing"
        )
        return [_stack(model, modules, name, "text", owners[name]) for name in found], ("stacks-apart", warning)
    found = _text_stacks(model, list(sizes), sizes, names) or []
    text = [_stack(model, modules, name, "text", owners[name]) for name in found]
    planned = text + _towers(modules, sizes, owners, text)
    taken = {stack.name for stack in planned}
    beside = [_stack(model, modules, name, "text", owners[name]) for name in sizes if name not in taken]
    read = [stack for stack in beside if _carries_tokens(modules, stack, owners[stack.name], found)]
    names_read = {stack.name for stack in read}
    return planned + read, _unplanned(model, [stack.name for stack in beside if stack.name not in names_read])


def _carries_tokens(modules: dict[str, torch.nn.Module], stack: Stack, owner: str, text: list[str]) -> bool:
    """Does the call of a stack's entry carry the tokens the stack runs on? Its length is read from them and what it
    holds per token learned, so an entry whose tokens go elsewhere would size it from an unrelated length. Yes where
    the stack's own module takes them or the entry holds no text stack (BLT's global transformer, byte decoder and
    patcher take their own ``input_ids`` or ``inputs_embeds``), where a module between the stack and its entry
    takes the decoder's tokens (Diffusion-Gemma's decoder on ``decoder_input_ids``, under the model that takes
    them), or where every module between them runs on hidden states, what the entry computed from its tokens (each
    one's forward takes ``hidden_states`` first: CANINE's character encoders, before and after its deep encoder).
    No where the entry is a module the text stack runs under too and a module on the way takes something else (a
    custom VLM's vision tower on ``images=``, a name autooffload does not know): its tokens are the text's."""
    if not takes_tokens(stack.entry):
        return False
    if stack.entry_name == owner or not any(_under(name, stack.entry_name) for name in text):
        return True
    name, derived = owner, True
    while name != stack.entry_name and name in modules:
        parameters = _parameters(modules[name])
        if any(parameter in DECODER_TOKENS for parameter in parameters):
            return True
        derived = derived and parameters[:1] == ("hidden_states",)
        name = name.rpartition(".")[0]
    return derived


def _unplanned(model: torch.nn.Module, names: list[str]) -> tuple[str, str] | None:
    """The warning for checkpointed stacks left unplanned, which keep plain checkpointing (None if none is)."""
    if not names:
        return None
    return (
        "stack-length",
        f"autooffload cannot read the length of the input {type(model).__name__}'s checkpointed stack(s) "
        f"{', '.join(names)} run on (from {', '.join(TOKEN_PARAMETERS)} or a raw input it knows), so they keep plain "
        "checkpointing: what they save stays on the device",
    )


def _half(
    model: torch.nn.Module,
    modules: dict[str, torch.nn.Module],
    role: str,
    found: list[str],
    sizes: dict[str, int],
    names: dict[int, str],
    owners: dict[str, str],
) -> list[Stack] | None:
    """The planned stacks of an encoder-decoder's half: its one text stack where its length can be read from the
    tokens; else, for the encoder, every stack of it sized from the raw input it runs on (Moonshine's and
    SpeechT5's encoders, wav2vec2's feature extractor and transformer); None where neither works."""
    chosen = _text_stacks(model, found, sizes, names)
    if chosen is not None and len(chosen) == 1:
        stack = _stack(model, modules, chosen[0], role, owners[chosen[0]])
        if _readable(stack, model):
            return [stack]
    if role != "encoder" or not found:
        return None
    measured = [_measured(modules, name, role, owners[name]) for name in found]
    return None if None in measured else measured  # type: ignore[return-value]


def _towers(
    modules: dict[str, torch.nn.Module], sizes: dict[str, int], owners: dict[str, str], planned: list[Stack]
) -> list[Stack]:
    """The stacks not planned from tokens that run on a raw input (a VLM's vision tower, an audio tower)."""
    taken = {stack.name for stack in planned}
    towers = [_measured(modules, name, "tower", owners[name]) for name in sizes if name not in taken]
    return [tower for tower in towers if tower is not None]


def _measured(modules: dict[str, torch.nn.Module], name: str, role: str, owner: str) -> Stack | None:
    """A stack sized from the raw input its entry's call carries (:mod:`.sources`); None where none is found."""
    found = raw_source(modules, owner)
    if found is None:
        return None
    entry_name, sources = found
    config = getattr(modules[owner], "config", None) or getattr(modules[entry_name], "config", None)
    return Stack(name, role, modules[entry_name], entry_name, _hidden(config), sources=sources)


def _part(model: torch.nn.Module, getter: str, names: dict[int, str]) -> str | None:
    try:
        module = getattr(model, getter)()
    except Exception:  # no such method, or one that raises for this model
        return None
    return names.get(id(module)) if isinstance(module, torch.nn.Module) else None


def _under(stack: str, prefix: str | None) -> bool:
    return prefix is not None and (prefix == "" or stack == prefix or stack.startswith(prefix + "."))


def _text_stacks(
    model: torch.nn.Module, candidates: list[str], sizes: dict[str, int], names: dict[int, str]
) -> list[str] | None:
    """The stacks that run on the token embeddings' output: those whose path shares the most with the module
    that owns the input embedding, and of those the ones nearest to it (a stack nested deeper, such as an
    audio encoder inside the embedding path, is another model's). Several at that depth are all planned (HRM's
    two stacks); with no embedding to go by, the stack with the most layers."""
    if not candidates:
        return None
    embedding = _input_embedding_name(model, names)
    if embedding is None:
        return [max(candidates, key=lambda s: (sizes[s], candidates.index(s)))]
    owner = embedding.split(".")[:-1]

    def rank(stack: str) -> tuple[int, int]:
        path = stack.split(".")[:-1] if stack else []
        shared = 0
        for mine, theirs in zip(path, owner, strict=False):
            if mine != theirs:
                break
            shared += 1
        return shared, -(len(path) - shared)

    best = max(rank(s) for s in candidates)
    return [s for s in candidates if rank(s) == best]


def _input_embedding_name(model: torch.nn.Module, names: dict[int, str]) -> str | None:
    try:
        embedding = model.get_input_embeddings()
    except Exception:  # not a transformers model, or one that does not implement it
        return None
    return names.get(id(embedding))


def _stack(model: torch.nn.Module, modules: dict[str, torch.nn.Module], name: str, role: str, owner: str) -> Stack:
    entry_name = owner
    while entry_name and not takes_tokens(modules[entry_name]):
        entry_name = entry_name.rpartition(".")[0]
    entry = modules[entry_name]
    config = getattr(entry, "config", None) or getattr(model, "config", None)
    convs, features = _subsampling(entry, entry_name, name, modules)
    return Stack(name, role, entry, entry_name, _hidden(config), convs, features)


def _readable(stack: Stack, model: torch.nn.Module) -> bool:
    """Can :func:`.inputs.read_lengths` read this stack's length from a call of its entry or of the attached model?"""
    if takes_tokens(stack.entry):
        return True
    if stack.role == "decoder":  # the model's call gives the decoder's length (SpeechT5's entry is the model)
        return any(name in DECODER_PARAMETERS for name in _parameters(model))
    return stack.entry is not model and any(name in TOKEN_PARAMETERS for name in _parameters(model))


def takes_tokens(module: torch.nn.Module) -> bool:
    """Does this module's ``forward`` take the tokens by name?"""
    return any(name in TOKEN_PARAMETERS for name in _parameters(module))


def _parameters(module: torch.nn.Module) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return ()


def _hidden(config: Any) -> int | None:
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(hidden, int) and hasattr(config, "get_text_config"):
        try:
            hidden = getattr(config.get_text_config(), "hidden_size", None)
        except Exception:  # an ambiguous composite config
            return None
    return hidden if isinstance(hidden, int) and not isinstance(hidden, bool) else None


def _subsampling(
    entry: torch.nn.Module, entry_name: str, stack: str, modules: dict[str, torch.nn.Module]
) -> tuple[tuple[tuple[int, int, int, int], ...], int | None]:
    """(kernel, stride, padding, dilation) of each strided 1-D convolution the entry runs on ``input_features``
    before its layers, in module order, and the input channels of its first convolution (the feature size);
    ``((), None)`` for an entry that takes no features."""
    if "input_features" not in _parameters(entry):
        return (), None
    prefix = entry_name + "." if entry_name else ""
    convs, features = [], None
    for name, module in modules.items():
        if not isinstance(module, torch.nn.Conv1d) or not name.startswith(prefix) or name.startswith(stack + "."):
            continue
        features = int(module.in_channels) if features is None else features
        padding = module.padding if isinstance(module.padding, tuple) else (0,)  # "valid"; "same" has stride 1
        if int(module.stride[0]) > 1:
            convs.append((int(module.kernel_size[0]), int(module.stride[0]), int(padding[0]), int(module.dilation[0])))
    return tuple(convs), features


def entries(model: torch.nn.Module, stacks: list[Stack]) -> list[tuple[torch.nn.Module, list[Stack]]]:
    """The modules to decide at, outermost first, each with the planned stacks its call runs: the attached
    model, every module between it and a stack's entry that takes the tokens, and the entries themselves."""
    names = [name for name, _ in model.named_modules()]
    modules = dict(model.named_modules())
    chosen: dict[str, list[Stack]] = {"": list(stacks)}
    for stack in stacks:
        parts = stack.entry_name.split(".") if stack.entry_name else []
        for depth in range(1, len(parts) + 1):
            name = ".".join(parts[:depth])
            if name == stack.entry_name or takes_tokens(modules[name]):
                chosen.setdefault(name, []).append(stack)
    order = {name: index for index, name in enumerate(names)}
    return [(modules[name], chosen[name]) for name in sorted(chosen, key=order.__getitem__)]
