"""What each form of a checkpoint function costs under torch.compile, side by side on one compiled model.

    python benchmarks/compile_forms.py --out DIR [--seq 256] [--rounds 12] [--backend inductor] [--quick]

The ladder's CPU model (``benchmarks/ladder.py``), compiled once; autooffload's switch installs one plan after
another on it and every form is timed interleaved (process CPU time of forward + backward, median over the rounds).
The forms, and which one autooffload installs under compile (``autooffload/apply/switch.py``):

- ``whole``: every layer recomputes with a function that counts nothing: one graph (installed);
- ``counted``: every layer recomputes with a function that counts its calls (a ``torch.compiler.disable`` call):
  a graph break per layer (the form before);
- ``offload-eager``: layer 0 offloads through a function whose frame runs eagerly and calls the compiled
  layer (installed);
- ``offload-traced``: the same function traced by dynamo up to its saved-tensor hooks, resumed after (before);
- ``whole-after-offload``: the ``whole`` plan again after an offloading micro-batch, without giving dynamo its
  frames back: it had given up on the frame holding the layers' loop (a graph break in a loop), so the layers
  run as graphs of their own (before);
- ``whole-resumed``: the same with :class:`~autooffload.apply.compile_guard.CompiledFrames` resumed, as the
  switch does after ``RESUME_AFTER`` plans in a row without eager-frame functions (installed);
- ``keep-all``: every layer keeps (no checkpointing), one graph; ``transformers``: transformers' own
  checkpointing compiled, the reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import results as written
from harness.environment import cpu_name, load, stamp
from harness.models import Shape, build_model, set_checkpointing
from harness.rounds import rotated
from harness.scenarios import SHAPES
from harness.verdicts import spread

from autooffload import OffloadController, Settings
from autooffload.apply import functions
from autooffload.apply.compile_guard import compiled_graphs

FORMS = (
    "transformers",
    "whole",
    "counted",
    "keep-all",
    "offload-eager",
    "offload-traced",
    "whole-after-offload",
    "whole-resumed",
)


class Forms:
    """One compiled model and the functions of every form, installed one at a time."""

    def __init__(self, shape: Shape, backend: str) -> None:
        self.shape = shape
        self.model = build_model(shape, "cpu")
        set_checkpointing(self.model, True)
        self.transformers = [layer._gradient_checkpointing_func for layer in self.model.model.layers]
        self.compiled = torch.compile(self.model, backend=backend)
        self.controller = OffloadController(Settings(mode="off"), probe=None)
        self.controller.attach(self.model, compiled=True)
        self.controller.before_forward = lambda *call: 0
        switch = self.controller.switch
        layers = switch.layers
        self.counted = [
            switch._tag(functions.plain_function(s.target.kwargs, switch.forward.counter(i)), s.target)
            for i, s in enumerate(layers)
        ]
        self.traced = switch._tag(
            functions.offload_function(layers[0].target.kwargs, switch.engine, False, switch.forward, 0, switch.stats),
            layers[0].target,
        )

    def install(self, form: str) -> None:
        switch, layers = self.controller.switch, self.model.model.layers
        if form == "transformers":
            switch.apply(0)
            for layer, function in zip(layers, self.transformers, strict=True):
                layer._gradient_checkpointing_func = function
        elif form in ("whole", "whole-resumed", "whole-after-offload"):
            switch.apply(0)
        elif form == "counted":
            switch.apply(0)
            for layer, function in zip(layers, self.counted, strict=True):
                layer._gradient_checkpointing_func = function
        elif form == "keep-all":
            switch.apply(0, len(layers))
        elif form == "offload-eager":
            switch.apply(1)
        elif form == "offload-traced":
            switch.apply(0)
            layers[0]._gradient_checkpointing_func = self.traced

    def step(self, form: str, seq: int, seed: int) -> tuple[float, float]:
        """(the first step after installing ``form``, the next one), in process CPU seconds. Every form starts from
        dynamo's frames as compiled (a switch from a whole-graph plan): the first step of a form with a graph break
        in the layers' loop pays dynamo's trace up to the break, once per such switch."""
        frames = self.controller.switch.frames
        frames.resume()  # every form starts from dynamo's frames as compiled: a switch from a whole-graph plan
        if form in ("whole-after-offload", "whole-resumed"):
            self.install("offload-eager")
            self._run(seq, seed)  # dynamo gives up on the frame holding the layers' loop
            resume = frames.resume
            frames.resume = lambda: None
            try:
                self.install(form)
            finally:
                frames.resume = resume
            if form == "whole-resumed":
                frames.resume()  # what the switch does after RESUME_AFTER plans without eager frames
        else:
            self.install(form)
        began = time.process_time()
        self._run(seq, seed)
        first = time.process_time() - began
        began = time.process_time()
        self._run(seq, seed + 1)
        return first, time.process_time() - began

    def _run(self, seq: int, seed: int) -> None:
        ids = torch.randint(0, self.shape.vocab, (1, seq), generator=torch.Generator().manual_seed(seed))
        self.compiled(input_ids=ids, labels=ids).loss.backward()
        self.model.zero_grad(set_to_none=True)
        self.controller.stats.next_step()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--quick", action="store_true", help="the ladder's tiny model, 2 rounds: checks the script")
    options = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64
    shape = SHAPES["quick" if options.quick else "cpu"]
    rounds = 2 if options.quick else options.rounds
    seq = shape.short if options.quick else options.seq
    forms = Forms(shape, options.backend)
    warm: dict[str, dict] = {}
    for form in FORMS:  # compile each form (twice through: a form after another may meet new guards)
        graphs, began = compiled_graphs(), time.perf_counter()
        forms.step(form, seq, 0)
        warm[form] = dict(graphs=compiled_graphs() - graphs, wall_s=time.perf_counter() - began)
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    firsts: dict[str, list[float]] = {form: [] for form in FORMS}
    graphs = compiled_graphs()
    for r in range(rounds):
        for form in rotated(FORMS, r):
            first, then = forms.step(form, seq, 100 + 2 * r)
            firsts[form].append(first)
            times[form].append(then)
    timed_graphs = compiled_graphs() - graphs
    medians = {form: statistics.median(t) for form, t in times.items()}
    rows = {
        form: dict(
            median_s=medians[form],
            spread=spread(times[form]),
            vs_whole=medians[form] / medians["whole"],
            vs_transformers=medians[form] / medians["transformers"],
            first_step_s=statistics.median(firsts[form]),
            warm_up=warm[form],
        )
        for form in FORMS
    }
    env = stamp(
        "compile_forms.py",
        argv,
        device=f"{cpu_name()}, no GPU",
        load=load(),
        shape=str(shape),
        seq=seq,
        rounds=rounds,
        backend=options.backend,
        graphs_compiled_in_timed_rounds=timed_graphs,
    )
    lines = [
        "# Checkpoint function forms under torch.compile: CPU",
        "",
        f"- {env['device']}; load {env['load']}; torch {env['torch']}, transformers {env['transformers']}",
        f"- command: `{env['command']}`; {seq} tokens; backend {options.backend}; {rounds} interleaved rounds",
        f"- graphs compiled in the timed rounds: {timed_graphs}",
        "",
        "| form | ms / step | spread | vs whole | vs transformers | first step after the switch, ms "
        "| warm-up: graphs, wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for form, row in rows.items():
        lines.append(
            f"| {form} | {row['median_s'] * 1e3:.1f} | {row['spread']:.0%} | {row['vs_whole']:.3f} "
            f"| {row['vs_transformers']:.3f} | {row['first_step_s'] * 1e3:.1f} "
            f"| {row['warm_up']['graphs']}, {row['warm_up']['wall_s']:.0f} |"
        )
    written.write(options.out, "forms", dict(env, forms=rows), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
