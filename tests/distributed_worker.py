"""One rank of a two-process gloo run, started by tests/test_distributed.py through torchrun.

``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_worker.py SCENARIO OUT``
writes ``OUT/rank{N}.json``; the parent test asserts on the files. At every step one rank gets a long
micro-batch and the other a short one (``LENGTHS``), so only an agreement makes both offload together.

- ``trainer_ddp``: Trainer with ``use_cpu=True, ddp_backend="gloo"``, transformers' checkpointing.
- ``zero2`` / ``zero3``: Trainer under DeepSpeed ZeRO-2 / ZeRO-3 (its CPU accelerator, gloo), three runs in one
  process group: with ``attach(trainer)`` (saving a DeepSpeed checkpoint at step 2), without autooffload, and
  resumed from that checkpoint with the callback.
- ``fsdp2``: a raw loop over a ``fully_shard`` model whose layers are wrapped the way accelerate's FSDP2
  ``activation_checkpointing`` wraps them (``checkpoint_wrapper(layer, preserve_rng_state=False)``), trained
  three times: with the agreement, without it, and with the agreement over a gloo side group (the default
  group is gloo here too, so the backend check is told it is not, as it would be under NCCL).
- ``uneven``: a raw loop where only rank 0's model has checkpointed layers, over a gloo side group: a rank
  that finds nothing to control must not leave the other waiting in a collective it never joins.
- ``give_up``: Trainer DDP (gradient accumulation 2), where rank 1 alone fails inside autooffload: in the
  pre-forward hook of its second micro-batch, then (a second run) in ``attach``; and a run without autooffload.
  Every rank must finish every step with the plain run's losses and parameters.
- ``collective_faults``: a raw DDP loop where rank 1 fails between a collective's bookkeeping and its call (the
  agreement, the join, the end's gather); and a run without autooffload.
- ``user_getattr``: a raw DDP loop run from a method of a user object whose ``__getattr__`` reads a dict.
- ``give_up_in_forward``: Trainer DDP without accumulation, rank 1 failing inside a running forward after its
  micro-batch's agreement: a tiny T5 in an encoder layer's report, a tiny Qwen3 in its pre-forward hook after the
  agreement; each beside a run without autooffload.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

import torch

from autooffload import (
    AutoOffloadCallback,
    HysteresisPolicy,
    MemoryReading,
    OffloadController,
    ScriptedProbe,
    Settings,
)
from autooffload import distributed as autooffload_distributed
from autooffload.apply.hooks import ForwardHooks
from autooffload.demo import MixedLengths, checkpointing_arguments, tiny_qwen3

# (rank 0, rank 1) sequence lengths per optimizer step: a long one on rank 0 at step 1, on rank 1 at step 3.
LENGTHS = [(64, 64), (256, 64), (64, 64), (64, 256)]
SEQ_HIGH, SEQ_LOW, MIN_STEPS = 200, 128, 1
LAYERS, HIDDEN, VOCAB = 2, 32, 256
TIMEOUT = datetime.timedelta(seconds=120)


class RecordingPolicy(HysteresisPolicy):
    """The hysteresis policy, recording what this rank decided on its own before the ranks agreed."""

    def __init__(self) -> None:
        super().__init__(seq_high=SEQ_HIGH, seq_low=SEQ_LOW, min_steps=MIN_STEPS)
        self.local: list[int] = []

    def decide(self, observation):
        level = super().decide(observation)
        self.local.append(level)
        return level


def count_collectives() -> list[int]:
    """Count the agreement collectives this process makes; ``calls[1]``: those over a gloo side group."""
    calls = [0, 0]
    real = autooffload_distributed.all_reduce_max

    def counting(values: list[int], group=None, made=None) -> list[int]:
        calls[0] += 1
        calls[1] += int(group is not None and group.side)
        return real(values, group, made)

    autooffload_distributed.all_reduce_max = counting
    return calls


def record_levels(controller: OffloadController) -> list[tuple[int, int]]:
    """(sequence length, level run) of every micro-batch the controller decides for."""
    rows: list[tuple[int, int]] = []
    original = controller.before_forward

    def before_forward(seq_len: int, tokens: int, *lengths) -> int:
        level = original(seq_len, tokens, *lengths)
        rows.append((seq_len, level))
        return level

    controller.before_forward = before_forward
    return rows


def parameter_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(parameter.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def batch(step: int, rank: int) -> torch.Tensor:
    """The micro-batch of ``rank`` at ``step``, the same in every process (and in the reference)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (1, LENGTHS[step][rank]), generator=generator)


