"""``autooffload demo``: train a tiny random Qwen3 through Trainer on mixed lengths and show each decision.

Runs anywhere (CPU included) in well under a minute. A CPU has no memory reading, so the demo gives the
controller a simulated device (:class:`~autooffload.observe.simulated.SimulatedDevice`): it counts what a
device would hold at each step's peak (parameters, optimizer state, and the most the step allocated: activations,
gradients, the backward's transients) against a stated size, small enough that the long micro-batches do not
fit with every layer recomputing. On it
the same run shows what autooffload is for: short micro-batches keep some layers (no recompute) where there is
room, long ones offload only as many layers as bring the predicted peak under ``memory_high`` (``k of L``),
and the ones in between run plain checkpointing.

Per optimizer step it prints, from the history the callback wrote (``<output_dir>/autooffload/history.jsonl``),
the sequence length, the simulated memory reading and the predicted peak, the layers offloaded and kept and
why, the bytes the hooks moved, and the arithmetic they must equal: offloaded layers x seq x hidden x 4;
then it draws the history (``history.png`` next to it) where matplotlib is installed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import NoReturn

import torch

from .settings import shown


class MixedLengths(torch.utils.data.Dataset):
    """Mostly short sequences and a few long ones, in a fixed order, from a seeded generator."""

    def __init__(self, lengths: list[int], vocab_size: int) -> None:
        self.lengths = lengths
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(0, self.vocab_size, (self.lengths[index],), generator=generator)
        return {"input_ids": ids, "labels": ids}


def tiny_qwen3(
    layers: int = 4, hidden: int = 64, vocab_size: int = 256, seed: int = 0, **config: object
) -> torch.nn.Module:
    """A randomly initialised Qwen3 small enough for a CPU; ``config`` overrides its config's fields."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        use_cache=False,
        max_position_embeddings=4096,
        **config,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def checkpointing_arguments(offload: object = "auto") -> dict[str, object]:
    """TrainingArguments kwargs that turn checkpointing on, under the names this transformers release uses."""
    from transformers import TrainingArguments

    names = TrainingArguments.__dataclass_fields__
    prefix = "activation" if "activation_checkpointing" in names else "gradient"
    return {f"{prefix}_checkpointing": True, f"{prefix}_checkpointing_kwargs": {"offload": offload}}


LAYERS, HIDDEN, VOCAB = 4, 64, 256
# Mostly short micro-batches, a few long ones, and some in between, in a fixed order.
LENGTHS = [256, 256, 256, 2048, 256, 256, 1024, 2048, 256, 256, 1536, 256, 2048, 256, 256, 256]
# The simulated device: a 2048-token micro-batch does not fit with every layer recomputing. Its reading is the step's
# real peak, and on this model only micro-batches of over ~800 tokens hold more in layer inputs than in gradients,
# the peak that offload lowers: hence lengths of hundreds to thousands of tokens. transformers 4.x holds ~1.7 MB
# more at that peak at 2048 tokens (measured: its causal-LM loss copies the logits), so the same story needs a
# larger device there.
DEVICE_BYTES = 19_000_000 if int(version("transformers").split(".")[0]) >= 5 else 21_000_000


