"""One cell's training run: a tiny model through the real Trainer with autooffload attached and the fault injected;
what the run leaves to judge (losses, the parameters' digest, the collectives, warnings, what stayed attached)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .config import (
    ACCUMULATION,
    ACTIVE_FUNCTIONS,
    DEVICE_BYTES,
    HIDDEN,
    LAYERS,
    LENGTHS,
    MOMENT,
    SAVE_EVERY,
    STEPS,
    THRESHOLDS,
    TIMEOUT,
    VOCAB,
    Config,
    Fault,
    rank,
    world,
)
from .inject import FaultyProbe, OutOfMemoryOnce, counting_calls, faulty_host, injected


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