def reference_losses() -> list[list[float]]:
    """One process, no sharding, no checkpointing: each step averages the two ranks' losses, as FSDP's
    gradient reduction does. The losses every rank must see."""
    model = tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed=0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(len(LENGTHS)):
        step_losses = [model(input_ids=ids, labels=ids).loss for ids in (batch(step, 0), batch(step, 1))]
        (sum(step_losses) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in step_losses])
    return losses


# ---- Trainer, DDP ----------------------------------------------------------------------------------------


def trainer_parts() -> tuple[type, type]:
    """A Trainer that takes its samples in order (the ranks' batches are the test's, not a shuffle's) and a callback
    that records each logged loss (``.losses``)."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback

    class InOrderTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    return InOrderTrainer, Losses


def trainer_ddp(rank: int, out: Path) -> dict:
    from transformers import TrainerCallback, TrainingArguments

    InOrderTrainer, _ = trainer_parts()

    class StepBytes(TrainerCallback):
        def __init__(self, controller: OffloadController) -> None:
            self.controller = controller
            self.rows: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.rows.append(self.controller.last_step_bytes)

    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    policy = RecordingPolicy()
    callback = AutoOffloadCallback(probe=ScriptedProbe([0.30 + 0.20 * rank]), policy=policy)
    levels = record_levels(callback.controller)
    step_bytes = StepBytes(callback.controller)
    calls = count_collectives()
    collect = Collect()
    logger = logging.getLogger("transformers.autooffload")
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)

    # Accelerate hands batch i * world + rank to ``rank``: interleave the two ranks' lengths.
    lengths = [length for pair in LENGTHS for length in pair]
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=1,
        max_steps=len(LENGTHS),
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        ddp_backend="gloo",
        ddp_timeout=int(TIMEOUT.total_seconds()),
        disable_tqdm=True,
        seed=0,
        **checkpointing_arguments("auto"),
    )
    model = tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed=0)
    trainer = InOrderTrainer(
        model=model, args=args, train_dataset=MixedLengths(lengths, VOCAB), callbacks=[callback, step_bytes]
    )
    trainer.train()
    controller = callback.controller
    return {
        "world_size": torch.distributed.get_world_size(),
        "levels": levels,
        "local": policy.local,
        "step_bytes": step_bytes.rows,
        "collectives": calls[0],
        "parameters": parameter_digest(model),
        "summaries": [m for m in collect.messages if "step(s)" in m],
        "worst_rank": None if controller.record.worst_rank is None else vars(controller.record.worst_rank),
    }


# ---- Trainer, DeepSpeed ZeRO ------------------------------------------------------------------------------


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def gathered_digest(model: torch.nn.Module) -> tuple[str, bool]:
    """Digest of the full parameters (gathered from every rank's shard under ZeRO-3; a collective), and
    whether this rank held only a shard of every parameter."""
    import deepspeed

    parameters = [parameter for _, parameter in sorted(model.named_parameters())]
    sharded = all(getattr(p, "ds_tensor", None) is not None and p.ds_tensor.numel() < p.ds_numel for p in parameters)
    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
        return parameter_digest(model), sharded


class PeekingProbe(ScriptedProbe):
    """A scripted curve with a GPU probe's ``peek()`` (the step so far: here, the step's scripted reading), which
    the controller reads before the optimizer's first step wherever the optimizer lets it."""

    def peek(self) -> MemoryReading:
        fraction = self.fractions[min(self.reads, len(self.fractions) - 1)]
        return MemoryReading(round(fraction * self.total_bytes), self.total_bytes)


