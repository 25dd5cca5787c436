"""Observe: a micro-batch's lengths, read from the call that enters the model before its forward.

A micro-batch is what one forward of the attached model (or of a stack's entry called directly) runs: each planned
stack's sequence length and tokens (batch x sequence). Token ids ``[batch, seq]`` and embeddings ``[batch, seq,
hidden]`` say it directly; speech features (``input_features``) say it after the entry's strided convolutions
(Whisper's and Speech2Text's subsamplers), on whichever axis holds the frames. An encoder-decoder's decoder length
comes from ``decoder_input_ids``, ``decoder_inputs_embeds`` or the ``labels`` they are built from.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from .sources import source_elements
from .stacks import DECODER_PARAMETERS, TOKEN_PARAMETERS, Stack

NO_TOKENS = (
    "{} was called without input_ids or inputs_embeds; the sequence-length trigger is off for such calls and only "
    "the memory reading decides"
)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the decision sees it: ``seq_len``, the longest of its stacks' lengths (the sequence
    trigger reads it); ``tokens``, its input tokens (an encoder-decoder's source and target together; stacks that
    read one input, such as HRM's, count it once); ``lengths``: (sequence length, tokens) per planned stack, by
    name (a stack not named runs no tokens). ``sources``: per stack sized from a raw input (:mod:`.sources`), the
    elements of that input in this call (a stack not named does not run); their lengths are estimated when the
    layers are sized (:meth:`.sizes.LayerSizes.size`)."""

    seq_len: int
    tokens: int
    lengths: dict[str, tuple[int, int]]
    sources: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls,
        seq_len: int,
        tokens: int,
        lengths: dict[str, tuple[int, int]] | None,
        stacks: list[Stack],
        sources: dict[str, int] | None = None,
    ) -> MicroBatch:
        """``lengths`` as given, or, without them, every one of ``stacks`` read from tokens running ``seq_len`` and
        ``tokens``."""
        read = [stack for stack in stacks if not stack.sources]
        given = dict(lengths) if lengths is not None else {stack.name: (seq_len, tokens) for stack in read}
        return cls(seq_len, tokens, given, dict(sources or {}))


def read_micro_batch(module: torch.nn.Module, stacks: list[Stack], args: tuple, kwargs: dict) -> MicroBatch | None:
    """The micro-batch a call of ``module`` (the attached model or an entry) runs through ``stacks``; None when the
    call carries no tokens it can read (no ``input_ids``, ``inputs_embeds`` or features) and no raw input a planned
    stack runs on."""
    read = [stack for stack in stacks if not stack.sources]
    measured = [stack for stack in stacks if stack.sources]
    lengths = read_lengths(module, read, args, kwargs) if read else {}
    sources: dict[str, int] = {}
    if measured:
        bound = _bind(module, args, kwargs)
        found = {stack.name: source_elements(bound, stack.sources) for stack in measured}
        sources = {name: elements for name, elements in found.items() if elements}
    if not lengths:
        shape = token_shape(args, kwargs)
        if shape is None:
            return MicroBatch(0, 0, {}, sources) if sources else None
        return MicroBatch(shape[0], shape[1], {stack.name: shape for stack in read}, sources)
    by_role = {stack.role: lengths[stack.name][1] for stack in read if stack.name in lengths}
    return MicroBatch(max(seq for seq, _ in lengths.values()), sum(by_role.values()), lengths, sources)


def token_shape(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(sequence length, tokens) of a model call, from ``input_ids`` or ``inputs_embeds``; None if neither."""
    ids = kwargs.get("input_ids")
    if ids is None and args and torch.is_tensor(args[0]) and not args[0].is_floating_point():
        ids = args[0]
    if torch.is_tensor(ids) and ids.dim() >= 1:
        return int(ids.shape[-1]), int(ids.numel())
    embeds = kwargs.get("inputs_embeds")
    if torch.is_tensor(embeds) and embeds.dim() >= 2:
        return int(embeds.shape[-2]), int(embeds.numel() // embeds.shape[-1])
    return None


def frames_after(length: int, convs: tuple[tuple[int, int, int, int], ...]) -> int:
    """A sequence's length after ``convs``, torch's Conv1d arithmetic: ``(L + 2p - d(k - 1) - 1) // s + 1``."""
    for kernel, stride, padding, dilation in convs:
        length = max((length + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1, 0)
    return length


def _shape(value: Any, stack: Stack | None = None) -> tuple[int, int] | None:
    """(sequence length, tokens) of a stack's input: ids ``[batch, seq]``, embeddings ``[batch, seq, hidden]``,
    or, with ``stack`` (``input_features``), speech features whose frame axis is the one that is not the feature
    size, subsampled by the stack's convolutions."""
    if not torch.is_tensor(value) or value.dim() < 1:
        return None
    if stack is not None:
        if value.dim() < 2:
            return None
        axis = -2 if value.dim() >= 3 and value.shape[-1] == stack.features != value.shape[-2] else -1
        seq = frames_after(int(value.shape[axis]), stack.convs)
        return seq, seq * int(value.numel() // (value.shape[-1] * value.shape[-2]))  # x the batch
    if value.is_floating_point():  # embeddings: [batch, seq, hidden]
        if value.dim() < 2:
            return None
        return int(value.shape[-2]), int(value.numel() // value.shape[-1])
    return int(value.shape[-1]), int(value.numel())


def read_lengths(module: torch.nn.Module, stacks: list[Stack], args: tuple, kwargs: dict) -> dict[str, tuple[int, int]]:
    """(sequence length, tokens) of each stack this call runs, from its inputs: a stack's own entry reads its
    ``input_ids``, ``inputs_embeds`` or ``input_features``; a module above an encoder-decoder's entries reads
    the encoder's from those and the decoder's from ``decoder_input_ids``, ``decoder_inputs_embeds`` or the
    ``labels`` they are built from. A stack whose length the call does not give is left out."""
    bound = _bind(module, args, kwargs)
    found: dict[str, tuple[int, int]] = {}
    for stack in stacks:
        if stack.role != "decoder":
            keys = TOKEN_PARAMETERS
        else:  # at its own entry, its tokens; above it (or where its entry is the model: SpeechT5's), the decoder's
            keys = TOKEN_PARAMETERS if stack.entry is module and stack.entry_name else DECODER_PARAMETERS
        for key in keys:
            shape = _shape(bound.get(key), stack if key == "input_features" else None)
            if shape is not None:
                found[stack.name] = shape
                break
    return found


def _bind(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    if not args:
        return kwargs
    try:
        return dict(inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        first = args[0]
        bound = dict(kwargs)
        if torch.is_tensor(first) and "input_ids" not in bound:
            bound["input_features" if first.is_floating_point() and first.dim() == 3 else "input_ids"] = first
        return bound
