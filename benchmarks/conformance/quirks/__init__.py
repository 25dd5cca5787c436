"""What one model type needs that the sweep's generic tiny config and batch cannot guess.

The conformance sweep (``benchmarks/conformance/``) builds every model type from its default config shrunk by
name (:func:`tiny.shrink`) and a batch of the kind its mapping trains on. Some types need more: a size
that must divide another, a sub-config the defaults leave empty, an input their forward requires (a bounding
box, a robot state, the Q-Former's own tokens). transformers' own tests answer the same need with one
hand-written tester per model; here each type's needs are one registered function, named for what the model
requires, in the module of its modality (:mod:`quirks.text`, :mod:`quirks.vision`, :mod:`quirks.speech`).
A fix only fills in what a user's real config or processor would have given the model; it never changes what
autooffload sees of a model that runs without it.
"""

from __future__ import annotations

from . import speech, text, vision, vision_batches, vision_inputs, vision_patches  # noqa: F401  (each registers its types)
from .registry import (
    base_config,
    base_kwargs,
    batch_fix,
    checkpointing_fix,
    config_fix,
    enable_checkpointing,
    fix_batch,
    fix_config,
    registered,
)

__all__ = [
    "base_config",
    "base_kwargs",
    "batch_fix",
    "checkpointing_fix",
    "config_fix",
    "enable_checkpointing",
    "fix_batch",
    "fix_config",
    "registered",
]