def deepspeed_run(stage: int, out: Path, autooffload: str, resume: str | None = None) -> dict:
    """One Trainer run under ZeRO-``stage``: ``autooffload`` is "attach", "callback" or "none"."""
    import warnings

    from transformers import TrainerCallback, TrainingArguments

    from autooffload import AutoOffloadWarning, attach
    from autooffload.rescue import rescuing

    InOrderTrainer, _ = trainer_parts()

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.step_bytes: list[int] = []
            self.controller: OffloadController | None = None

        def on_step_end(self, args, state, control, **kwargs):
            if self.controller is not None:
                self.step_bytes.append(self.controller.last_step_bytes)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    lengths = [length for pair in LENGTHS for length in pair]
    # No ``offload`` key: the run without autooffload must checkpoint plainly on every transformers release.
    plain_checkpointing = {
        k: {"use_reentrant": False} if k.endswith("_kwargs") else v for k, v in checkpointing_arguments().items()
    }
    config = {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }
    args = TrainingArguments(
        output_dir=str(out / f"zero{stage}"),
        per_device_train_batch_size=1,
        max_steps=len(LENGTHS),
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="steps" if autooffload == "attach" else "no",
        save_steps=2,
        use_cpu=True,
        deepspeed=config,
        ddp_timeout=int(TIMEOUT.total_seconds()),
        disable_tqdm=True,
        seed=0,
        **plain_checkpointing,
    )
    record = Record()
    policy = RecordingPolicy()
    model = tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed=0)
    probe = PeekingProbe([0.30 + 0.20 * rank()])  # NVML's interface, as on a GPU
    calls = count_collectives()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        callbacks = [AutoOffloadCallback(probe=probe, policy=policy)] if autooffload == "callback" else []
        dataset = MixedLengths(lengths, VOCAB)
        trainer = InOrderTrainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
        if autooffload == "attach":
            attach(trainer, probe=probe, policy=policy)
        trainer.add_callback(record)  # after autooffload's: a step's bytes are read once its step has closed
        ours = next((c for c in trainer.callback_handler.callbacks if isinstance(c, AutoOffloadCallback)), None)
        levels = record_levels(ours.controller) if ours is not None else []
        record.controller = ours.controller if ours is not None else None
        trainer.train(resume_from_checkpoint=resume)
    digest, sharded = gathered_digest(model)
    result = {
        "losses": record.losses,
        "parameters": digest,
        "sharded": sharded,
        "engine": type(trainer.model_wrapped).__name__,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)],
    }
    if ours is not None:
        result.update(
            rescue_wrapped=rescuing(trainer),
            rescue_setting=ours.controller.settings.rescue,
            levels=levels,
            local=policy.local,
            step_bytes=record.step_bytes,
            collectives=calls[0],
            state=ours.controller.state_dict(),
        )
    return result


def rank() -> int:
    return int(os.environ["RANK"])


def deepspeed_zero(stage: int, out: Path) -> dict:
    from transformers.trainer_utils import get_last_checkpoint

    result = {"attach": deepspeed_run(stage, out, "attach")}
    result["none"] = deepspeed_run(stage, out, "none")
    checkpoint = get_last_checkpoint(str(out / f"zero{stage}"))
    result["checkpoint"] = Path(checkpoint).name if checkpoint else None
    checkpoint = str(out / f"zero{stage}" / "checkpoint-2")
    result["resumed"] = deepspeed_run(stage, out, "callback", resume=checkpoint)
    result["world_size"] = torch.distributed.get_world_size()
    return result


# ---- raw FSDP2 -------------------------------------------------------------------------------------------


def fsdp2_model() -> torch.nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    model = tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed=0)
    for index, layer in enumerate(model.model.layers):
        # accelerate's fsdp2_apply_ac, then fully_shard on the layers and the root
        model.model.layers[index] = checkpoint_wrapper(layer, preserve_rng_state=False)
        fully_shard(layer)
    fully_shard(model)
    model.train()
    return model


