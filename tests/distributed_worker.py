"""One rank of a two-process gloo run, started by tests/test_distributed.py through torchrun.

``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_worker.py SCENARIO OUT``
writes ``OUT/rank{N}.json``; the parent test asserts on the files. At every step one rank gets a long
micro-batch and the other a short one (``LENGTHS``), so only an agreement makes both offload together.

- ``trainer_ddp``: Trainer with ``use_cpu=True, ddp_backend="gloo"``, transformers' checkpointing.
- ``fsdp2``: a raw loop over a ``fully_shard`` model whose layers are wrapped the way accelerate's FSDP2
  ``activation_checkpointing`` wraps them (``checkpoint_wrapper(layer, preserve_rng_state=False)``), trained
  twice: with the agreement and without it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

import torch

from autooffload import AutoOffloadCallback, HysteresisPolicy, OffloadController, ScriptedProbe, Settings
from autooffload import distributed as autooffload_distributed
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
    """Count the agreement collectives this process makes."""
    calls = [0]
    real = autooffload_distributed.all_reduce_max

    def counting(value: int) -> int:
        calls[0] += 1
        return real(value)

    autooffload_distributed.all_reduce_max = counting
    return calls


def record_levels(controller: OffloadController) -> list[tuple[int, int]]:
    """(sequence length, level run) of every micro-batch the controller decides for."""
    rows: list[tuple[int, int]] = []
    original = controller.before_forward

    def before_forward(seq_len: int, tokens: int) -> int:
        level = original(seq_len, tokens)
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


def trainer_ddp(rank: int, out: Path) -> dict:
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class InOrderTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

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
        "worst_rank": None if controller.worst_rank is None else vars(controller.worst_rank),
    }


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
    keep = fsdp2_keep_run(rank)
    return {"world_size": torch.distributed.get_world_size(), "synced": synced, "alone": alone, "keep": keep}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    result = {"trainer_ddp": trainer_ddp, "fsdp2": fsdp2}[scenario](rank, out)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
