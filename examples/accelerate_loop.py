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
    torchrun --nproc_per_node 2 examples/accelerate_loop.py                  # two processes, DDP (gloo on a CPU)
    accelerate launch --config_file examples/accelerate/ddp.yaml examples/accelerate_loop.py
    accelerate launch --config_file examples/accelerate/zero2.yaml examples/accelerate_loop.py  # DeepSpeed ZeRO-2
    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/accelerate_loop.py  # FSDP2

Each runs what it names on a CPU too (two gloo processes; ``./dev test`` runs all four): DeepSpeed through its CPU
accelerator, and FSDP2 through torch's ``fully_shard``, applied here, since accelerate (1.16) turns an FSDP config
into DDP on a machine without an accelerator. The first line says what runs.

It prints, per optimizer step, the sequence length of this process's micro-batches, how many layers
offloaded, and the bytes moved, which must equal layers x tokens x hidden x dtype-bytes.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType

from autooffload import OffloadController, Settings
from autooffload.demo import MixedLengths, tiny_qwen3


def has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def make_accelerator(gradient_accumulation_steps: int) -> Accelerator:
    """The launch's Accelerator. On a CPU, accelerate counts torchrun's ranks only in a state made with
    ``cpu=True`` (else each process runs alone), and turns DeepSpeed on only in an Accelerator made without it:
    so the state first, then the Accelerator (what transformers' Trainer does with ``use_cpu=True``)."""
    if not has_accelerator():
        PartialState(cpu=True)
    return Accelerator(gradient_accumulation_steps=gradient_accumulation_steps)


def fsdp2_on_cpu(accelerator: Accelerator) -> bool:
    """An FSDP2 launch config that accelerate ran as DDP (it does FSDP on accelerators only): shard here."""
    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not asked or accelerator.distributed_type == DistributedType.FSDP:
        return False
    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise SystemExit("on a CPU this example runs FSDP2 only (fsdp_version: 2 in the accelerate config)")
    return True


def shard(model: torch.nn.Module) -> None:
    """FSDP2 as accelerate's ``TRANSFORMER_BASED_WRAP`` applies it: each decoder layer, then the whole model."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def what_runs(accelerator: Accelerator, model: torch.nn.Module, sharded_here: bool) -> str:
    kind = accelerator.distributed_type
    if sharded_here:
        name = "FSDP2 (torch fully_shard)"
    elif kind == DistributedType.DEEPSPEED:
        name = f"DeepSpeed ZeRO-{model.zero_optimization_stage()} ({type(model).__name__})"
    elif kind == DistributedType.FSDP:
        name = f"FSDP{accelerator.state.fsdp_plugin.fsdp_version} (accelerate)"
    else:
        name = {DistributedType.NO: "one process"}.get(kind, f"DDP ({kind.value})")
    dtensors = any(type(p).__name__ == "DTensor" for p in model.parameters())
    return f"running: {name}, {accelerator.num_processes} process(es), parameters sharded: {dtensors}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,64,512,64,64,64,384,64", help="sequence length of each sample")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--seq-high", type=int, default=256)
    parser.add_argument("--seq-low", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    options = parser.parse_args(argv)

    accelerator = make_accelerator(options.gradient_accumulation_steps)
    lengths = [int(length) for length in options.lengths.split(",")]
    model = tiny_qwen3(options.layers, options.hidden)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sharded_here = fsdp2_on_cpu(accelerator)
    if sharded_here:
        shard(model)  # before the optimizer: it must hold the sharded parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(MixedLengths(lengths, 256), batch_size=1)
    if sharded_here:
        optimizer, loader = accelerator.prepare(optimizer, loader)  # not the model: no DDP around the shards
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if accelerator.is_main_process:
        print(what_runs(accelerator, model, sharded_here), flush=True)

    settings = Settings.from_env(seq_high=options.seq_high, seq_low=options.seq_low, min_steps=1)
    controller = OffloadController(settings)  # memory from NVML on the model's GPU; none on a CPU
    controller.attach(accelerator.unwrap_model(model))

    model.train()
    seqs: list[int] = []
    levels: list[int] = []
    losses: list[float] = []
    step_ok: list[bool] = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        seqs.append(batch["input_ids"].shape[-1])
        levels.append(controller.level or 0)
        losses.append(loss.item())
        if accelerator.sync_gradients:  # an optimizer step ended
            controller.end_step()
            expected = sum(level * seq * options.hidden * 4 for level, seq in zip(levels, seqs, strict=True))
            step_ok.append(controller.last_step_bytes == expected)
            print(
                f"rank {accelerator.process_index} step {controller.step}: seq {seqs} offloaded layers {levels} "
                f"bytes {controller.last_step_bytes:,} expected {expected:,} loss {sum(losses) / len(losses):.6f}",
                flush=True,
            )
            seqs, levels, losses = [], [], []

    summary = controller.finish()  # every rank: a collective when distributed
    controller.detach()
    if accelerator.is_main_process:
        print(summary, flush=True)
    # Nothing left that holds the group's work (DDP's reducer), and every rank past its last collective, before any
    # rank tears the group down: else a gloo rank can abort at exit ("terminate called without an active exception").
    del model, optimizer, loader
    accelerator.free_memory()
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group
    if torch.distributed.is_initialized():  # DeepSpeed's ranks abort at exit without the destroy
        torch.distributed.destroy_process_group()
    return 0 if all(step_ok) else 1


if __name__ == "__main__":
    raise SystemExit(main())
