"""One Trainer run on one rank, in a forked child: the tiny model, the run, and what the checks compare."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import traceback
import warnings
from typing import Any

import torch

from .tracing import MOMENT, Lines, relative

LAYERS, HIDDEN, VOCAB = 4, 64, 256
STEPS, ACCUMULATION = 3, 2
LENGTHS = (32, 256, 48, 224, 32, 192, 40, 256, 32, 96, 224, 32)
DEVICE_BYTES = "2.4MiB"  # long micro-batches offload, short ones recompute (the fault matrix's device)


def digest(model: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        sha.update(name.encode())
        sha.update(parameter.detach().float().contiguous().numpy().tobytes())
    return sha.hexdigest()


def recording_collectives(record: list[Any]) -> None:
    """Note every Python-level torch.distributed collective of this (forked, short-lived) process, in order."""
    dist = torch.distributed
    names = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
             "reduce_scatter_tensor", "all_gather_into_tensor", "gather", "scatter", "reduce")  # fmt: skip

    def wrapped(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if args and torch.is_tensor(args[0]) else None
            record.append([name, list(tensor.shape) if tensor is not None else None])
            return function(*args, **kwargs)

        return call

    for name in names:
        if hasattr(dist, name):
            setattr(dist, name, wrapped(name, getattr(dist, name)))


def ours_on(model: torch.nn.Module) -> int:
    """Forward hooks of autooffload's left on ``model``, and its checkpoint functions other than plain ones."""
    import inspect

    hooks = [h for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    left = sum(getattr(inspect.unwrap(h), "__module__", "").startswith("autooffload") for h in hooks)
    functions = [getattr(m, "_gradient_checkpointing_func", None) for m in model.modules()]
    names = {getattr(f, "__name__", "") for f in functions if f is not None}
    return left + len(names & {"checkpoint_offload", "checkpoint_keep", "checkpoint_keep_measured"})


class Tokens(torch.utils.data.Dataset):
    """Sequences of the given lengths, each from its seeded generator (the benchmark's own: autooffload.demo's
    dataset would put lines of autooffload's in the data loader)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (self.lengths[index],), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


CHILD: dict[str, Any] = {}  # in a child forked at a line (forking.spawn): "write", the pipe its result goes down


def train(mode: str, world: int, rank: int, target: tuple[str, int] | None, out: str, **fork: Any) -> dict[str, Any]:
    """One Trainer run on this rank. ``mode``: "plain" (checkpointing, no autooffload), "none" (no checkpointing),
    "trace" (autooffload, every line recorded; ``fork``: :class:`~.tracing.Lines`' ``fork_at`` and ``spawn``),
    "ours" (autooffload, no fault) or "inject" (raise at ``target``)."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from autooffload import AutoOffloadWarning, SimulatedDevice, attach
    from autooffload.apply.host_memory import HostMemory, pageable
    from autooffload.demo import checkpointing_arguments, tiny_qwen3

    losses: list[float] = []
    MOMENT.update(step=0, micro=0, evaluating=False, backward=False)

    class InOrder(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            MOMENT["micro"] += 1
            loss = super().training_step(*args, **kwargs)
            losses.append(loss.item())
            return loss

        def evaluate(self, *args: Any, **kwargs: Any) -> Any:
            MOMENT["evaluating"] = True
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                MOMENT["evaluating"] = False

    class Steps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            MOMENT["step"], MOMENT["micro"] = state.global_step, 0

    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    plain = {k: {"use_reentrant": False} if k.endswith("_kwargs") else v for k, v in checkpointing_arguments().items()}
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=1, per_device_eval_batch_size=1,
        gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=1e-3, logging_steps=1,
        report_to=[], save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2, use_cpu=True,
        disable_tqdm=True, seed=0, optim="sgd", prediction_loss_only=True,
        **(plain if mode != "none" else {}),
        **(dict(ddp_backend="gloo", ddp_timeout=60) if world > 1 else {}),
    )  # fmt: skip
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(STEPS * ACCUMULATION * world)]
    model = tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed=0)
    collectives: list[Any] = []
    if world > 1:
        recording_collectives(collectives)
    result: dict[str, Any] = {"rank": rank, "fired": None, "error": None, "unraisable": []}
    sys.unraisablehook = lambda u: result["unraisable"].append(f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        trainer = InOrder(model=model, args=args, train_dataset=Tokens(lengths), eval_dataset=Tokens([48, 96]),
                          callbacks=[Steps()])  # fmt: skip
        # what the user builds: made before the trace starts (a constructor's failure raises to its caller's line)
        probe = SimulatedDevice(DEVICE_BYTES)
        # host buffers as on a GPU (pinned, a stand-in for cudaHostRegister), so that their lines run here
        host = HostMemory(None, pin=True, allocate=pageable, register=lambda b: None, unregister=lambda b: None,
                          drain=lambda d: None, memory=lambda: (1 << 40, 1 << 41))  # fmt: skip
        tracer = Lines(target) if mode == "inject" else Lines(**fork) if mode == "trace" else None
        callback = None
        try:
            with tracer if tracer is not None else contextlib.nullcontext():
                if mode in ("trace", "ours", "inject"):
                    callback = attach(trainer, probe=probe, recompute="auto")
                    callback.controller.host = host
                trainer.train()
        except BaseException as error:  # what escaped into the user's training is the finding
            result["error"] = "".join(traceback.format_exception(error))[-4000:]
        if callback is not None:
            try:
                callback.controller.detach()
            except BaseException as error:
                result["error"] = (result["error"] or "") + "detach raised: " + repr(error)
            host = callback.controller.host
            result.update(lent_bytes=host.lent_bytes, held_bytes=host.held_bytes,
                          bytes_moved=callback.controller.stats.total_bytes)  # fmt: skip
    result.update(
        steps=trainer.state.global_step, losses=losses, parameters=digest(model), left_on_model=ours_on(model),
        warnings=[str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)],
        collectives=collectives,
    )  # fmt: skip
    if tracer is not None:
        result["fired"], result["where"] = tracer.fired, tracer.where
        if CHILD:
            os.write(CHILD["write"], json.dumps(result).encode())
            os._exit(0)
        if mode == "trace":
            result["lines"] = sorted(relative(line) for line in tracer.seen)
    return result