def fsdp2_run(rank: int, sync: bool) -> dict:
    model = fsdp2_model()
    policy = RecordingPolicy()
    controller = OffloadController(Settings(sync_ranks=sync), probe=None, policy=policy)
    attached = controller.attach(model)
    levels = record_levels(controller)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, step_bytes = [], []
    for step in range(len(LENGTHS)):
        ids = batch(step, rank)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.end_step()
        losses.append(loss.item())
        step_bytes.append(controller.last_step_bytes)
    return {
        "attached": attached,
        "targets": [f"{type(t.module).__name__}.{t.attribute}" for t in controller.switch.targets],
        "levels": levels,
        "local": policy.local,
        "losses": losses,
        "step_bytes": step_bytes,
    }


def fsdp2_keep_run(rank: int) -> dict:
    """``recompute="auto"`` with room to spare: kept layers call the wrapped module directly under fully_shard,
    and the ranks keep the fewest layers any of them planned."""
    model = fsdp2_model()
    controller = OffloadController(Settings(recompute="auto"), probe=ScriptedProbe([0.01]))
    controller.attach(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, kept = [], []
    for step in range(len(LENGTHS)):
        ids = batch(step, rank)
        loss = model(input_ids=ids, labels=ids).loss
        kept.append(controller.switch.kept)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.end_step()
        losses.append(loss.item())
    return {"losses": losses, "kept": kept}


def fsdp2(rank: int, out: Path) -> dict:
    torch.distributed.init_process_group("gloo", timeout=TIMEOUT)
    calls = count_collectives()
    synced = fsdp2_run(rank, sync=True)
    synced["collectives"] = calls[0]
    alone = fsdp2_run(rank, sync=False)
    alone["collectives"] = calls[0] - synced["collectives"]
    autooffload_distributed.takes_cpu_tensors = lambda: False
    side = fsdp2_run(rank, sync=True)
    side["collectives"] = calls[0] - synced["collectives"] - alone["collectives"]
    side["side_collectives"] = calls[1]
    keep = fsdp2_keep_run(rank)
    result = {"synced": synced, "alone": alone, "side": side, "keep": keep}
    return {"world_size": torch.distributed.get_world_size(), **result}


def uneven(rank: int, out: Path) -> dict:
    import warnings

    from autooffload import AutoOffloadWarning

    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    calls = count_collectives()
    autooffload_distributed.takes_cpu_tensors = lambda: False  # a side group, as under NCCL
    model = tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed=0)
    if rank == 0:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    policy = RecordingPolicy()
    controller = OffloadController(Settings(), probe=None, policy=policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        attached = controller.attach(model)
        levels = record_levels(controller)
        for step in range(len(LENGTHS)):
            ids = batch(step, rank)
            model(input_ids=ids, labels=ids).loss.backward()
            controller.end_step()
        controller.finish()
    return {
        "attached": attached,
        "levels": levels,
        "local": policy.local,
        "collectives": calls[0],
        "worst_rank": controller.record.worst_rank,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)],
    }


def give_up_run(rank: int, out: Path, inject: str, side: bool = False, accumulation: int = 2) -> dict:
    """One Trainer DDP run; ``inject``: where rank 1 fails ("forward": its second micro-batch's pre-forward hook,
    "attach": reading the model at attach), or "none" for a run without autooffload. ``side``: the agreement on a
    gloo side group, as under NCCL."""
    import warnings

    from transformers import TrainingArguments

    import autooffload.decide.planner as planner_module
    import autooffload.observe.layout as layout_module
    from autooffload import AutoOffloadWarning

    InOrderTrainer, Losses = trainer_parts()

    def failing_on_call(function, at: int):
        calls = [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == at:
                raise RuntimeError("injected failure on rank 1")
            return function(*args, **kwargs)

        return failing

    originals = (planner_module.host_cap, layout_module.checkpointed_modules)
    if rank == 1 and inject == "forward":
        planner_module.host_cap = failing_on_call(planner_module.host_cap, 2)
    if rank == 1 and inject == "attach":
        layout_module.checkpointed_modules = failing_on_call(layout_module.checkpointed_modules, 1)
    lengths = [length for step in LENGTHS for length in step for _ in range(accumulation)]
    plain = {k: {"use_reentrant": False} if k.endswith("_kwargs") else v for k, v in checkpointing_arguments().items()}
    args = TrainingArguments(
        output_dir=str(out / f"give_up_{inject}"),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=accumulation,
        max_steps=len(LENGTHS),
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        ddp_backend="gloo",
        ddp_timeout=60,
        disable_tqdm=True,
        seed=0,
        **plain,
    )
    model = tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed=0)
    record = Losses()
    callbacks: list = [record]
    real, takes_cpu = autooffload_distributed.all_reduce_max, autooffload_distributed.takes_cpu_tensors
    if side:
        autooffload_distributed.takes_cpu_tensors = lambda: False
    calls = count_collectives()
    if inject != "none":
        callbacks.insert(0, AutoOffloadCallback(mode="auto", probe=None, policy=RecordingPolicy()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        dataset = MixedLengths(lengths, VOCAB)
        trainer = InOrderTrainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
        trainer.train()
    planner_module.host_cap, layout_module.checkpointed_modules = originals
    autooffload_distributed.all_reduce_max, autooffload_distributed.takes_cpu_tensors = real, takes_cpu
    return {
        "steps": trainer.state.global_step,
        "losses": record.losses,
        "parameters": parameter_digest(model),
        "collectives": calls[0],
        "pre_hooks": len(model._forward_pre_hooks),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)],
    }


