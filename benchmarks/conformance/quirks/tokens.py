"""Token ids a processor adds to the tokenizer, and where its prompt puts them: shared by the quirks' batches and
the sweep's tiny configs (:func:`..models.tiny_config`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from .. import tiny


def free_ids(config: Any, count: int = 1, *, below: int | None = None, taken: Iterable[int] = ()) -> list[int]:
    """The ``count`` highest ids under ``below`` (by default the text vocabulary's size,
    :func:`tiny.text_vocab`) that no special id of ``config`` (:func:`tiny.special_ids`, its
    sub-configs' too) and none of ``taken`` holds, highest first, never 0: where a processor's added tokens land
    (the end of the tokenizer's vocabulary). Fewer where the vocabulary has fewer such ids."""

    top = tiny.text_vocab(config) if below is None else below
    avoid = tiny.special_ids(config) | set(taken)
    return list(itertools.islice((i for i in range(top - 1, 0, -1) if i not in avoid), count))


def before_text(text: Any, head: list[int]) -> dict:
    """``{"input_ids", "labels"}``: ``head`` (one image's expanded placeholder: its tags and image tokens) before
    every row of the ``[batch, seq]`` ids ``text``, as a processor frames a prompt, and labels that score the text
    only (-100 under the head). The ids keep ``text``'s dtype."""
    import torch

    head = torch.tensor(head, dtype=text.dtype).expand(text.shape[0], -1)
    input_ids = torch.cat([head, text], dim=1)
    return {"input_ids": input_ids, "labels": torch.cat([torch.full_like(head, -100), text], dim=1)}
