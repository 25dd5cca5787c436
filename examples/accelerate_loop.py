"""A custom accelerate loop driven by autooffload's controller, without Trainer.

The controller needs three calls: ``attach(model)`` once (it installs its checkpoint functions and a forward
pre-hook that decides before every micro-batch's forward), ``end_step()`` after every optimizer step (it
reads the device's memory and closes the step's byte count), and ``finish()`` at the end, on every rank
(under torch.distributed it gathers the worst rank's peak memory into the summary). Under several processes
the ranks agree on one level per micro-batch by themselves (``AUTOOFFLOAD_SYNC_RANKS``, on by default).

Order matters: turn checkpointing on, then ``accelerator.prepare`` (it moves the model to its device and, with
FSDP's ``activation_checkpointing``, wraps its layers), then attach to the unwrapped model, so that the
controller finds the final checkpoint functions and reads the memory of the device the model is on.

    python examples/accelerate_loop.py                                      # one process, CPU or GPU
    torchrun --nproc_per_node 2 examples/accelerate_loop.py                  # two processes (gloo on a CPU)
    accelerate launch --config_file fsdp2.yaml examples/accelerate_loop.py  # DDP, FSDP2, DeepSpeed: any config

(``accelerate launch --cpu`` starts one process whatever ``--num_processes`` says; torchrun starts several.)

It prints, per optimizer step, the sequence length of this process's micro-batches, how many layers
offloaded, and the bytes moved, which must equal layers x tokens x hidden x dtype-bytes.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator

from autooffload import OffloadController, Settings
from autooffload.demo import MixedLengths, tiny_qwen3


def has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,64,512,64,64,64,384,64", help="sequence length of each sample")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--seq-high", type=int, default=256)
    parser.add_argument("--seq-low", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    options = parser.parse_args(argv)

    # Without cpu=True, accelerate on a machine with no accelerator ignores torchrun's ranks (one process each).
    accelerator = Accelerator(
        cpu=not has_accelerator(), gradient_accumulation_steps=options.gradient_accumulation_steps
    )
    lengths = [int(length) for length in options.lengths.split(",")]
    model = tiny_qwen3(options.layers, options.hidden)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(MixedLengths(lengths, 256), batch_size=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    settings = Settings.from_env(seq_high=options.seq_high, seq_low=options.seq_low, min_steps=1)
    controller = OffloadController(settings)  # memory from NVML on the model's GPU; none on a CPU
    controller.attach(accelerator.unwrap_model(model))

    model.train()
    seqs: list[int] = []
    levels: list[int] = []
    step_ok: list[bool] = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        seqs.append(batch["input_ids"].shape[-1])
        levels.append(controller.level or 0)
        if accelerator.sync_gradients:  # an optimizer step ended
            controller.end_step()
            expected = sum(level * seq * options.hidden * 4 for level, seq in zip(levels, seqs, strict=True))
            step_ok.append(controller.last_step_bytes == expected)
            print(
                f"rank {accelerator.process_index} step {controller.step}: seq {seqs} offloaded layers {levels} "
                f"bytes {controller.last_step_bytes:,} expected {expected:,}",
                flush=True,
            )
            seqs, levels = [], []

    summary = controller.finish()  # every rank: a collective when distributed
    controller.detach()
    if accelerator.is_main_process:
        print(summary, flush=True)
    accelerator.end_training()
    return 0 if all(step_ok) else 1


if __name__ == "__main__":
    raise SystemExit(main())