def give_up(rank: int, out: Path) -> dict:
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    result = {inject: give_up_run(rank, out, inject) for inject in ("none", "forward", "attach")}
    result["forward_side"] = give_up_run(rank, out, "forward", side=True)
    result["attach_side"] = give_up_run(rank, out, "attach", side=True)
    return result


def tiny_t5() -> torch.nn.Module:
    """A tiny random T5 (encoder-decoder: the model and both stacks are entries)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=2 * HIDDEN, num_layers=LAYERS, num_decoder_layers=LAYERS,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config)


def failing_entry(where: str, fails: object) -> object:
    """Make the entry point ``where`` raise where ``fails(controller, *args)`` says (before its body); returns a
    function that puts it back."""
    from autooffload.guard import ENTRY_POINTS

    point = ENTRY_POINTS[where]
    original = point.method

    def failing(owner, *args, **kwargs):
        if fails(owner, *args):
            raise RuntimeError("injected failure on rank 1")
        return original(owner, *args, **kwargs)

    point.method = failing
    return lambda: setattr(point, "method", original)


def in_forward_run(rank: int, out: Path, name: str, inject: bool) -> dict:
    """One Trainer DDP run of a tiny ``name`` ("t5" or "qwen3"), no gradient accumulation; with ``inject``, rank 1
    fails inside the forward of its second micro-batch after that micro-batch's agreement: T5 in an encoder
    layer's report (the decoder stack's entry comes after it in the same forward), Qwen3 in its pre-forward hook
    after the agreement (``host.expect``; Qwen3Model's entry comes after it in the same forward)."""
    import warnings

    from transformers import TrainingArguments

    from autooffload import AutoOffloadWarning
    from autooffload.apply.host_memory import HostMemory

    InOrderTrainer, Losses = trainer_parts()

    restore = []
    failed_at: list[int] = []
    if inject and rank == 1 and name == "t5":

        def second_encoder_layer(controller, position: int, *rest) -> bool:
            # Positions 0 to LAYERS - 1 are the encoder's layers; the second micro-batch is planned and recorded.
            fails = controller.record.micro_batches == 2 and position == 1 and not failed_at
            if fails:
                failed_at.append(position)
            return fails

        restore.append(failing_entry("a layer call's report", second_encoder_layer))
    if inject and rank == 1 and name == "qwen3":
        expect, expected = HostMemory.expect, [0]

        def failing_expect(self, sizes):
            expected[0] += 1
            if expected[0] == 2:
                raise RuntimeError("injected failure on rank 1")
            return expect(self, sizes)

        HostMemory.expect = failing_expect
        restore.append(lambda: setattr(HostMemory, "expect", expect))
    lengths = [length for step in LENGTHS for length in step]
    plain = {k: {"use_reentrant": False} if k.endswith("_kwargs") else v for k, v in checkpointing_arguments().items()}
    args = TrainingArguments(
        output_dir=str(out / f"in_forward_{name}_{inject}"), per_device_train_batch_size=1, max_steps=len(LENGTHS),
        learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, ddp_backend="gloo",
        ddp_timeout=60, disable_tqdm=True, seed=0, **plain,
    )  # fmt: skip
    model = tiny_t5() if name == "t5" else tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed=0)
    record = Losses()
    callbacks: list = [record]
    calls = count_collectives()
    if inject:
        callbacks.insert(0, AutoOffloadCallback(mode="auto", probe=None, policy=RecordingPolicy()))
    real = autooffload_distributed.all_reduce_max
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        dataset = MixedLengths(lengths, VOCAB)
        trainer = InOrderTrainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
        trainer.train()
    for undo in restore:
        undo()
    autooffload_distributed.all_reduce_max = real
    return {
        "steps": trainer.state.global_step,
        "losses": record.losses,
        "parameters": parameter_digest(model),
        "collectives": calls[0],
        "failed_at": failed_at,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)],
    }


