"""Observe: everything autooffload knows about a model's checkpointing, read once, as one value.

Where the layers are and how each one's checkpoint is reached (:mod:`.targets`), which stacks are planned and
where each micro-batch enters them (:mod:`.stacks`), how wide each stack's layer input is, what the config says a
token costs (:mod:`.model`), the keep planner's seed and the devices: all of it is read when the controller
attaches, and again only when the model's checkpointing really changes (a trainer that turned checkpointing off
and on installs new functions). The decision and the apply side read this value; nothing walks the model per
micro-batch.
"""

from __future__ import annotations

import dataclasses

import torch

from ..decide.activations import LayerShape
from .model import dtype_bytes, hidden_size, layer_shape, layer_token_bytes, matrix_weights, model_devices, token_terms
from .paths import uncontrolled
from .stacks import Stack, entries, plan_stacks
from .targets import CheckpointTarget, Foreign, LayerSlot, checkpointed_modules, mark_planned, planned_layers

ENABLE_HINT = (
    "enable checkpointing first: TrainingArguments(activation_checkpointing=True) "
    "(gradient_checkpointing=True before transformers 5.23) or model.gradient_checkpointing_enable()"
)
CHECKPOINTING_OFF = (
    "checkpointing was turned off during training, so nothing is offloaded and autooffload reports level 0 until "
    "it is turned on again"
)


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """A model's checkpointing as autooffload plans it.

    ``targets``: every checkpointed module it controls, in module order; ``unknown``: those it cannot
    (:class:`~autooffload.observe.targets.Foreign`); ``layers``: the planned layers
    (:class:`~autooffload.observe.targets.LayerSlot`: a layer target, or one call of a container); ``stacks``: the
    planned stacks, and ``entries``: the modules a micro-batch is seen at, outermost first, each with the stacks its
    call runs. ``widths``: each stack's layer input per token relative to the model's hidden size (an encoder and a
    decoder of different widths), from the config. ``token_bytes``: a layer input's bytes per token from the config
    (a first guess: the first layer call says the truth); ``logits_token_bytes`` and ``work_token_bytes``: the
    logits' and one layer's recompute working set per token. ``layer_weights`` (per planned layer), ``weight_bytes``
    and ``layer_shape``: the keep planner's seed. ``warnings``: (key, message) for each path it cannot steer and
    each stack it cannot plan.
    """

    targets: tuple[CheckpointTarget, ...] = ()
    unknown: tuple[Foreign, ...] = ()
    stacks: tuple[Stack, ...] = ()
    layers: tuple[LayerSlot, ...] = ()
    entries: tuple[tuple[torch.nn.Module, tuple[Stack, ...]], ...] = ()
    widths: dict[str, float] = dataclasses.field(default_factory=dict)
    token_bytes: float | None = None
    logits_token_bytes: float | None = None
    work_token_bytes: float | None = None
    layer_weights: tuple[int, ...] = ()
    weight_bytes: int = 0
    layer_shape: LayerShape | None = None
    hidden: int | None = None
    devices: tuple[torch.device, ...] = ()
    warnings: tuple[tuple[str, str], ...] = ()

    @classmethod
    def read(cls, model: torch.nn.Module) -> ModelLayout:
        """Read ``model``; a model with nothing to control gives a layout without targets (and its warnings)."""
        found, unknown = checkpointed_modules(model)
        warnings = uncontrolled(model, unknown)
        if not found:
            return cls(unknown=tuple(unknown), warnings=tuple(warnings))
        stacks, warning = plan_stacks(model, found)
        if warning is not None:
            warnings.append(warning)
        mark_planned(found, stacks)
        layers = planned_layers(found)
        reference = hidden_size(model)
        logits, work = token_terms(model)
        return cls(
            targets=tuple(found),
            unknown=tuple(unknown),
            stacks=tuple(stacks),
            layers=tuple(layers),
            entries=tuple((entry, tuple(run)) for entry, run in entries(model, stacks)),
            widths={s.name: s.hidden / reference if s.hidden and reference else 1.0 for s in stacks},
            token_bytes=layer_token_bytes(model),
            logits_token_bytes=logits,
            work_token_bytes=work,
            layer_weights=tuple(matrix_weights(slot.target.module, slot.target.size) for slot in layers),
            weight_bytes=dtype_bytes(model) or 0,
            layer_shape=layer_shape(model),
            hidden=reference,
            devices=tuple(model_devices(model)),
            warnings=tuple(warnings),
        )

    @property
    def layer_stacks(self) -> tuple[str, ...]:
        """Each planned layer's stack, by name, in layer order."""
        return tuple(slot.target.stack for slot in self.layers)
