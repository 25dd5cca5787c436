"""Observe: what each planned layer's saved input weighs, planned before a forward and learned from it.

The arithmetic is tokens x width x bytes per token: a stack's tokens in the micro-batch (its own length: an
encoder's source, a decoder's target), its width relative to the model's hidden size (an encoder and a decoder
of different widths), and ``token_bytes``, a layer input's bytes per token (hidden size x dtype bytes, x the
residual streams of a hyper-connection model). The config gives first guesses; the run corrects them:

- each planned layer's first call in a micro-batch reports its input's real bytes (a source padded to a block
  size, ProphetNet's n-gram streams, a speech pre-net's frames): before anything moved, the first stack's report
  sets ``token_bytes`` (without a guess from the config, the first report of any stack: BLT's patcher runs
  before its first stack; what it showed keeps its bytes when the first stack sets the unit anew); after, a report
  sets its stack's width;
- at a step's end, where no layer call reported, ``token_bytes`` is measured from the bytes the engine moved;
- a layer whose call passes no tensor positionally (its hidden states go as a keyword) frees nothing;
- a stack sized from a raw input (:mod:`.sources`: a speech encoder on audio samples, a vision tower on pixels) has
  no tokens before its forward: each of its layers' first call sets that layer's bytes per element of the input,
  and the stack's first layer its length per element, so the next micro-batch is sized from its input's elements.

A layer that runs several times in one forward (HRM's cycles) holds one input per call: its bytes are its calls
in the last forward that ran it x one call's. Plain numbers only: the apply side reports, this module counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .inputs import MicroBatch
from .layout import ModelLayout


@dataclasses.dataclass(frozen=True)
class Sized:
    """A micro-batch's planned layers, sized: ``order``, the positions in the order they offload (those that free
    the most first, module order among equals); ``layer_bytes``, each one's saved inputs (all its calls) in that
    order, and their mean ``bytes_per_layer`` (both None before any bytes per token are known); ``per_call``: per
    layer in module order, one call's tokens in units of ``token_bytes``, a layer input's bytes per token."""

    order: tuple[int, ...]
    layer_bytes: tuple[int, ...] | None
    bytes_per_layer: int | None
    per_call: list[float]
    token_bytes: float | None
    batch: MicroBatch | None = None  # the micro-batch, with the lengths of the stacks sized from a raw input


class LayerSizes:
    """The planned layers' saved-input sizes (see the module docstring): per micro-batch, per step, per run."""

    def __init__(self) -> None:
        self.token_bytes: float | None = None  # a layer input's bytes per token: the config's, then measured
        self.widths: dict[str, float] = {}  # each stack's layer input per token, relative to token_bytes
        self.layer_widths: dict[int, float] = {}  # the same per layer, where its first call showed it
        self.config_widths: dict[str, float] = {}  # the same from the config: what a new run starts with
        self.guess: float | None = None  # token_bytes from the config of the attached model (None: detached)
        self.layer_stacks: tuple[str, ...] = ()
        self.measured: dict[str, str] = {}  # stacks sized from a raw input: name -> role
        self.first_layer: dict[str, int] = {}  # each stack's first planned layer
        self.source_bytes: dict[int, float] = {}  # per layer of such a stack: its input's bytes per source element
        self.source_shape: dict[str, tuple[float, float]] = {}  # per such stack: (seq, tokens) per source element
        self.inputless: set[int] = set()  # layers whose calls pass no tensor positionally: nothing moves
        self.batch: MicroBatch | None = None  # the running micro-batch
        # Per planned layer (module order), what the running micro-batch's decision sized its saved inputs at, all
        # its calls, before the forward ran them (None before any bytes per token are known).
        self.planned_layer_bytes: tuple[int, ...] | None = None
        self.bytes_per_layer: int | None = None
        # The running micro-batch's offloaded layers, and per layer one call's tokens (a first call corrects them).
        self.running: tuple[frozenset[int], list[float]] | None = None
        # The layers whose first call in the running micro-batch reported, and the stacks whose width a report set.
        self.called: set[int] = set()
        self.widened: set[str] = set()
        self.step_layer_tokens = 0.0  # the step's offloaded layer-tokens, as their calls counted them
        self.reported = False  # an offloaded layer's call said its input's bytes in this step

    def attach(self, layout: ModelLayout) -> None:
        """Follow the planned layers of ``layout`` (at attach, and when a trainer reinstalls checkpointing); widths
        learned or restored for stacks that are still planned stay."""
        self.inputless = set()
        self.guess = layout.token_bytes if layout.targets else self.guess
        self.token_bytes = self.token_bytes or self.guess
        self.layer_stacks = stacks = layout.layer_stacks
        self.measured = {stack.name: stack.role for stack in layout.stacks if stack.sources}
        self.config_widths = dict(layout.widths)
        learned = {name: width for name, width in self.widths.items() if name in self.config_widths}
        self.widths = {**self.config_widths, **learned}

        def kept(position: int, measured: bool) -> bool:
            return position < len(stacks) and (stacks[position] in self.measured) == measured

        self.source_bytes = {p: ratio for p, ratio in self.source_bytes.items() if kept(p, True)}
        self.layer_widths = {p: width for p, width in self.layer_widths.items() if kept(p, False)}
        self.source_shape = {name: shape for name, shape in self.source_shape.items() if name in self.measured}
        self.first_layer = {}
        for position, stack in enumerate(stacks):
            self.first_layer.setdefault(stack, position)
        self.running = None

    def detach(self) -> None:
        """No model: a new run starts without a guess of the bytes per token."""
        self.guess, self.running = None, None

    def reset(self) -> None:
        """A new run: the config's guesses, nothing running, nothing counted."""
        self.token_bytes = self.guess
        self.widths = dict(self.config_widths)
        self.source_bytes, self.source_shape, self.layer_widths = {}, {}, {}
        self.batch, self.planned_layer_bytes, self.bytes_per_layer, self.running = None, None, None, None
        self.step_layer_tokens, self.reported = 0.0, False

    def size(self, batch: MicroBatch, calls: list[int]) -> Sized:
        """Size the planned layers for ``batch``; ``calls``: each layer's calls in the last forward that ran it."""
        batch = self._complete(batch)
        self.batch = batch
        unit = self.token_bytes
        per_call = [self._per_call(position, stack, batch, unit) for position, stack in enumerate(self.layer_stacks)]
        layer_tokens = [count * tokens for count, tokens in zip(calls, per_call, strict=True)]
        order = tuple(sorted(range(len(layer_tokens)), key=lambda i: -layer_tokens[i]))
        self.planned_layer_bytes = tuple(round(t * unit) for t in layer_tokens) if unit else None
        planned = self.planned_layer_bytes
        layer_bytes = tuple(planned[i] for i in order) if planned is not None else None
        self.bytes_per_layer = round(sum(layer_bytes) / len(layer_bytes)) if layer_bytes else None
        return Sized(order, layer_bytes, self.bytes_per_layer, per_call, unit, batch)

    def _per_call(self, position: int, stack: str, batch: MicroBatch, unit: float | None) -> float:
        """One call's input of layer ``position``, in units of ``unit`` (the bytes per token)."""
        if position in self.inputless:
            return 0.0
        if stack in self.measured:
            learned = self.source_bytes.get(position)
            return learned * batch.sources.get(stack, 0) / unit if learned is not None and unit else 0.0
        width = self.layer_widths.get(position, self.widths.get(stack, 1.0))
        return batch.lengths.get(stack, (0, 0))[1] * width

    def _complete(self, batch: MicroBatch) -> MicroBatch:
        """``batch`` with the lengths of the stacks sized from a raw input, from its elements and what their first
        layer showed per element (0 before it ran); the longest length and the tokens count them (per role)."""
        if not self.measured:
            return batch
        lengths = dict(batch.lengths)
        added: dict[str, int] = {}
        for stack, role in self.measured.items():
            per_element = self.source_shape.get(stack)
            elements = batch.sources.get(stack, 0)
            if per_element is None or not elements:
                continue
            seq, tokens = round(per_element[0] * elements), round(per_element[1] * elements)
            lengths[stack] = (seq, tokens)
            added[role] = max(added.get(role, 0), tokens)
        seq_len = max([batch.seq_len, *(seq for seq, _ in lengths.values())])
        return MicroBatch(seq_len, batch.tokens + sum(added.values()), lengths, dict(batch.sources))

    def start(self, offloaded: frozenset[int], sized: Sized) -> None:
        """The micro-batch runs with the layers at ``offloaded`` on offload."""
        self.running = (offloaded, list(sized.per_call))
        self.called, self.widened = set(), set()

    def first_call(self, position: int, nbytes: int, moved_any: bool, shape: tuple[int, int] | None = None) -> None:
        """Layer ``position``'s first call in the micro-batch saves an input of ``nbytes`` (0: none it can move), of
        ``shape`` (its sequence length and tokens). ``moved_any``: bytes were moved before in this run (else
        ``token_bytes`` is still the config's guess). A second report in the micro-batch (a tensor the layer deferred
        turned out its own when the forward ended) sets that layer's width only: the unit and its stack's stay."""
        if nbytes == 0:
            self.inputless.add(position)
        else:
            self.inputless.discard(position)
        stack = self.layer_stacks[position]
        again, self.called = position in self.called, self.called | {position}
        if stack in self.measured:
            self._learn_source(position, stack, nbytes, shape)
        else:
            tokens = self.batch.lengths.get(stack, (0, 0))[1] if self.batch is not None else 0
            if again and tokens > 0 and self.token_bytes:  # more of the layer's own, known at the forward's end
                self.layer_widths[position] = nbytes / (tokens * self.token_bytes)
            elif tokens > 0 and nbytes > 0:
                first = next((s for s in self.layer_stacks if s not in self.measured), None)
                first_report = not moved_any and stack == first and position == self.first_layer.get(stack)
                if first_report or not self.token_bytes:  # without a guess, the first report of any stack
                    self._set_unit(nbytes / (tokens * self.widths.get(stack, 1.0)))
                else:
                    self.widths[stack] = nbytes / (tokens * self.token_bytes)
                    self.widened.add(stack)
                if self.token_bytes:  # a layer may hold more than its stack's width (a second activation)
                    self.layer_widths[position] = nbytes / (tokens * self.token_bytes)
        if self.running is not None and self.token_bytes:
            self.running[1][position] = nbytes / self.token_bytes
            self.reported |= position in self.running[0]

    def _set_unit(self, token_bytes: float) -> None:
        """The first stack's report sets ``token_bytes`` anew: what this micro-batch's earlier reports measured in the
        old unit (the config's guess, or, without one, the first reporting stack's) keeps its bytes. BLT's patcher
        reports before the byte encoder: it was sized at twice its input at the next decision. The config's widths,
        the decision's estimates and what earlier micro-batches measured against the first stack stay."""
        old, self.token_bytes = self.token_bytes, token_bytes
        if not old or old == token_bytes:
            return
        scale = old / token_bytes
        self.widths.update({stack: self.widths[stack] * scale for stack in self.widened})
        self.layer_widths.update({p: self.layer_widths[p] * scale for p in self.called if p in self.layer_widths})
        if self.running is not None:
            for position in self.called:
                self.running[1][position] *= scale

    def _learn_source(self, position: int, stack: str, nbytes: int, shape: tuple[int, int] | None) -> None:
        elements = self.batch.sources.get(stack, 0) if self.batch is not None else 0
        if not elements or not nbytes:
            return
        self.source_bytes[position] = nbytes / elements
        if shape is not None and position == self.first_layer.get(stack):
            self.source_shape[stack] = (shape[0] / elements, shape[1] / elements)

    def planned_bytes(self, counts: list[int]) -> float | None:
        """What the running micro-batch's offloaded layers move by the arithmetic, for their ``counts`` of calls so
        far; None before any bytes per token are known."""
        if self.running is None or not self.token_bytes:
            return None
        offloaded, per_call = self.running
        return self.token_bytes * sum(counts[p] * per_call[p] for p in offloaded if p < len(counts))

    def close_micro_batch(self, counts: list[int]) -> None:
        """The running micro-batch is over, its layers called ``counts`` times: add its offloaded layer-tokens."""
        if self.running is None:
            return
        offloaded, per_call = self.running
        self.running = None
        self.step_layer_tokens += sum(counts[p] * per_call[p] for p in offloaded if p < len(counts))

    def end_step(self, moved: int, measure: bool) -> None:
        """Close a step that moved ``moved`` bytes. Where its layer calls said their bytes, ``token_bytes`` is not
        measured again: that would only fold in what the engine did not move (the stream engine's last layer, an
        input already moved), step after step, towards 0. ``measure``: False for a rescued step."""
        if moved and self.step_layer_tokens and measure and not self.reported:
            self.token_bytes = moved / self.step_layer_tokens
        self.step_layer_tokens, self.reported = 0.0, False

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"layer_token_bytes": self.token_bytes, "stack_width": dict(self.widths)}
        if self.layer_widths:
            state["layer_width"] = {str(position): width for position, width in self.layer_widths.items()}
        if self.source_bytes:
            state["source_bytes"] = {str(position): ratio for position, ratio in self.source_bytes.items()}
            state["source_shape"] = {name: list(shape) for name, shape in self.source_shape.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.token_bytes = state.get("layer_token_bytes") or self.token_bytes
        widths = state.get("stack_width")
        if isinstance(widths, dict):  # before attach every name; after, those of the planned stacks
            known = self.config_widths or widths
            self.widths.update({str(name): float(width) for name, width in widths.items() if name in known})
        layer_widths = state.get("layer_width")
        if isinstance(layer_widths, dict):
            self.layer_widths = {int(position): float(width) for position, width in layer_widths.items()}
        learned, shapes = state.get("source_bytes"), state.get("source_shape")
        if isinstance(learned, dict) and isinstance(shapes, dict):
            self.source_bytes = {int(position): float(ratio) for position, ratio in learned.items()}
            self.source_shape = {str(name): (float(seq), float(tokens)) for name, (seq, tokens) in shapes.items()}
