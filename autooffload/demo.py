"""``autooffload demo``: train a tiny random Qwen3 through Trainer on mixed lengths and show each decision.

Runs anywhere (CPU included) in a few seconds. Per optimizer step it prints, from the history the callback
wrote (``<output_dir>/autooffload/history.jsonl``), the micro-batch's sequence length, the layers it
offloaded and why, the bytes the hooks moved, and the arithmetic they must equal: offloaded layers x batch
x seq x hidden x dtype-bytes; then it draws the history (``history.png`` next to it) where matplotlib is
installed.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path

import torch


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autooffload demo", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-high", type=int, default=256, help="sequence length that turns offload on")
    parser.add_argument("--seq-low", type=int, default=128, help="sequence length below which it may turn off")
    parser.add_argument("--min-steps", type=int, default=2, help="steps after a switch before it may turn off")
    parser.add_argument("--output-dir", default="/tmp/autooffload-demo")
    options = parser.parse_args(argv)

    from transformers import Trainer, TrainingArguments

    from .callback import AutoOffloadCallback
    from .history import read_history

    logging.getLogger("transformers.autooffload").setLevel(logging.INFO)
    warnings.simplefilter("ignore", FutureWarning)
    layers, hidden = 4, 64
    lengths = [64, 64, 512, 64, 64, 200, 64, 384, 512, 64, 64, 64]
    model = tiny_qwen3(layers, hidden)
    callback = AutoOffloadCallback(seq_high=options.seq_high, seq_low=options.seq_low, min_steps=options.min_steps)
    controller = callback.controller
    args = TrainingArguments(
        output_dir=options.output_dir,
        per_device_train_batch_size=1,
        max_steps=len(lengths),
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        seed=0,
        **checkpointing_arguments("auto"),
    )
    trainer = Trainer(model=model, args=args, train_dataset=MixedLengths(lengths, 256), callbacks=[callback])
    trainer.train()

    assert callback.history_path is not None
    records = read_history(callback.history_path)
    # The stream engine keeps the last checkpointed layer's input on the device.
    last_kept = int(controller.settings.engine == "stream")
    arithmetic = "offloaded layers x seq x hidden x 4"
    print(f"\n{'step':>4} {'seq':>5} {'layers':>6} {'why':>12} {'bytes offloaded':>16} {arithmetic:>36}  ok")
    ok = True
    for record in records:
        expected = sum(
            (level - last_kept * (level == layers)) * tokens * hidden * 4
            for level, tokens in zip(record["offloaded"], record["tokens"], strict=True)
        )
        ok &= record["bytes_moved"] == expected
        print(
            f"{record['step']:>4} {max(record['seq_lens']):>5} {max(record['offloaded']):>6} "
            f"{record['reasons'][-1]:>12} {record['bytes_moved']:>16,} {expected:>36,}  "
            f"{'yes' if record['bytes_moved'] == expected else 'NO'}"
        )
    print(controller.summary())
    print(f"history: {callback.history_path}")
    _plot(records, callback.history_path.with_suffix(".png"), args.device.type)
    return 0 if ok else 1


def _plot(records: list[dict], out: Path, device: str) -> None:
    from .plot import EXTRA_HINT, draw

    title = f"autooffload demo: tiny Qwen3, mixed lengths, {device.upper()}"
    try:
        print(f"plot:    {draw(records, out, title=title)}")
    except ImportError:
        print(f"plot:    skipped ({EXTRA_HINT})")