class _Parser(argparse.ArgumentParser):
    """argparse, but every error is one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"autooffload demo: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _device_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a whole number of bytes") from None
    if not 0 < value <= 2**62:
        raise argparse.ArgumentTypeError(f"{shown(text)} must be a positive number of bytes (at most 2**62)")
    return value


def _output_dir(text: str) -> Path:
    """A folder the demo can write into, made if it does not exist."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot make {shown(text)}: {error.strerror or error}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {shown(text)}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(
        prog="autooffload demo",
        description="Train a tiny random Qwen3 through Trainer on mixed lengths and show each decision.",
    )
    parser.add_argument("--device-bytes", type=_device_bytes, default=DEVICE_BYTES, help="size of the simulated device")
    parser.add_argument("--output-dir", type=_output_dir, default="/tmp/autooffload-demo")
    options = parser.parse_args(argv)

    from transformers import Trainer, TrainingArguments

    from .callback import AutoOffloadCallback
    from .history import read_history
    from .observe.simulated import SimulatedDevice

    logging.getLogger("transformers.autooffload").setLevel(logging.INFO)
    warnings.simplefilter("ignore", FutureWarning)
    model = tiny_qwen3(LAYERS, HIDDEN, VOCAB)
    # Weights, gradients and Adam's two moments stay on the device whatever offload does: a device smaller than
    # those would run every step far over budget and show nothing the demo is for.
    held = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    if options.device_bytes < held:
        print(
            f"autooffload demo: error: --device-bytes {options.device_bytes:,} cannot hold the model: its weights, "
            f"gradients and Adam state alone take {held:,} bytes (default {DEVICE_BYTES:,})",
            file=sys.stderr,
        )
        return 2
    device = SimulatedDevice(options.device_bytes)
    # seq_high above every length: here the memory, not the sequence trigger, decides.
    callback = AutoOffloadCallback(recompute="auto", seq_high=4096, seq_low=3072, probe=device)
    controller = callback.controller
    args = TrainingArguments(
        output_dir=str(options.output_dir),
        per_device_train_batch_size=1,
        max_steps=len(LENGTHS),
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **checkpointing_arguments("auto"),
    )

    class InOrderTrainer(Trainer):
        """Feeds the lengths in the order given, so the story reads step by step."""

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    trainer = InOrderTrainer(model=model, args=args, train_dataset=MixedLengths(LENGTHS, VOCAB), callbacks=[callback])
    trainer.train()

    assert callback.history_path is not None
    records = read_history(callback.history_path)
    print(
        f"\nsimulated device: {device.total_bytes:,} bytes (SimulatedDevice); memory_high "
        f"{controller.settings.memory_high}; {LAYERS} checkpointed layers"
    )
    print(report(records, LAYERS, HIDDEN))
    print(controller.summary())
    print(f"history: {callback.history_path}")
    _plot(records, callback.history_path.with_suffix(".png"), device.total_bytes)
    return 0 if all(moved_as_arithmetic(r, HIDDEN) for r in records) else 1


def moved_as_arithmetic(record: dict, hidden: int) -> bool:
    """The bytes the hooks moved equal offloaded layers x tokens x hidden x 4 (fp32), micro-batch by micro-batch."""
    return record["bytes_moved"] == arithmetic(record, hidden)


def arithmetic(record: dict, hidden: int) -> int:
    return sum(level * tokens * hidden * 4 for level, tokens in zip(record["offloaded"], record["tokens"], strict=True))


def report(records: list[dict], layers: int, hidden: int) -> str:
    """One line per optimizer step: what the controller saw, decided and moved."""

    def percent(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    lines = [
        f"{'step':>4} {'seq':>4} {'memory':>6} {'predicted':>9} {'offload':>7} {'keep':>5} {'why':>16} "
        f"{'bytes offloaded':>15} {'= layers x seq x hidden x 4':>27}"
    ]
    for r in records:
        predicted = (
            r["predicted_peak_bytes"] / r["total_bytes"] if r["predicted_peak_bytes"] and r["total_bytes"] else None
        )
        expected = arithmetic(r, hidden)
        lines.append(
            f"{r['step']:>4} {max(r['seq_lens']):>4} {percent(r['memory_fraction']):>6} {percent(predicted):>9} "
            f"{max(r['offloaded']):>3} of {layers} {max(r['kept'] or [0]):>5} {r['reasons'][-1]:>16} "
            f"{r['bytes_moved']:>15,} {expected:>23,} {'ok' if r['bytes_moved'] == expected else 'NO'}"
        )
    return "\n".join(lines)


def _plot(records: list[dict], out: Path, total_bytes: int) -> None:
    from .plot import EXTRA_HINT, draw

    title = f"autooffload demo: tiny Qwen3 on a CPU, mixed lengths, simulated device of {total_bytes / 2**20:.1f} MiB"
    try:
        print(f"plot:    {draw(records, out, title=title, memory_label='simulated memory fraction')}")
    except ImportError:
        print(f"plot:    skipped ({EXTRA_HINT})")
