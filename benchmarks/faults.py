"""The fault matrix: a failure at every guarded entry point and every place inside a step, in every window of a
training step, and the other faults a training job meets.

    python benchmarks/faults.py --out DIR              # the whole matrix (about an hour on two CPU cores)
    python benchmarks/faults.py --out DIR --quick      # a slice of it (what tests/test_faults.py runs)

Each cell trains a tiny random model through the real Trainer (4 layers, hidden 64, gradient accumulation 2,
6 optimizer steps of mixed lengths, an evaluation and a checkpoint save every 3 steps) with
``autooffload.attach(trainer)``, mode ``auto`` and a :class:`~autooffload.SimulatedDevice` small enough that the
long micro-batches offload and (``recompute="auto"``) the short ones keep; then injects one fault. Axes:

- **topology**: one process; two ranks under DDP over gloo (``torchrun``); two ranks under DeepSpeed ZeRO-3
  through Trainer (the entry points it reaches: no rescue there);
- **model**: a Qwen3; a T5 (encoder-decoder); a Qwen3 whose loss comes from ``model.model(...)`` (TRL's fused
  loss: the top model's forward never runs, or runs without tokens through a wrapper, the call redirected);
- **engine** ``sync``/``stream``, **policy** ``predictive``/``hysteresis``, **recompute** ``always``/``auto``
  (every combination on one process, for the Qwen3);
- **faults**: an exception at every guarded entry point (``autooffload.guard.ENTRY_POINTS``) and every place of
  autooffload's code inside a step (``autooffload.guard.IN_STEP``), enumerated from the registries (a new one is
  covered without editing this file), once in each **window** of the run the fault-free run called it in
  (:class:`Moment`: the run's first micro-batch, a non-last and the last micro-batch of an accumulation, each's
  forward and backward, an evaluation, outside a micro-batch), raised before the entry's body (and after it: after
  the pre-forward hook's body is after the agreement), on rank 1, rank 0 or both (:func:`plans` says which
  configuration gets which); a probe that raises an NVML error, or that returns ``None``, a fraction above 1 or
  NaN, or whose ``reset()`` raises; host buffers that cannot be allocated or pinned, and host memory running out
  mid-step; a process killed with SIGKILL between two steps, then resumed from the last Trainer checkpoint. An
  entry point reached only in a resumed run (a load) runs resumed from the fault-free run's checkpoint; one reached
  only by an out-of-memory step (the rescue) runs with one injected.

Per cell: **survived** (every rank finished every step, no hang, no crash), **identical** (per micro-batch losses
and final parameters bit-identical, fp32 on the CPU, to the same configuration's fault-free run, itself equal to
plain checkpointing), **warned** (the failing rank warned once, naming the entry point or place and the cause; the
other rank once, naming the rank that gave up), **detached** (no hook, owner or host buffer of autooffload left on
the model, its checkpoint functions plain), **same collectives** (the ranks made the same sequence of Python-level
collectives, and autooffload no more than without the fault), **raised** (the fault struck once, in the window
planned), and for the kill, **resumed exactly** (the resumed run's losses and parameters those of the
uninterrupted run). It writes ``faults.json`` (every cell) and ``faults.md`` (the tables) under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not an installed autooffload

import torch  # noqa: E402

from autooffload.fallback import AT_END  # noqa: E402

LAYERS, HIDDEN, VOCAB = 4, 64, 256
STEPS, ACCUMULATION, SAVE_EVERY = 6, 2, 3
LENGTHS = (32, 256, 48, 224, 32, 192, 40, 256, 32, 96, 224, 32)  # per micro-batch, one optimizer step = 2
DEVICE_BYTES = "2.4MiB"  # the simulated device: long micro-batches offload, short ones keep (recompute="auto")
THRESHOLDS = dict(seq_high=200, seq_low=100, min_steps=1)  # the hysteresis policy's, on these lengths
TIMEOUT = datetime.timedelta(seconds=60)  # the process group's: a rank left waiting fails instead of hanging
BATCH_TIMEOUT_S = 1800
TOPOLOGIES = ("one", "ddp", "zero3")
ENGINES, POLICIES, RECOMPUTES = ("sync", "stream"), ("predictive", "hysteresis"), ("always", "auto")
PROBE_FAULTS = ("nvml-error", "none", "above-1", "nan", "reset-raises")
HOST_FAULTS = ("allocate-fails", "pin-fails", "host-runs-out")
# The names of autooffload's checkpoint functions other than plain checkpointing's.
ACTIVE_FUNCTIONS = ("checkpoint_offload", "checkpoint_keep", "checkpoint_keep_measured", "checkpoint_plain_measured")


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration: ``model`` "qwen3", "t5" (an encoder-decoder: the model and both stacks are entries) or
    "inner" (a Qwen3 whose loss is computed from ``model.model(...)``, as TRL's fused-loss paths do: the top model's
    forward never runs on one process, and runs without tokens through DDP or DeepSpeed, the call redirected)."""

    topology: str = "one"
    engine: str = "sync"
    policy: str = "predictive"
    recompute: str = "always"
    model: str = "qwen3"

    @property
    def name(self) -> str:
        return f"{self.topology}/{self.model}/{self.engine}/{self.policy}/{self.recompute}"


