"""A LightningModule around a tiny transformers model, trained by ``lightning.pytorch.Trainer``: for
tests/test_lightning.py in its own process, and as one rank of a two-process DDP run started through torchrun:

``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/lightning_worker.py OUT``

writes ``OUT/rank{N}.json``: the run with :class:`~autooffload.integrations.lightning.AutoOffload` and the run
without it, in one process group (Lightning finds torchrun's environment and starts no processes of its own).
At each step one rank gets a long micro-batch and the other a short one (``RANK_LENGTHS``), so only the ranks'
agreement makes both offload together.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from autooffload.demo import MixedLengths, tiny_qwen3
from autooffload.integrations.lightning import AutoOffload

LAYERS, HIDDEN, VOCAB = 4, 64, 256
# (rank 0, rank 1) lengths per micro-batch, two micro-batches per step: rank 0's long one in step 2, rank 1's in 4.
# Each rank trains on its own column, in order (no DistributedSampler).
RANK_LENGTHS = [(64, 64), (64, 64), (256, 64), (64, 64), (64, 64), (64, 64), (64, 64), (64, 256)]


class CausalLM(pl.LightningModule):
    """A transformers causal LM with checkpointing on, its loss per micro-batch recorded."""

    def __init__(self, seed: int = 0, fail_at_step: int | None = None, dropout: float = 0.1) -> None:
        super().__init__()
        self.model = tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed, attention_dropout=dropout)  # the rng must replay
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.23
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.losses: list[float] = []
        self.fail_at_step = fail_at_step

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.fail_at_step is not None and self.trainer.global_step == self.fail_at_step:
            raise RuntimeError("a failing training step")
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(lengths: list[int]) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(MixedLengths(lengths, VOCAB), batch_size=1, shuffle=False)


def fit(
    root: str | os.PathLike,
    lengths: list[int],
    callbacks: list[Any] = (),  # type: ignore[assignment]
    *,
    accumulate: int = 2,
    max_steps: int = -1,
    max_epochs: int | None = 1,
    ckpt_path: str | None = None,
    module: CausalLM | None = None,
    **trainer_kwargs: Any,
) -> tuple[pl.Trainer, CausalLM]:
    """Train a fresh (seeded) module over ``lengths`` in order; returns the trainer and the module."""
    pl.seed_everything(0, verbose=False)
    module = module if module is not None else CausalLM()
    trainer_kwargs.setdefault("logger", CSVLogger(str(root), name="logs", version=0))
    trainer_kwargs.setdefault("enable_checkpointing", False)
    trainer_kwargs.setdefault("log_every_n_steps", 1)
    trainer = pl.Trainer(
        accelerator="cpu",
        default_root_dir=str(root),
        callbacks=list(callbacks),
        accumulate_grad_batches=accumulate,
        max_steps=max_steps,
        max_epochs=max_epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(module, loader(lengths), ckpt_path=ckpt_path)
    return trainer, module


def parameters(module: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten()[:8].tolist() for p in module.parameters()]


def quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def ddp_main(out: Path) -> None:
    quiet()
    lengths = [pair[int(os.environ["RANK"])] for pair in RANK_LENGTHS]  # this rank's own, in order
    common = dict(devices=2, strategy="ddp", num_nodes=1, use_distributed_sampler=False)
    seen: list[tuple[int, int]] = []
    callback = AutoOffload(seq_high=200, seq_low=128, min_steps=1)
    original = callback.controller.before_forward

    def before_forward(seq_len: int, tokens: int, *rest: Any) -> int:
        level = original(seq_len, tokens, *rest)
        seen.append((seq_len, level))
        return level

    callback.controller.before_forward = before_forward  # type: ignore[method-assign]
    trainer, with_it = fit(out / "with", lengths, [callback], **common)
    rank = trainer.global_rank
    _, without = fit(out / "without", lengths, [], **common)
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "levels": seen,
        "losses": with_it.losses,
        "plain_losses": without.losses,
        "parameters": parameters(with_it),
        "plain_parameters": parameters(without),
        "step": callback.controller.step,
        "total_bytes": callback.controller.stats.total_bytes,
        "attached": callback.controller.switch is not None,
        "log_dir": trainer.log_dir,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def give_up_main(out: Path) -> None:
    """Rank 1 alone fails in ``on_train_start`` before it attaches (its controller's reset raises): both ranks must
    finish, rank 1 plain from the start and rank 0 told at the join."""
    quiet()
    rank = int(os.environ["RANK"])
    callback = AutoOffload(seq_high=200, seq_low=128, min_steps=1, probe=None)
    if rank == 1:

        def failing_reset() -> None:
            raise RuntimeError("injected failure on rank 1")

        callback.controller.reset = failing_reset  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, module = fit(
            out, [pair[rank] for pair in RANK_LENGTHS], [callback], devices=2, strategy="ddp", num_nodes=1,
            use_distributed_sampler=False,
        )  # fmt: skip
    result = {
        "step": trainer.global_step,
        "parameters": parameters(module),
        "warnings": [str(w.message) for w in caught if "autooffload" in str(w.message)],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    (give_up_main if sys.argv[2:] == ["give_up"] else ddp_main)(Path(sys.argv[1]))