def give_up_in_forward(rank: int, out: Path) -> dict:
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    runs = [(name, inject) for name in ("t5", "qwen3") for inject in (False, True)]
    return {f"{name}_{inject}": in_forward_run(rank, out, name, inject) for name, inject in runs}


def uneven_run(rank: int, join: bool) -> dict:
    """A raw loop where rank 0 runs 3 micro-batches and rank 1 runs 2 (an uneven dataset); with ``join``, under DDP
    and its ``join()``, which lets DDP train on uneven inputs, else on the bare model. Then ``finish()``."""
    import warnings

    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    from autooffload import AutoOffloadWarning

    model = tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    controller = OffloadController(Settings(), probe=None, policy=RecordingPolicy())
    steps = 3 if rank == 0 else 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        controller.attach(model)
        wrapped = DistributedDataParallel(model) if join else model
        with Join([wrapped]) if join else contextlib.nullcontext():
            for step in range(steps):
                ids = batch(step, rank)
                wrapped(input_ids=ids, labels=ids).loss.backward()
                controller.end_step()
        controller.finish()
    return {"steps": steps, "warnings": [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]}


def uneven_micro_batches(rank: int, out: Path) -> dict:
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    return {"join": uneven_run(rank, join=True), "bare": uneven_run(rank, join=False)}


def injected_once(function, fails):
    """``function``, raising at its first call for which ``fails(*args, **kwargs)`` holds (only that once)."""
    done = []

    def failing(*args, **kwargs):
        if not done and fails(*args, **kwargs):
            done.append(True)
            raise RuntimeError("injected failure on rank 1")
        return function(*args, **kwargs)

    return failing


@contextlib.contextmanager
def raising_at_line(function, source: str, arrival: int):
    """An injected failure at the (last) line of ``function`` whose text is ``source``, at its ``arrival``-th arrival
    (a trace function, as the line-level fault run raises: before the line runs)."""
    import inspect

    code = inspect.unwrap(function).__code__
    lines, first = inspect.getsourcelines(function)
    line = [first + i for i, text in enumerate(lines) if text.strip() == source][-1]  # the last line of that text
    arrivals = [0]

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line:
            arrivals[0] += 1
            if arrivals[0] == arrival:
                raise RuntimeError("injected failure on rank 1")
        return local

    def trace(frame, event, arg):
        return local if frame.f_code is code else None

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(None)