@dataclasses.dataclass(frozen=True)
class Fault:
    """``kind``: "none", "entry" (a guarded entry point), "step" (a place of autooffload's inside a step,
    ``autooffload.guard.IN_STEP``), "probe", "host" or "kill"; ``name``: the entry point, the place or the fault's
    name; ``timing``: "before" or "after" the entry's body; ``at``: which call of it fails, in ``window`` (the
    moment of the run that call was in, :class:`Moment`); ``run``: "fresh", "resumed" (from the fault-free run's
    checkpoint) or "rescued" (an out-of-memory step injected)."""

    kind: str = "none"
    name: str = ""
    timing: str = "before"
    at: int = 1
    run: str = "fresh"
    ranks: str = "last"  # which ranks fail: "last" (rank 1 of 2, or the only one), "first" (rank 0) or "all"
    window: str = ""

    @property
    def label(self) -> str:
        parts = (["after its body"] if self.timing == "after" else []) + {
            "last": [], "first": ["rank 0"], "all": ["every rank"]
        }[self.ranks]  # fmt: skip
        detail = f" ({', '.join(parts)})" if parts else ""
        return self.kind if self.kind in ("none", "kill") else f"{self.kind}: {self.name}{detail}"

    def failing(self, rank: int, world: int) -> bool:
        """Whether ``rank`` of ``world`` is one this fault strikes."""
        return self.ranks == "all" or rank == (0 if self.ranks == "first" else world - 1)


class InjectedFault(RuntimeError):
    """The exception the matrix raises inside autooffload."""


# ---- the moments of a training run ---------------------------------------------------------------------------


class Moment:
    """Where the running Trainer is, so that each call of autooffload's is filed under the window of the run it
    falls in: a training micro-batch (the run's first, or a non-last or the last of an accumulation), its forward or
    its backward; an evaluation; or outside any micro-batch (a step's start or end, a save, a log, the run's start
    and end). The matrix fails each entry point and place once in each window the fault-free run called it in."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.micro, self.steps, self.in_micro, self.evaluating = 0, 0, False, False

    def window(self) -> str:
        if self.evaluating:
            return "evaluation"
        if not self.in_micro:
            return "outside a micro-batch"
        first = self.steps == 0 and self.micro == 1
        position = "the run's first" if first else ("the last" if self.micro == ACCUMULATION else "a non-last")
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        return f"{position} micro-batch, {phase}"


MOMENT = Moment()


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def entry_points() -> dict[str, Any]:
    """Every guarded entry point of autooffload, by the ``where`` its warning names."""
    import autooffload.callback
    import autooffload.rescue  # noqa: F401
    from autooffload.guard import ENTRY_POINTS

    return {  # a framework integration's entry points run under that framework: its own tests fail them
        where: point
        for where, point in ENTRY_POINTS.items()
        if point.method.__module__.startswith("autooffload") and ".integrations." not in point.method.__module__
    }


def places() -> dict[str, Any]:
    """Every place of autooffload's code inside a training step (``autooffload.guard.IN_STEP``), by its name."""
    import autooffload.callback  # (imports every module that registers a place: the controller's, the callback's)
    import autooffload.observe.simulated
    import autooffload.rescue  # noqa: F401
    from autooffload.guard import IN_STEP

    return dict(IN_STEP)


