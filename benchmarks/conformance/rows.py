"""One row of the sweep: build one model type, run plain, on and partial, and judge it (:func:`check_type`), with
an image or audio batch where the model takes one (:mod:`.media_batches`) and transformers' own test
(:mod:`.upstream`) where ``UPSTREAM["run"]``. Runs in the child process."""

from __future__ import annotations

import copy
import time
import traceback
from typing import Any

from .models import build, make_batch
from .steps import StepResult, _same, _subset_sums, train_step
from .tiny import BATCH, SEQ, token_sampler


def _with_media(model: Any, config: Any, batch: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """An image batch for a model that takes ``pixel_values``, an audio batch for an audio language model that
    takes ``input_features`` (:mod:`media_batches`), where one builds and takes a plain checkpointed step; else
    ``batch`` (text only), with the reason in the row."""
    import inspect

    from . import media_batches

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
    from . import quirks

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
        # A container whose layers ran without any checkpoint call: nothing of theirs was held to move (``measured``
        # counts every call of torch's checkpoint, a direct one too), and the warning says so, truly.
        silent = [w for w in warned if "#container-silent" in w]
        if silent and not problems:
            row["note"] = " | ".join(silent)
        if len(warned) > len(silent) and not problems:
            problems.append(f"warned while moving everything: {' | '.join(warned)}")
    if "verdict" not in row:
        row.update(verdict="wrong", reason="; ".join(problems)) if problems else row.update(verdict="correct")
    if UPSTREAM["run"]:
        from . import upstream

        row["upstream"] = upstream.run_upstream(type(model), model.config, batch, UPSTREAM["sdist"])
    return _finish(row, start)


def _finish(row: dict[str, Any], start: float) -> dict[str, Any]:
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row