def ddp_run(rank: int, offload: bool, levels: bool = False) -> dict:
    """A raw DDP loop (no accumulation: every micro-batch's backward all-reduces the gradients) over a tiny Qwen3,
    with ``OffloadController`` attached where ``offload`` (finished and detached after the last step). Returns the
    losses, the parameters' digest, the agreement collectives made, the forward pre-hooks left on the model, the
    AutoOffloadWarnings, and with ``levels`` the level each micro-batch ran."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    from autooffload import AutoOffloadWarning

    calls = count_collectives()
    model = tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    controller = OffloadController(Settings(), probe=None, policy=RecordingPolicy()) if offload else None
    run, losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        if controller is not None:
            controller.attach(model)
            run = record_levels(controller) if levels else []
        wrapped = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(len(LENGTHS)):
            ids = batch(step, rank)
            loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if controller is not None:
                controller.end_step()
        if controller is not None:
            controller.finish()
            controller.detach()
    return {
        "losses": losses,
        "parameters": parameter_digest(model),
        "levels": run,
        "collectives": calls[0],
        "pre_hooks": len(model._forward_pre_hooks),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)],
    }


def collective_fault_run(rank: int, inject: str) -> dict:
    """:func:`ddp_run`, with ``OffloadController`` unless ``inject`` is "none"; rank 1 fails between a collective's
    bookkeeping and its ``torch.distributed`` call: building its second micro-batch's agreement ("agree"), making the
    side group before the join at attach ("join"), reading its rank for the join's tensor ("join-rank"), building
    the end's message in ``finish`` ("worst"), or in the forward hook that decides its second micro-batch, after the
    agreement fell due and before the controller's entry ran ("begin"), or after it ran ("decided")."""
    real = {name: getattr(autooffload_distributed, name) for name in ("message", "AgreementGroup", "all_reduce_max")}
    get_rank = torch.distributed.get_rank
    if rank == 1 and inject == "join-rank":
        torch.distributed.get_rank = injected_once(get_rank, lambda *a, **k: joining())
    if rank == 1 and inject == "agree":
        built = [0]

        def second(*args, **kwargs) -> bool:
            built[0] += 1
            return built[0] == 2

        autooffload_distributed.message = injected_once(real["message"], second)
    if rank == 1 and inject == "join":
        autooffload_distributed.AgreementGroup = injected_once(real["AgreementGroup"], lambda *a, **k: True)
    if rank == 1 and inject == "worst":
        ended = lambda *args, ended=False, **kwargs: ended  # noqa: E731
        autooffload_distributed.message = injected_once(real["message"], ended)
    begin = ForwardHooks._begin
    line = {"begin": "enter = self._enter", "decided": "if deciding is not None:"}.get(inject) if rank == 1 else None
    lines = raising_at_line(begin, line, 2) if line else None
    try:
        with lines or contextlib.nullcontext():
            return ddp_run(rank, offload=inject != "none")
    finally:
        for name, value in real.items():
            setattr(autooffload_distributed, name, value)
        torch.distributed.get_rank = get_rank


def collective_faults(rank: int, out: Path) -> dict:
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    injects = ("none", "agree", "join", "join-rank", "worst", "begin", "decided")
    return {inject: collective_fault_run(rank, inject) for inject in injects}


def joining() -> bool:
    """Is the agreement's join (``RankAgreement.join``) on the call stack?"""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "join" and frame.f_globals.get("__name__") == autooffload_distributed.__name__:
            return True
        frame = frame.f_back
    return False


class Experiment:
    """A user's training object whose attributes come from a dict (``self.cfg``): its ``__getattr__`` raises
    ``KeyError``, not ``AttributeError``, for a name it lacks. Its :meth:`run` trains (a frame whose ``self`` it is,
    on the stack through every step)."""

    def __init__(self, rank: int, offload: bool) -> None:
        self.cfg = {"rank": rank, "offload": offload}

    def __getattr__(self, name: str):
        return self.cfg[name]

    def run(self) -> dict:
        return ddp_run(self.rank, self.offload, levels=True)


def user_getattr(rank: int, out: Path) -> dict:
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    real = autooffload_distributed.all_reduce_max
    result = {}
    for offload in (False, True):
        result[str(offload)] = Experiment(rank, offload).run()
        autooffload_distributed.all_reduce_max = real
    return result


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    scenarios = {
        "trainer_ddp": trainer_ddp,
        "fsdp2": fsdp2,
        "uneven": uneven,
        "give_up": give_up,
        "give_up_in_forward": give_up_in_forward,
        "uneven_micro_batches": uneven_micro_batches,
        "collective_faults": collective_faults,
        "user_getattr": user_getattr,
        "zero2": lambda rank, out: deepspeed_zero(2, out),
        "zero3": lambda rank, out: deepspeed_zero(3, out),
    }
    result = scenarios[scenario](rank, out)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # The results are written. Under a loaded machine DeepSpeed's CPU ranks now and then abort in the
    # interpreter's teardown (SIGABRT after training finished), which torchrun reports as a failed run; what this
    # worker checks is done, so it leaves without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