@contextlib.contextmanager
def counting_calls() -> Iterator[dict[str, list[str]]]:
    """The window (:class:`Moment`) of every call of every entry point and place, in order (the guard's skip after
    a give-up is not a call)."""
    calls: dict[str, list[str]] = {}
    points, steps = entry_points(), places()
    originals = {where: point.method for where, point in points.items()}

    def note(where: str) -> None:
        calls.setdefault(where, []).append(MOMENT.window())

    def counted(where: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(owner: Any, *args: Any, **kwargs: Any) -> Any:
            note(where)
            return method(owner, *args, **kwargs)

        return call

    for where, point in points.items():
        point.method = counted(where, originals[where])
    for where, place in steps.items():
        place.fault = functools.partial(note, where)
    try:
        yield calls
    finally:
        for where, point in points.items():
            point.method = originals[where]
        for place in steps.values():
            place.fault = None


@contextlib.contextmanager
def injected(fault: Fault) -> Iterator[dict[str, Any]]:
    """Raise :class:`InjectedFault` at the ``fault.at``-th call of the entry point (before or after its body) or of
    the place inside a step; ``state`` says how often it raised and in which window."""
    state: dict[str, Any] = {"calls": 0, "raised": 0, "windows": []}

    def hit() -> bool:
        state["calls"] += 1
        return state["calls"] == fault.at

    def fire(when: str) -> InjectedFault:
        state["raised"] += 1
        state["windows"].append(MOMENT.window())
        return InjectedFault(f"injected {when} call {fault.at}")

    if fault.kind == "step":
        place = places()[fault.name]

        def raising() -> None:
            if hit():
                raise fire("at")

        place.fault = raising
        try:
            yield state
        finally:
            place.fault = None
        return
    point = entry_points()[fault.name]
    original = point.method

    def failing(owner: Any, *args: Any, **kwargs: Any) -> Any:
        now = hit()
        if now and fault.timing == "before":
            raise fire("at")
        result = original(owner, *args, **kwargs)
        if now:
            raise fire("after")
        return result

    point.method = failing
    try:
        yield state
    finally:
        point.method = original


class FaultyProbe:
    """A simulated device whose second reading (and later ones) is ``fault``: an NVML error, None, a fraction
    above 1, NaN; or whose ``reset()`` raises from the second step on."""

    def __init__(self, device: Any, fault: str) -> None:
        self.device, self.fault, self.reads, self.resets = device, fault, 0, 0

    def watch_model(self, model: Any, optimizer: Any = None) -> None:
        self.device.watch_model(model, optimizer)

    def unwatch_model(self) -> None:
        self.device.unwatch_model()

    def reset(self) -> None:
        self.resets += 1
        if self.fault == "reset-raises" and self.resets >= 2:
            raise RuntimeError("the probe's reset failed")
        self.device.reset()

    def read(self) -> Any:
        from autooffload import MemoryReading

        reading = self.device.read()
        self.reads += 1
        if self.reads < 2 or reading is None or self.fault == "reset-raises":
            return reading
        if self.fault == "nvml-error":
            import pynvml

            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if self.fault == "none":
            return None
        if self.fault == "above-1":
            return MemoryReading(reading.total_bytes + reading.used_bytes, reading.total_bytes)
        return MemoryReading(float("nan"), reading.total_bytes)


def faulty_host(fault: str) -> Any:
    """Host memory that pins (a stand-in for ``cudaHostRegister`` on this CPU, so that the engines copy into
    its buffers) and then fails: allocation from the third buffer on, pinning from the second, or host memory
    that runs short in the middle of the second step."""
    from autooffload.apply.host_memory import HostMemory, pageable

    plenty, calls = (1 << 40, 1 << 41), {"allocate": 0, "register": 0, "memory": 0}

    def allocate(nbytes: int) -> torch.Tensor:
        calls["allocate"] += 1
        if fault == "allocate-fails" and calls["allocate"] >= 3:
            raise MemoryError("mmap failed: cannot allocate memory")
        return pageable(nbytes)

    def register(buffer: torch.Tensor) -> None:
        calls["register"] += 1
        if fault == "pin-fails" and calls["register"] >= 2:
            raise RuntimeError("cudaHostRegister failed with cudaError 2")

    def memory() -> tuple[int, int]:
        calls["memory"] += 1
        return (1 << 30, plenty[1]) if fault == "host-runs-out" and calls["memory"] >= 3 else plenty

    return HostMemory(None, pin=True, allocate=allocate, register=register, unregister=lambda b: None,
                      drain=lambda d: None, memory=memory)  # fmt: skip


class OutOfMemoryOnce:
    """A forward pre-hook on the final norm that raises one out-of-memory error, in the second micro-batch of
    the second step, after every checkpointed layer saved its input: what the rescue reruns."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        if module.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 4:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")


def tiny_t5() -> torch.nn.Module:
    """A tiny random T5: an encoder and a decoder of ``LAYERS // 2`` layers each, both planned, three entries."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // 4, d_ff=2 * HIDDEN, num_layers=LAYERS // 2,
        num_decoder_layers=LAYERS // 2, num_heads=4, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config)


def inner_loss(unwrapped: torch.nn.Module, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss from ``model.model(...)``'s hidden states, as TRL's fused-loss paths compute it. On one process the
    top model's forward never runs; through a wrapper (DDP, DeepSpeed) the top model is called without tokens, its
    forward redirected to this (TRL's ``_forward_redirection``), so that the wrapper's own forward runs."""

    def loss() -> torch.Tensor:
        hidden = unwrapped.model(input_ids=inputs["input_ids"]).last_hidden_state
        logits = unwrapped.lm_head(hidden).float()
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), inputs["labels"][:, 1:].flatten())

    if model is unwrapped:
        return loss()
    unwrapped.forward = lambda *args, **kwargs: loss()
    try:
        return model()
    finally:
        del unwrapped.forward


def parameter_digest(model: torch.nn.Module, zero3: bool) -> str:
    digest = hashlib.sha256()
    parameters = sorted(model.named_parameters())
    gathered = contextlib.nullcontext()
    if zero3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([p for _, p in parameters], modifier_rank=None)
    with gathered:
        for name, parameter in parameters:
            digest.update(name.encode())
            digest.update(parameter.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


@contextlib.contextmanager
def recording_collectives() -> Iterator[dict[str, Any]]:
    """The Python-level collectives this process makes (name and tensor shape, in order), and autooffload's."""
    from autooffload import distributed as ours

    record: dict[str, Any] = {"sequence": [], "autooffload": 0}
    dist = torch.distributed
    names = ("all_reduce", "all_gather", "broadcast", "barrier", "reduce_scatter_tensor", "all_gather_into_tensor")
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def recorded(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if args and torch.is_tensor(args[0]) else None
            shape = list(tensor.shape) if tensor is not None else None
            record["sequence"].append([name, shape])
            return function(*args, **kwargs)

        return call

    mine = {name: getattr(ours, name) for name in ("all_reduce_max", "join_ranks")}

    def counted(function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            record["autooffload"] += 1
            return function(*args, **kwargs)

        return call

    for name, function in originals.items():
        setattr(dist, name, recorded(name, function))
    for name, function in mine.items():
        setattr(ours, name, counted(function))
    try:
        yield record
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
        for name, function in mine.items():
            setattr(ours, name, function)


def autooffload_hooks(model: torch.nn.Module) -> int:
    """Forward hooks of autooffload's on ``model``'s modules (Trainer adds hooks of its own)."""
    import inspect

    hooks = [h for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    return sum(getattr(inspect.unwrap(hook), "__module__", "").startswith("autooffload") for hook in hooks)


def leftovers(model: torch.nn.Module, callback: Any) -> list[str]:
    """What autooffload left on ``model`` after training (empty: nothing)."""
    from autooffload import lifecycle

    found = []
    hooks = autooffload_hooks(model)
    if hooks:
        found.append(f"{hooks} forward hook(s)")
    if lifecycle.owner(model) is not None:
        found.append("an owning controller")
    functions = [getattr(m, "_gradient_checkpointing_func", None) for m in model.modules()]
    active = {f.__name__ for f in functions if getattr(f, "__name__", "") in ACTIVE_FUNCTIONS}
    if active:
        found.append(f"checkpoint functions {sorted(active)}")
    if callback is not None and callback.controller.host.held_bytes:
        found.append(f"{callback.controller.host.held_bytes} host bytes held")
    if callback is not None and callback.controller.fallback.notice is not None:
        found.append("a rank notice")
    return found


def train(config: Config, fault: Fault, out: Path, autooffload: bool = True, kill_at: int | None = None,
          resume: str | None = None, save_every: int = SAVE_EVERY) -> dict[str, Any]:  # fmt: skip
    """One Trainer run on this rank; returns what the matrix compares."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from autooffload import AutoOffloadWarning, SimulatedDevice, attach
    from autooffload.demo import MixedLengths, checkpointing_arguments, tiny_qwen3

    losses: list[float] = []
    MOMENT.reset()

    class InOrderTrainer(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            MOMENT.micro, MOMENT.in_micro = MOMENT.micro + 1, True
            try:
                loss = super().training_step(*args, **kwargs)
            finally:
                MOMENT.in_micro = False
            losses.append(loss.item())
            return loss

        def evaluate(self, *args: Any, **kwargs: Any) -> Any:
            MOMENT.evaluating = True
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                MOMENT.evaluating = False

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if config.model != "inner":
                return super().compute_loss(model, inputs, *args, **kwargs)
            loss = inner_loss(self.accelerator.unwrap_model(model), model, inputs)
            return (loss, {"loss": loss}) if kwargs.get("return_outputs") or (args and args[0]) else loss

    class Kill(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            MOMENT.micro = 0
            if kill_at is not None and state.global_step == kill_at and rank() == world() - 1:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            MOMENT.steps += 1

    zero3 = config.topology == "zero3"
    size = world()
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(STEPS * ACCUMULATION * size)]  # rank r: every size-th
    plain = {k: {"use_reentrant": False} if k.endswith("_kwargs") else v for k, v in checkpointing_arguments().items()}
    extra: dict[str, Any] = {}
    if size > 1:
        extra.update(ddp_backend="gloo", ddp_timeout=int(TIMEOUT.total_seconds()))
    if zero3:
        extra["deepspeed"] = {
            "zero_optimization": {"stage": 3},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
        }
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="steps",
        save_steps=save_every,
        eval_strategy="steps",
        eval_steps=SAVE_EVERY,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        optim="sgd",  # no optimizer state: the activations, not Adam's moments, decide what fits
        prediction_loss_only=True,
        **plain,
        **extra,
    )
    model = tiny_t5() if config.model == "t5" else tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed=0)
    oom = OutOfMemoryOnce() if fault.run == "rescued" else None
    if oom is not None:
        (model.decoder.final_layer_norm if config.model == "t5" else model.model.norm).register_forward_pre_hook(oom)
    mine = fault.kind in ("entry", "step", "probe", "host") and fault.failing(rank(), world())
    device: Any = SimulatedDevice(DEVICE_BYTES)
    if fault.kind == "probe" and mine:
        device = FaultyProbe(device, fault.name)
    evaluation = MixedLengths([48, 96], VOCAB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        trainer = InOrderTrainer(
            model=model, args=args, train_dataset=MixedLengths(lengths, VOCAB), eval_dataset=evaluation,
            callbacks=[Kill()],
        )  # fmt: skip
        callback = None
        if autooffload:
            settings = dict(engine=config.engine, policy=config.policy, recompute=config.recompute, **THRESHOLDS)
            callback = attach(trainer, probe=device, **settings)
            if fault.kind == "host" and mine:
                callback.controller.host = faulty_host(fault.name)
        started = time.perf_counter()
        with recording_collectives() as collectives:
            if fault.kind in ("entry", "step") and mine:
                with injected(fault) as injection:
                    trainer.train(resume_from_checkpoint=resume)
            else:
                injection = None
                with counting_calls() as calls:
                    trainer.train(resume_from_checkpoint=resume)
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    return {
        "config": config.name,
        "fault": dataclasses.asdict(fault),
        "rank": rank(),
        "steps": trainer.state.global_step,
        "losses": losses,
        "parameters": parameter_digest(model, zero3),
        "warnings": ours,
        "raised": injection["raised"] if injection is not None else None,
        "raised_in": injection["windows"] if injection is not None else None,
        "calls": calls if injection is None else None,
        "leftovers": leftovers(model, callback),
        "collectives": collectives["sequence"],
        "autooffload_collectives": collectives["autooffload"],
        "bytes_moved": callback.controller.stats.total_bytes if callback is not None else 0,
        "rescues": callback.controller.record.rescues if callback is not None else 0,
        "seconds": round(time.perf_counter() - started, 2),
    }


# ---- jobs: one run each, in this process or in a torchrun worker --------------------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    """One run of the matrix: ``role`` "plain" (no autooffload), "reference" (no fault) or "cell"; ``resume``: a
    checkpoint to start from; ``kill_at``: the step at whose start the last rank kills itself; ``save_every``."""

    config: Config
    fault: Fault
    role: str
    out: str
    resume: str | None = None
    kill_at: int | None = None
    save_every: int = SAVE_EVERY

    @property
    def key(self) -> str:
        return f"{self.role} {self.config.name} {self.fault.label} {self.fault.run} at {self.fault.at}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Job:
        return Job(Config(**data["config"]), Fault(**data["fault"]), **{
            k: v for k, v in data.items() if k not in ("config", "fault")
        })  # fmt: skip


def run_job(job: Job) -> dict[str, Any]:
    result = train(job.config, job.fault, Path(job.out), autooffload=job.role != "plain", kill_at=job.kill_at,
                   resume=job.resume, save_every=job.save_every)  # fmt: skip
    return {"key": job.key, **result}


def worker(jobs_file: Path, results: Path) -> None:
    """A torchrun worker: run the jobs in order, appending each result to ``results/rank{N}.jsonl`` as it ends."""
    torch.distributed.init_process_group("gloo", timeout=TIMEOUT)
    jobs = [Job.from_json(data) for data in json.loads(jobs_file.read_text())]
    for job in jobs:
        result = run_job(job)
        with open(results / f"rank{rank()}.jsonl", "a") as file:
            file.write(json.dumps(result) + "\n")
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as tests/distributed_worker.py: no interpreter teardown (DeepSpeed's CPU ranks abort in it)


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOOFFLOAD_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault(
        "TORCH_EXTENSIONS_DIR",
        str(
            Path.home()
            / ".cache"
            / "autooffload"
            / "torch_extensions"
            / hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
        ),
    )
    return env


def launch(command: list[str], timeout_s: int) -> tuple[int, str]:
    """Run ``command`` in its own process group; kill the group if it overruns. Returns (exit code, output tail)."""
    process = subprocess.Popen(command, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return -999, output[-3000:]
    return process.returncode, output[-3000:]


def run_ranked(jobs: list[Job], scratch: Path, timeout_s: int = BATCH_TIMEOUT_S) -> dict[str, list[dict | None]]:
    """Run ``jobs`` on two ranks (torchrun); returns, per job key, each rank's result (None: it did not finish).
    A batch that crashes or hangs is retried from the job after the one that did not finish."""
    results: dict[str, list[dict | None]] = {}
    pending = list(jobs)
    while pending:
        batch = scratch / f"batch-{time.monotonic_ns()}"
        batch.mkdir(parents=True)
        (batch / "jobs.json").write_text(json.dumps([job.to_json() for job in pending]))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(Path(__file__).resolve()), "--worker", str(batch / "jobs.json"), str(batch)]  # fmt: skip
        code, output = launch(command, timeout_s)
        done = [[json.loads(line) for line in (batch / f"rank{r}.jsonl").read_text().splitlines()]
                if (batch / f"rank{r}.jsonl").exists() else [] for r in range(2)]  # fmt: skip
        finished = min(len(done[0]), len(done[1]))
        for index, job in enumerate(pending[:finished]):
            results[job.key] = [done[0][index], done[1][index]]
        if finished == len(pending):
            break
        failed = pending[finished]
        results[failed.key] = [
            done[r][finished] if len(done[r]) > finished else None for r in range(2)
        ]  # fmt: skip
        results[failed.key + " output"] = output  # type: ignore[assignment]
        if code == 0:  # every rank returned, yet a result is missing: nothing more to learn from a rerun
            break
        pending = pending[finished + 1 :]
    return results


def run_alone(jobs: list[Job], scratch: Path) -> dict[str, list[dict | None]]:
    """Run ``jobs`` in this process, one after the other; a job that raises did not finish."""
    results: dict[str, list[dict | None]] = {}
    for job in jobs:
        try:
            results[job.key] = [run_job(job)]
        except Exception as error:  # a cell that does not survive is a result, not the end of the matrix
            results[job.key] = [None]
            results[job.key + " output"] = f"{type(error).__name__}: {error}"  # type: ignore[assignment]
    return results


def run_single(job: Job, scratch: Path) -> tuple[int, dict | None]:
    """Run one job in a process of its own (a kill must not take this one with it)."""
    scratch.mkdir(parents=True, exist_ok=True)
    spec, out = scratch / f"job-{time.monotonic_ns()}.json", scratch / f"result-{time.monotonic_ns()}.json"
    spec.write_text(json.dumps(job.to_json()))
    code, _ = launch([sys.executable, str(Path(__file__).resolve()), "--job", str(spec), str(out)], BATCH_TIMEOUT_S)
    return code, json.loads(out.read_text()) if out.exists() else None


# ---- the matrix -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a configuration's cells are. ``windows``: every entry point and place fails once in each window of the
    run the fault-free run called it in (:class:`Moment`: the run's first micro-batch, a non-last and the last of an
    accumulation, each's forward and backward, an evaluation, outside a micro-batch), else once, at its middle call;
    an entry point fails before its body and, with ``after``, after it too (after the pre-forward hook's body: after
    the agreement), on the last rank; ``subsets``: the ranks an entry point's cells fail on before its body (a
    place's: the last rank); ``places``: the places inside
    a step too; ``others``: the probe and host faults; ``kill``: SIGKILL between two steps, then a resume; ``only``:
    these entry points, places and faults by name."""

    windows: bool | tuple[str, ...] = False  # a tuple: these windows only
    after: bool | tuple[str, ...] = False  # a tuple: these entry points only
    subsets: tuple[str, ...] = ("last",)
    places: bool = True
    others: bool = False
    kill: bool = False
    only: tuple[str, ...] | None = None  # these entry points, places and faults only


PRIMARY = dict(engine="sync", policy="predictive", recompute="auto")  # reaches every entry point: a kept layer's report
RUNS = ("fresh", "resumed", "rescued")


def plans(topology: str, quick: bool) -> list[tuple[Config, Plan]]:
    """The configurations of ``topology`` and their cells. Every window, on every subset of ranks, for a Qwen3 in
    the configuration that reaches every entry point; every window on the last rank for a T5 and a model entered
    through ``model.model`` (their two-rank cells hold the two repros of issue 37: a T5 failing in an encoder layer's
    report, a Qwen3 in its pre-forward hook after the agreement); once per entry point and place for the other
    engines, policies and recompute settings (all of them on one process, one on two ranks)."""
    if quick:  # recompute="auto": the one configuration that reaches every entry point (a kept layer's report)
        return [(Config(topology, recompute="auto"), Plan(after=True, others=True, kill=True))]
    hook = ("the pre-forward hook",)  # after its body: after the agreement (the Qwen3 repro of issue 37)
    every = {"one": ("last",), "ddp": ("last", "first", "all"), "zero3": ("last", "all")}[topology]
    after = True if topology == "one" else hook
    primary = Plan(True, after, every, others=topology != "zero3", kill=True)
    chosen = [(Config(topology, **PRIMARY), primary)]
    if topology == "zero3":
        return chosen
    chosen += [(Config(topology, model=model, **PRIMARY), Plan(True, after)) for model in ("t5", "inner")]
    if topology == "one":
        others = [Config(topology, e, p, r) for e in ENGINES for p in POLICIES for r in RECOMPUTES]
        return chosen + [(c, Plan(others=True, kill=True)) for c in others if c != Config(topology, **PRIMARY)]
    return [*chosen, (Config(topology, "stream", "hysteresis", "always"), Plan())]


def references(topology: str, config: Config, out: Path) -> list[Job]:
    """The fault-free runs a configuration's cells are compared with: plain checkpointing, autooffload fresh,
    autooffload resumed from the fresh run's checkpoint and (one process) with an out-of-memory step rescued."""
    base = out / "runs" / config.name.replace("/", "-")
    jobs = [
        Job(config, Fault(), "plain", str(base / "plain")),
        Job(config, Fault(), "reference", str(base / "reference")),
        Job(config, Fault(run="resumed"), "reference", str(base / "reference-resumed"),
            resume=str(base / "reference" / f"checkpoint-{SAVE_EVERY}")),
    ]  # fmt: skip
    if topology == "one":
        jobs.append(Job(config, Fault(run="rescued"), "reference", str(base / "reference-rescued")))
    return jobs


def cells(
    config: Config, calls: dict[str, list[dict[str, list[str]]]], out: Path, plan: Plan, only: tuple[str, ...] | None
) -> tuple[list[Job], list[str]]:
    """The cells of ``config`` by ``plan``, at the run kind that reaches each entry point or place on the failing
    ranks (``calls``: per run kind, each rank's windows of each call of each); and what no run kind reaches."""
    base = out / "runs" / config.name.replace("/", "-")
    checkpoint = str(base / "reference" / f"checkpoint-{SAVE_EVERY}")
    jobs, unreached = [], []
    size = len(next(iter(calls.values())))
    only = plan.only if plan.only is not None else only
    points = [("entry", w) for w in sorted(entry_points())] + [("step", w) for w in sorted(places()) if plan.places]
    for kind, where in points:
        if only is not None and where not in only:
            continue
        reached = False
        for subset in plan.subsets if kind == "entry" and size > 1 else ("last",):
            failing = [r for r in range(size) if Fault(ranks=subset).failing(r, size)]
            run = next((k for k in RUNS if k in calls and all(calls[k][r].get(where) for r in failing)), None)
            if run is None:
                continue
            reached = True
            # The ranks may call it differently often (rank 0 alone saves the callback's state): the calls of the
            # failing rank with the fewest choose, and a call in another window on another failing rank is left out.
            seen = [calls[run][r][where] for r in failing]
            for window, at in moments(min(seen, key=len), plan.windows):
                if any(w[at - 1] != window for w in seen):
                    continue
                for timing in ("before", "after") if kind == "entry" and subset == "last" else ("before",):
                    if timing == "after" and not (plan.after is True or (plan.after and where in plan.after)):
                        continue
                    fault = Fault(kind, where, timing, at, run, subset, window)
                    name = f"{kind}-{where}-{timing}-{subset}-{at}".replace(" ", "_").replace("'", "")
                    jobs.append(
                        Job(config, fault, "cell", str(base / name), resume=checkpoint if run == "resumed" else None)
                    )
        if not reached:
            unreached.append(f"{kind}: {where}")
    for kind, names in (("probe", PROBE_FAULTS), ("host", HOST_FAULTS)) if plan.others else ():
        for name in names:
            if only is None or name in only:
                jobs.append(Job(config, Fault(kind, name), "cell", str(base / f"{kind}-{name}")))
    return jobs, unreached


def moments(windows: list[str], every: bool | tuple[str, ...]) -> list[tuple[str, int]]:
    """Which calls fail, as (window, 1-based call): with ``every``, one in each window the calls fell in (in the order
    they first did; a tuple: in those windows only): a micro-batch's first (the earliest step, before anything
    after the failure could hide it) or, outside micro-batches, the middle one; else the middle call of all."""
    if every is False:
        middle = (len(windows) + 1) // 2
        return [(windows[middle - 1], middle)]
    chosen = []
    for window in dict.fromkeys(windows):
        if every is not True and window not in every:
            continue
        positions = [i + 1 for i, w in enumerate(windows) if w == window]
        chosen.append((window, positions[(len(positions) - 1) // 2 if window.startswith("outside") else 0]))
    return chosen


def judge(job: Job, ranks: list[dict | None], reference: list[dict | None], plain: list[dict | None]) -> dict:
    """A cell's verdict, from every rank's result and its configuration's fault-free ones."""
    fault = job.fault
    survived = all(r is not None and r["steps"] == STEPS for r in ranks)
    verdict: dict[str, Any] = {"key": job.key, "config": job.config.name, "fault": fault.label, "run": fault.run,
                               "at": fault.at, "window": fault.window, "survived": survived}  # fmt: skip
    if not survived:
        return verdict
    failing = [r for r in range(len(ranks)) if fault.failing(r, len(ranks))]
    verdict["identical"] = all(
        r["losses"] == ref["losses"] and r["parameters"] == ref["parameters"]
        for r, ref in zip(ranks, reference, strict=True)
    )
    verdict["plain_identical"] = fault.run != "fresh" or all(
        r["parameters"] == p["parameters"] for r, p in zip(ranks, plain, strict=True)
    )
    expected = {
        "entry": f"internal error in {fault.name} (InjectedFault: injected",
        "step": f"internal error in {fault.name} (InjectedFault: injected",
        "probe": "memory probe reset failed" if fault.name == "reset-raises" else "memory reading failed",
        "host": {"allocate-fails": "could not be allocated", "pin-fails": "pinning host memory failed",
                 "host-runs-out": "host memory is short"}.get(fault.name, "?"),
    }[fault.kind]  # fmt: skip

    # A fault may change which configuration warnings a run meets (keep-no-prediction after a missing reading):
    # what is judged is the failure's own warning, and the give-up's.
    def failure_warnings(r: dict) -> list[str]:
        return [w for w in r["warnings"] if "internal error in" in w or "gave up" in w or expected in w]

    others = [failure_warnings(ranks[i]) for i in range(len(ranks)) if i not in failing]
    warned = all(failure_warnings(ranks[i]) == [w for w in ranks[i]["warnings"] if expected in w] for i in failing)
    warned = warned and all(sum(expected in w for w in ranks[i]["warnings"]) == 1 for i in failing)
    if fault.kind == "probe" and fault.name == "none":  # no reading for a step is no failure: nothing to say
        warned = all(failure_warnings(r) == [] for r in ranks)
    elif fault.kind == "entry" and ((fault.name in AT_END and fault.timing == "after") or fault.ranks == "all"):
        warned = warned and all(o == [] for o in others)  # nothing left to tell, or nobody left to tell it to
    elif fault.kind in ("entry", "step"):
        told = f"rank {max(failing)} gave up"
        warned = warned and all(len(o) == 1 and told in o[0] for o in others)
    else:
        warned = warned and all(o == [] for o in others)
    if fault.kind in ("entry", "step"):  # raised once, in the window planned
        verdict["raised"] = all(ranks[i]["raised"] == 1 for i in failing)
        verdict["raised"] = verdict["raised"] and all(ranks[i]["raised_in"] == [fault.window] for i in failing)
    verdict["warned"] = warned
    verdict["detached"] = all(not r["leftovers"] for r in ranks)
    verdict["same_collectives"] = all(r["collectives"] == ranks[0]["collectives"] for r in ranks) and all(
        r["autooffload_collectives"] <= ref["autooffload_collectives"] for r, ref in zip(ranks, reference, strict=True)
    )
    verdict["leftovers"] = sorted({item for r in ranks for item in r["leftovers"]})
    return verdict


def kill_cells(topology: str, config: Config, out: Path, reference: list[dict | None], kill_at: int = 3) -> dict:
    """SIGKILL between steps ``kill_at`` and ``kill_at + 1`` (a checkpoint after every step), then a resume from
    the last checkpoint; the resumed run must end as the uninterrupted fault-free one did."""
    from transformers.trainer_utils import get_last_checkpoint

    base = out / "runs" / config.name.replace("/", "-") / "kill"
    killed = Job(config, Fault("kill"), "cell", str(base), kill_at=kill_at, save_every=1)
    scratch = out / "scratch"
    if topology == "one":
        code, _ = run_single(killed, scratch)
        died = code == -signal.SIGKILL
    else:
        died = any(r is None for r in run_ranked([killed], scratch, timeout_s=600).get(killed.key, [None]))
    checkpoint = get_last_checkpoint(str(base))
    verdict = {"key": killed.key, "config": config.name, "fault": "kill", "run": "resumed", "at": kill_at,
               "killed": died, "checkpoint": Path(checkpoint).name if checkpoint else None}  # fmt: skip
    if checkpoint is None:
        return {**verdict, "survived": False}
    resumed = Job(config, Fault("kill", run="resumed"), "cell", str(base) + "-resumed", resume=checkpoint)
    if topology == "one":
        _, result = run_single(resumed, scratch)
        ranks = [result]
    else:
        ranks = run_ranked([resumed], scratch, timeout_s=600).get(resumed.key, [None, None])
    survived = all(r is not None and r["steps"] == STEPS for r in ranks)
    verdict["survived"] = survived and died
    if survived:
        tail = kill_at * ACCUMULATION
        exact = all(
            r["losses"] == ref["losses"][tail:] and r["parameters"] == ref["parameters"]
            for r, ref in zip(ranks, reference, strict=True)
        )
        same = all(r["collectives"] == ranks[0]["collectives"] for r in ranks)
        detached = all(not r["leftovers"] for r in ranks)
        verdict.update(identical=exact, resumed_exactly=exact, detached=detached, warned=True, same_collectives=same)
    return verdict


def run_topology(
    topology: str,
    out: Path,
    quick: bool,
    only: tuple[str, ...] | None,
    log: Callable[[str], None],
    kill: bool = True,
    chosen: list[tuple[Config, Plan]] | None = None,
) -> list[dict]:
    """Every configuration of ``topology`` (``chosen``: these instead of :func:`plans`'): its fault-free runs, then
    its cells."""
    scratch = out / "scratch"
    runner = run_alone if topology == "one" else run_ranked
    verdicts: list[dict] = []
    fault_free: dict[Config, dict[str, list[dict | None]]] = {}  # a configuration planned twice runs them once
    for config, plan in chosen if chosen is not None else plans(topology, quick):
        if config not in fault_free:
            refs = references(topology, config, out)
            done = runner(refs, scratch)
            missing = [job.key for job in refs if any(r is None for r in done.get(job.key, [None]))]
            if missing:
                log(f"{config.name}: fault-free runs failed: {missing}")
                verdicts.append({"config": config.name, "fault": "fault-free runs", "survived": False})
                continue
            fault_free[config] = {job.fault.run if job.role == "reference" else "plain": done[job.key] for job in refs}
        results = fault_free[config]
        calls = {run: [r["calls"] for r in results[run]] for run in RUNS if run in results}
        moved = [r["bytes_moved"] for r in results["fresh"]]
        jobs, unreached = cells(config, calls, out, plan, only)
        log(f"{config.name}: fault-free moved {moved} bytes; {len(jobs)} cells; not reached: {unreached}")
        outcome = runner(jobs, scratch)
        for job in jobs:
            ranks = outcome.get(job.key, [None] * (1 if topology == "one" else 2))
            verdict = judge(job, ranks, results[job.fault.run], results["plain"])
            verdict["topology"], verdict["model"] = topology, config.model
            if not verdict["survived"]:
                verdict["output"] = outcome.get(job.key + " output")
            verdicts.append(verdict)
        for point in unreached:
            if point.startswith("entry: "):
                verdicts.append({"config": config.name, "topology": topology, "fault": point, "unreached": True})
        if kill and plan.kill:
            verdict = kill_cells(topology, config, out, results["fresh"])
            verdict["topology"], verdict["model"] = topology, config.model
            verdicts.append(verdict)
        bad = [v.get("key") for v in verdicts[-len(jobs) - 1 :] if not all(v.get(k, True) for k in CHECKS)]
        log(f"{config.name}: {len(jobs)} cells judged; not all checks held: {bad}")
    return verdicts


CHECKS = ("survived", "identical", "warned", "detached", "same_collectives", "raised", "plain_identical")


def table(verdicts: list[dict]) -> str:
    """One row per fault and topology: cells injected, and how many passed each check."""
    rows: dict[tuple[str, str], dict[str, int]] = {}
    for v in verdicts:
        if v.get("unreached"):
            continue
        fault = v["fault"]
        row = rows.setdefault((fault, v.get("topology", "?")), dict.fromkeys(("cells", *CHECKS, "resumed"), 0))
        row["cells"] += 1
        for check in CHECKS:
            row[check] += int(bool(v.get(check, check in ("raised", "plain_identical") or v.get("survived"))))
        row["resumed"] += int(bool(v.get("resumed_exactly")))
    columns = ("fault", "topology", "injected", "survived", "identical", "warned", "detached", "same collectives")
    lines = ["| " + " | ".join((*columns, "resumed exactly")) + " |", "|---" * (len(columns) + 1) + "|"]
    totals = dict.fromkeys(("cells", "survived", "identical", "warned", "detached", "same_collectives", "resumed"), 0)
    for (fault, topology), row in sorted(rows.items(), key=lambda item: (item[0][0].split(":")[0], item[0])):
        resumed = str(row["resumed"]) if fault == "kill" else "-"
        lines.append(
            f"| {fault} | {topology} | {row['cells']} | {row['survived']} | {row['identical']} | {row['warned']} | "
            f"{row['detached']} | {row['same_collectives']} | {resumed} |"
        )
        for key in totals:
            totals[key] += row[key]
    lines.append(
        f"| **all** | | {totals['cells']} | {totals['survived']} | {totals['identical']} | {totals['warned']} | "
        f"{totals['detached']} | {totals['same_collectives']} | {totals['resumed']} |"
    )
    return "\n".join(lines)


def summary(verdicts: list[dict]) -> str:
    """Per kind of fault and topology: cells injected / survived with identical results and every check held."""
    kinds = {"entry": "an exception at an entry point", "step": "an exception inside a step (a place)",
             "probe": "the memory probe", "host": "host memory", "kill": "SIGKILL between steps, resumed"}  # fmt: skip
    return held_table(verdicts, "fault", kinds, lambda v: v.get("fault", "").split(":")[0])


def windows_table(verdicts: list[dict]) -> str:
    """Per window of the run (entry points and places) and topology: cells injected / every check held."""
    names = dict.fromkeys(sorted({v["window"] for v in verdicts if v.get("window")}, key=_window_order))
    return held_table(verdicts, "window", {name: name for name in names}, lambda v: v.get("window", ""))


def models_table(verdicts: list[dict]) -> str:
    """Per model and topology: cells injected / every check held."""
    models = {"qwen3": "Qwen3", "t5": "T5 (encoder-decoder)", "inner": "Qwen3 entered through model.model (TRL)"}
    return held_table(verdicts, "model", models, lambda v: v.get("model", ""))


def held_table(verdicts: list[dict], title: str, rows: dict[str, str], key: Callable[[dict], str]) -> str:
    topologies = [t for t in TOPOLOGIES if any(v.get("topology") == t for v in verdicts)]
    lines = [f"| {title} | " + " | ".join(topologies) + " |", "|---" * (len(topologies) + 1) + "|"]
    for row, name in rows.items():
        cells = []
        for topology in topologies:
            mine = [v for v in verdicts if v.get("topology") == topology and key(v) == row and not v.get("unreached")]
            held = sum(all(v.get(k, True) for k in CHECKS) for v in mine)
            cells.append(f"{held} of {len(mine)}" if mine else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _window_order(window: str) -> tuple[int, str]:
    order = ("the run's first", "a non-last", "the last", "evaluation", "outside")
    return next((i for i, start in enumerate(order) if window.startswith(start)), len(order)), window


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="one configuration per topology")
    parser.add_argument("--topology", nargs="+", choices=TOPOLOGIES, default=list(TOPOLOGIES))
    parser.add_argument("--only", nargs="+", help="these entry points and faults (names as in the table)")
    parser.add_argument("--no-kill", action="store_true", help="leave out the SIGKILL cells")
    parser.add_argument("--work", type=Path, help="where the runs' checkpoints go (default: a temporary folder)")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--job", nargs=2, type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if options.worker:
        worker(*options.worker)
        return 0
    if options.job:
        result = run_job(Job.from_json(json.loads(options.job[0].read_text())))
        options.job[1].write_text(json.dumps(result))
        return 0
    if options.out is None:
        parser.error("--out is required")
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    work = options.work or Path(tempfile.mkdtemp(prefix="autooffload-faults-"))
    started = time.time()

    def log(line: str) -> None:
        print(f"[{time.time() - started:7.0f} s] {line}", flush=True)

    verdicts: list[dict] = []
    only = tuple(options.only) if options.only else None
    for topology in options.topology:
        if topology == "zero3" and not deepspeed_available():
            log("zero3: DeepSpeed is not installed; skipped")
            continue
        verdicts += run_topology(topology, work, options.quick, only, log, kill=not options.no_kill)
        write(out, verdicts, options, time.time() - started)
    if options.work is None:
        shutil.rmtree(work, ignore_errors=True)
    print(table(verdicts))
    return 0 if all(all(v.get(k, True) for k in CHECKS) for v in verdicts if not v.get("unreached")) else 1


def deepspeed_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def write(out: Path, verdicts: list[dict], options: argparse.Namespace, seconds: float) -> None:
    import transformers

    meta = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/faults.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s), no GPU"
        if not torch.cuda.is_available()
        else "cuda",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "seconds": round(seconds),
        "entry_points": sorted(entry_points()),
        "places": sorted(places()),
    }
    (out / "faults.json").write_text(json.dumps({**meta, "cells": verdicts}, indent=1))
    (out / "faults.md").write_text(
        f"# Fault matrix, {meta['date']}\n\n`{meta['command']}` ({meta['machine']}; torch {meta['torch']}, "
        f"transformers {meta['transformers']}; {meta['seconds']} s)\n\nCells where every check held:\n\n"
        f"{summary(verdicts)}\n\nBy the window of the run the fault struck in:\n\n{windows_table(verdicts)}\n\n"
        f"By model:\n\n{models_table(verdicts)}\n\nEvery fault:\n\n{table(verdicts)}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
