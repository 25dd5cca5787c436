"""Smoke test of the distributed paths on one GPU, one process each, in one call (about 3 minutes; 8 at most).

    python benchmarks/multi_gpu_smoke.py --out DIR                # one CUDA GPU
    python benchmarks/multi_gpu_smoke.py --out DIR --device cpu   # the same code on a CPU (gloo), tiny sizes

Parts, each in its own ``torchrun --standalone --nproc_per_node 1`` process, bounded in time:

- ``fsdp2``: a custom loop over a model prepared by accelerate's FSDP2 plugin with its own
  ``activation_checkpointing`` (torch's CheckpointWrapper on every decoder layer, then ``fully_shard``), the
  controller attached to the unwrapped model. accelerate ignores FSDP on a CPU, so ``--device cpu`` applies the
  same wrapping by hand (``checkpoint_wrapper`` then ``fully_shard``). Then the cost of the agreement
  collective on this device (world size 1: the NCCL call and its ``.item()`` synchronisation, no network).
- ``zero3``: Trainer with DeepSpeed ZeRO-3 and transformers' checkpointing (``offload="auto"``). Without
  deepspeed it prints one SKIP line and runs the same Trainer without DeepSpeed, so the rest still runs.

Per step it prints the sequence length, the layers offloaded, the bytes moved and the arithmetic they must
equal (layers x seq x hidden x dtype-bytes), the memory reading and the step time; at the end the summary.
DIR gets ``fsdp2.json``, ``zero3.json``, their logs and ``smoke.json``. Exit status 0 when every part that ran
finished and its bytes matched the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.environment import releases  # noqa: E402
from harness.verdicts import per_call  # noqa: E402

SIZES = {
    # the model, and the sequence length of each step (one micro-batch per step)
    "cuda": dict(
        layers=8, hidden=1024, heads=16, kv_heads=8, vocab=32000, lengths=[2048, 16384, 2048, 2048, 12288, 2048]
    ),
    "cpu": dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, lengths=[64, 512, 64, 64, 384, 64]),
}
THRESHOLDS = {"cuda": (8192, 4096), "cpu": (256, 128)}
PART_TIMEOUT_S = 210


def build_model(device: str, dtype):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    size = SIZES[device]
    config = Qwen3Config(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=int(2.75 * size["hidden"]),
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        head_dim=size["hidden"] // size["heads"],
        use_cache=False,
        max_position_embeddings=32768,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(dtype)


def emit(line: str) -> None:
    print(f"smoke: {line}", flush=True)


def part_fsdp2(device: str, out: Path) -> dict:
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper

    from autooffload import AutoOffloadWarning, OffloadController, Settings
    from autooffload.distributed import all_reduce_max

    size, (seq_high, seq_low) = SIZES[device], THRESHOLDS[device]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(device, dtype)
    if device == "cuda":
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            activation_checkpointing=True,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Qwen3DecoderLayer"],
        )
        accelerator = Accelerator(fsdp_plugin=plugin)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = accelerator.prepare(model, optimizer)
        how, target = f"accelerate FSDP2 plugin ({accelerator.distributed_type})", accelerator.unwrap_model(model)
        run_device = accelerator.device
    else:
        import datetime

        from torch.distributed.fsdp import fully_shard

        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        for index, layer in enumerate(model.model.layers):
            model.model.layers[index] = checkpoint_wrapper(layer, preserve_rng_state=False)
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        how, target, run_device = "checkpoint_wrapper + fully_shard by hand (CPU)", model, torch.device("cpu")
    wrappers = sum(isinstance(module, CheckpointWrapper) for module in target.modules())
    emit(f"fsdp2: {how}: {wrappers} CheckpointWrapper(s), model {type(target).__name__}")

    controller = OffloadController(Settings.from_env(seq_high=seq_high, seq_low=seq_low, min_steps=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        attached = controller.attach(target)
    targets = sorted({t.attribute for t in controller.switch.targets}) if attached else []
    emit(f"fsdp2: attached={attached}, {len(controller.switch.layers) if attached else 0} layers via {targets}")
    model.train()
    rows = train_loop(model, optimizer, controller, size, dtype, run_device)
    agreement = time_agreement(all_reduce_max, controller.agreement.group)
    emit(f"fsdp2: agreement collective on {agreement['device']}: median {agreement['median_us']:.1f} us per call")
    summary = controller.finish()
    emit(f"fsdp2: {summary}")
    return {
        "how": how,
        "checkpoint_wrappers": wrappers,
        "attached": attached,
        "targets": targets,
        "steps": rows,
        "agreement": agreement,
        "summary": summary,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)],
        "ok": attached and wrappers == size["layers"] and all(row["bytes_ok"] for row in rows),
    }


def train_loop(model, optimizer, controller, size, dtype, device) -> list[dict]:
    import torch

    rows = []
    element = torch.finfo(dtype).bits // 8
    for step, seq in enumerate(size["lengths"]):
        ids = torch.randint(0, size["vocab"], (1, seq), generator=torch.Generator().manual_seed(step)).to(device)
        synchronize(device)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize(device)
        seconds = time.perf_counter() - start
        level = controller.level or 0
        controller.end_step()
        expected = level * seq * size["hidden"] * element
        row = step_row(step, seq, level, controller, expected, seconds, float(loss))
        rows.append(row)
    return rows


def step_row(step, seq, level, controller, expected, seconds, loss) -> dict:
    row = {
        "step": step,
        "seq": seq,
        "layers_offloaded": level,
        "bytes": controller.last_step_bytes,
        "expected_bytes": expected,
        "bytes_ok": controller.last_step_bytes == expected,
        "memory_fraction": controller.memory_fraction,
        "seconds": seconds,
        "loss": loss,
    }
    memory = "n/a" if row["memory_fraction"] is None else f"{row['memory_fraction']:.3f}"
    emit(
        f"step {step}: seq {seq}, offloaded {level} layer(s), {row['bytes']:,} B moved (expected {expected:,}), "
        f"memory {memory}, {seconds * 1e3:.0f} ms" + ("" if loss is None else f", loss {loss:.4f}")
    )
    return row


def synchronize(device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


def time_agreement(all_reduce_max, group, calls: int = 300) -> dict:
    """The agreement as the controller makes it: over its group (a gloo side group under NCCL)."""
    from autooffload.distributed import collective_device

    for _ in range(20):
        all_reduce_max([1, -1], group)
    times = []
    for index in range(calls):
        start = time.perf_counter()
        all_reduce_max([index % 3, -1], group)
        times.append(time.perf_counter() - start)
    device = collective_device() if group is None else group.device
    return {"device": str(device), "calls": calls, **per_call(times, "us")}


def part_zero3(device: str, out: Path) -> dict:
    import torch
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from autooffload import AutoOffloadCallback, AutoOffloadWarning
    from autooffload.demo import MixedLengths, checkpointing_arguments

    size, (seq_high, seq_low) = SIZES[device], THRESHOLDS[device]
    try:
        import deepspeed  # noqa: F401

        skipped = None
    except ImportError as error:
        skipped = f"deepspeed is not installed ({error})"
    if device != "cuda" and skipped is None:
        skipped = "DeepSpeed needs a GPU here"
    if skipped:
        emit(f"SKIP zero3: {skipped}; running the same Trainer without DeepSpeed")
    deepspeed_config = {
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }

    class InOrderTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    callback = AutoOffloadCallback(seq_high=seq_high, seq_low=seq_low, min_steps=1)
    controller = callback.controller
    # DeepSpeed's bf16 casts the weights, so the residual stream is bf16; Trainer's bf16 autocast keeps it fp32.
    element = 4 if skipped else 2
    rows: list[dict] = []

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.start
            seq, level = controller.sizes.batch.seq_len, controller.level or 0
            expected = level * seq * size["hidden"] * element
            rows.append(step_row(len(rows), seq, level, controller, expected, seconds, None))

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="autooffload-smoke-"),  # nothing is saved; keep DIR to the results
        per_device_train_batch_size=1,
        max_steps=len(size["lengths"]),
        learning_rate=1e-4,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=device != "cuda",
        bf16=device == "cuda",
        deepspeed=None if skipped else deepspeed_config,
        **checkpointing_arguments("auto"),
    )
    model = build_model(device, torch.float32)
    trainer = InOrderTrainer(
        model=model,
        args=args,
        train_dataset=MixedLengths(size["lengths"], size["vocab"]),
        callbacks=[callback, Record()],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    summary = controller.summary()
    emit(f"zero3: {'Trainer without DeepSpeed' if skipped else 'Trainer + DeepSpeed ZeRO-3'}: {summary}")
    emit(f"zero3: losses {[round(loss, 4) for loss in losses]}")
    return {
        "skipped": skipped,
        "deepspeed": None if skipped else deepspeed_config,
        "steps": rows,
        "losses": losses,
        "summary": summary,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)],
        "ok": len(rows) == len(size["lengths"]) and all(row["bytes_ok"] for row in rows),
    }


def run_part(part: str, device: str, out: Path) -> dict:
    """One part in its own torchrun process (one rank); killed with its process group if it overruns."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    command += [str(Path(__file__).resolve()), "--part", part, "--device", device, "--out", str(out)]
    log = out / f"{part}.log"
    start = time.perf_counter()
    with log.open("w") as handle:
        process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = process.wait(timeout=PART_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            returncode = process.wait()
            print(f"smoke: {part}: TIMEOUT after {PART_TIMEOUT_S} s (killed)", flush=True)
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("smoke:"):
            print(line, flush=True)
    result_file = out / f"{part}.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {"ok": False}
    result.update(returncode=returncode, wall_s=round(time.perf_counter() - start, 1))
    if returncode != 0:
        print(f"smoke: {part}: FAILED (exit {returncode}); last lines of {log.name}:", flush=True)
        print("\n".join(text.splitlines()[-25:]), flush=True)
        result["ok"] = False
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--part", choices=["fsdp2", "zero3"], default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)

    if options.part is not None:  # inside torchrun
        result = {"fsdp2": part_fsdp2, "zero3": part_zero3}[options.part](options.device, options.out)
        (options.out / f"{options.part}.json").write_text(json.dumps(result, indent=2, default=str))
        return 0

    import torch

    if options.device == "cuda" and not torch.cuda.is_available():
        print("smoke: no CUDA device; use --device cpu for a dry run", flush=True)
        return 2
    versions: dict[str, str | None] = dict(releases())
    for name in ("accelerate", "deepspeed"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    if options.device == "cuda":
        versions["gpu"] = torch.cuda.get_device_name(0)
    print(f"smoke: {versions}", flush=True)
    results = {"versions": versions, "device": options.device}
    for part in ("fsdp2", "zero3"):
        results[part] = run_part(part, options.device, options.out)
    (options.out / "smoke.json").write_text(json.dumps(results, indent=2, default=str))
    ok = all(results[part]["ok"] for part in ("fsdp2", "zero3"))
    print(f"smoke: {'PASS' if ok else 'FAIL'}: fsdp2 ok={results['fsdp2']['ok']}, zero3 ok={results['zero3']['ok']}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
