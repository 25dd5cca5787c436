"""What keeping layers adds to the saved set of a compiled step, against what compiled keep counts per layer.

Compiled ``recompute="auto"`` counts a layer's cost on the layer compiled by itself under a saved-tensor counter
(docs/compile.md). This compares, on the ladder's CPU model (4 layers, hidden 128, sdpa), the saved tensors of:
one layer eagerly; one layer compiled alone (one of the counts); the whole model compiled without checkpointing and with
every layer checkpointed (a counter around the compiled step sees the compiled graph's saved tensors). Counted by
autooffload's own counter (``SavedBytesCounter``): each storage once, parameters, buffers and the layer's own inputs
not at all.

Produced benchmarks/results/2026-12-06-compiled-saved-cpu/ (saved.json, saved.md):

    OMP_NUM_THREADS=1 python benchmarks/probes/compiled_saved_bytes.py --out DIR [--backend inductor]

A probe run once to answer one question (issue 39), not a benchmark the suite runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import harness.scenarios as ladder  # noqa: E402  (the ladder's scenarios, models and modes)

from autooffload.observe.saved import SavedBytesCounter, parameter_storages, storage_key, tensors_in  # noqa: E402

CASES = [(256, False), (1024, False), (1024, True)]  # (tokens, bf16 autocast)
MiB = 2**20


def measure(tokens: int, bf16: bool, backend: str) -> dict:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = ladder.build_model(ladder.SHAPES["cpu"], "cpu").train()
    params = parameter_storages([model])
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=bf16)
    ids = torch.randint(0, ladder.SHAPES["cpu"].vocab, (1, tokens))
    captured: list = []
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: captured.append((args, kwargs)) if not captured else None, with_kwargs=True
    )
    with torch.no_grad(), autocast:
        model(input_ids=ids)
    handle.remove()
    (args, kwargs), layer = captured[0], model.model.layers[1]
    args = (args[0].detach().requires_grad_(True), *args[1:])
    inputs = {storage_key(t) for t in tensors_in([*args, *kwargs.values()])}

    def one_layer(function) -> SavedBytesCounter:
        counter = SavedBytesCounter(params | inputs)
        with counter, autocast:
            output = function(*args, **kwargs)
        (output[0] if isinstance(output, tuple) else output).float().sum().backward()
        return counter

    def whole(checkpointing: bool) -> SavedBytesCounter:
        torch._dynamo.reset()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        compiled = torch.compile(model, backend=backend)
        for _ in range(2):  # the second step: compiled, warm
            counter = SavedBytesCounter(params)
            with counter, autocast:
                loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
        return counter

    eager = one_layer(layer)
    compiled_layer = torch.compile(layer, backend=backend)
    one_layer(compiled_layer)
    alone = one_layer(compiled_layer)
    kept, recomputed = whole(False), whole(True)
    layers = ladder.SHAPES["cpu"].layers
    return {
        "tokens": tokens,
        "autocast": "bf16" if bf16 else None,
        "eager_layer_mib": eager.bytes / MiB,
        "compiled_layer_alone_mib": alone.bytes / MiB,
        "alone_all_layers_mib": layers * alone.bytes / MiB,
        "whole_no_checkpointing_mib": kept.bytes / MiB,
        "whole_every_layer_checkpointed_mib": recomputed.bytes / MiB,
        "whole_kept_adds_mib": (kept.bytes - recomputed.bytes) / MiB,
        "whole_over_alone": (kept.bytes - recomputed.bytes) / (layers * alone.bytes),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", default="inductor")
    options = parser.parse_args()
    rows = [measure(tokens, bf16, options.backend) for tokens, bf16 in CASES]
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "saved.json").write_text(json.dumps({"backend": options.backend, "rows": rows}, indent=1))
    lines = [
        "| tokens | autocast | eager layer | compiled layer alone | x 4 layers | whole graph: keeping all adds "
        "| whole / (alone x 4) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['autocast'] or 'fp32'} | {r['eager_layer_mib']:.3f} MiB | "
            f"{r['compiled_layer_alone_mib']:.3f} MiB | {r['alone_all_layers_mib']:.3f} MiB | "
            f"{r['whole_kept_adds_mib']:.3f} MiB | {r['whole_over_alone']:.3f} |"
        )
    (options.out / "saved.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
