"""The arithmetic of ``autooffload estimate`` and its verdict: what offload would free and cost for a model and a
sequence length, and whether ``auto`` would switch it on. Pure: it reads nothing from the machine or a file (the
command passes what :mod:`autooffload.estimate.machine` and :mod:`autooffload.estimate.config` read).

Checkpointing keeps one input per checkpointed layer on the device until the backward reaches that layer:
layers x batch x seq x hidden x dtype-bytes. Offload moves exactly those bytes to pinned host memory (device to
host in the forward, back in the backward), so the arithmetic answers the two questions a user has: how much
device memory it frees and how much copying it adds. Everything else in a step (weights, gradients, optimizer
state, the recomputed layer) is the same with and without offload and is not estimated here.

With ``AUTOOFFLOAD_RECOMPUTE=auto`` a layer may also run without checkpointing and keep all its activations
(no recompute): the estimate gives one layer's full activations at the length, from the layer type's
arithmetic (:class:`~autooffload.decide.activations.LayerShape`, the seed the controller starts from before it
measures), and how many layers could keep on the device: under ``memory_high`` less ``keep_margin``, as the
controller plans, after the saved inputs and what ``--other-memory`` says the rest of the step takes (weights,
gradients, optimizer state; 0 by default, so the figure is an upper bound).

An encoder-decoder config (``is_encoder_decoder``: T5, BART, Whisper) has two stacks, each with its own length:
``--seq`` is the source length the encoder's layers see (Whisper: the input frames over its convolutions' stride
2, 1500 for 30 s of audio) and ``--target-seq`` the decoder's; every figure counts both stacks, and no layer
keeps (the controller keeps nothing on encoder-decoder models).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..decide.activations import LayerShape
from ..settings import PAGE, Settings, shown

GIB = 2**30
# The largest count or size the estimate takes (2**40 tokens, layers, GiB, ...): beyond, a typo, and floats overflow.
LARGEST = 2**40
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float8": "fp8"}
# An assumption, not a measurement: pinned host<->device copies reach about this over PCIe Gen4 x16, and a
# PCIe Gen5 x16 link usually does better, so it errs on the slow side. Pass the figure measured on your machine.
DEFAULT_HOST_BANDWIDTH_GBPS = 25.0
# Above this share of device memory the saved inputs alone make the memory trigger (memory_high) plausible.
LARGE_SHARE = 0.5

VERDICTS = ("not-needed", "auto", "required", "host-too-small", "cannot-fit")


class EstimateError(ValueError):
    """Input the estimator cannot use; the command line turns it into a one-line error and exit code 2."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The arithmetic of one model x batch x sequence, and what it means for offload. Sizes in bytes."""

    layers: int
    hidden: int
    seq: int
    batch: int
    dtype: str
    dtype_bytes: int
    saved_bytes: int  # checkpointing keeps these on the device for the layer inputs
    freed_bytes: int  # offload moves all of them to the host
    pinned_bytes: int  # per rank: one buffer per layer, rounded up to a 4 KiB page
    copy_bytes: int  # per step: device->host in the forward + host->device in the backward
    host_bandwidth_gbps: float
    copy_seconds: float
    host_available_bytes: int | None
    host_fits: bool | None  # the node's pinned bytes (every rank's) fit the host's available memory
    ranks_per_node: int
    node_pinned_bytes: int
    host_budget_bytes: int | None  # AUTOOFFLOAD_HOST_MEMORY for the node
    budget_layers: int | None  # layers a rank may offload under that budget (its share)
    pinnable_bytes: int | None  # RLIMIT_MEMLOCK where set; None: unlimited or unknown
    pinnable_note: str
    device_memory_bytes: int | None
    device_memory_source: str  # "argument", "nvml" or "unknown"
    seq_high: int
    verdict: str
    recommendation: str
    layer_activation_bytes: int = 0  # one layer's full activations, its input included (no checkpointing)
    kept_layer_bytes: int = 0  # what keeping one layer adds over recomputing it
    keepable_layers: int | None = None  # layers that could keep on the device (None: device memory unknown)
    other_memory_bytes: int = 0
    memory_high: float = 0.9
    keep_margin: float = 0.05  # what keep leaves free below memory_high, a share of the device
    streams: int = 1  # residual streams per token in a layer input (hyper-connections), x hidden
    decoder_layers: int = 0  # an encoder-decoder's decoder stack (``layers`` is then the encoder's)
    target_seq: int | None = None  # its length

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def estimate(
    layers: int,
    hidden: int,
    seq: int,
    batch: int = 1,
    dtype: str = "bf16",
    *,
    device_memory_bytes: int | None = None,
    device_memory_source: str = "argument",
    host_available_bytes: int | None = None,
    host_bandwidth_gbps: float = DEFAULT_HOST_BANDWIDTH_GBPS,
    seq_high: int | None = None,
    layer: LayerShape | None = None,
    other_memory_bytes: int = 0,
    memory_high: float | None = None,
    keep_margin: float | None = None,
    ranks_per_node: int = 1,
    host_budget_bytes: int | None = None,
    pinnable_bytes: int | None = None,
    pinnable_note: str = "",
    streams: int = 1,
    decoder_layers: int = 0,
    target_seq: int | None = None,
) -> Estimate:
    """Pure arithmetic and the recommendation; reads nothing from the machine (the caller passes what it read).

    ``seq_high`` is the sequence length at which ``auto`` switches offload on (default: the Settings default).
    ``layer``: the layer's sizes for the keep figures (default: a Llama-style layer of this hidden size,
    intermediate 4 x hidden, heads of 128); ``memory_high`` and ``keep_margin`` (what keep leaves free below it)
    default to the Settings defaults.
    ``ranks_per_node`` processes share the host: the node needs that many times a rank's pinned bytes, and
    each rank gets that share of ``host_budget_bytes`` (the node's budget, ``AUTOOFFLOAD_HOST_MEMORY``).
    ``streams``: a hyper-connection layer's input is ``streams`` x ``hidden`` wide per token.
    ``decoder_layers`` and ``target_seq``: an encoder-decoder's decoder stack (``layers`` and ``seq`` are then
    the encoder's); the sequence trigger reads the longer of the two lengths.
    """
    dtype = normalize_dtype(dtype)
    for name, value in (
        ("layers", layers),
        ("hidden", hidden),
        ("seq", seq),
        ("batch", batch),
        ("ranks", ranks_per_node),
        ("streams", streams),
    ):
        _require_positive(name, value)
    if decoder_layers:
        _require_positive("decoder layers", decoder_layers)
        _require_positive("target seq", target_seq)
    if device_memory_bytes is not None:
        _require_positive("device memory", device_memory_bytes)
    _require_positive("host bandwidth", host_bandwidth_gbps)
    seq_high = Settings().seq_high if seq_high is None else seq_high

    dtype_bytes = DTYPE_BYTES[dtype]
    per_layer = batch * seq * streams * hidden * dtype_bytes
    per_buffer = -(-per_layer // PAGE) * PAGE
    stacks = [(layers, per_layer, per_buffer)]
    if decoder_layers:
        target = batch * target_seq * streams * hidden * dtype_bytes
        stacks.append((decoder_layers, target, -(-target // PAGE) * PAGE))
    saved = sum(count * nbytes for count, nbytes, _ in stacks)
    pinned = sum(count * buffer for count, _, buffer in stacks)
    trigger_seq = max(seq, target_seq or 0)
    node_pinned = ranks_per_node * pinned
    copy_bytes = 2 * saved
    host_fits = None if host_available_bytes is None else node_pinned <= host_available_bytes
    all_layers = layers + decoder_layers
    budget_layers = None if host_budget_bytes is None else _fitting(stacks, host_budget_bytes // ranks_per_node)
    verdict, text = _recommend(
        saved, node_pinned, trigger_seq, seq_high, device_memory_bytes, host_available_bytes, other_memory_bytes
    )
    if verdict in ("auto", "required", "host-too-small") and budget_layers is not None and budget_layers < all_layers:
        text += (
            f"; the host memory budget ({gib(host_budget_bytes)} for {ranks_per_node} rank(s), "
            f"AUTOOFFLOAD_HOST_MEMORY) caps offload at {budget_layers} of {all_layers} layers"
        )
    if verdict in ("auto", "required", "host-too-small") and pinnable_bytes is not None and pinned > pinnable_bytes:
        text += f"; pinning stops at {gib(pinnable_bytes)} ({pinnable_note}): the rest goes to pageable memory"

    memory_high = Settings().memory_high if memory_high is None else memory_high
    keep_margin = Settings().keep_margin if keep_margin is None else keep_margin
    if layer is None:
        heads = max(hidden // 128, 1)
        layer = LayerShape(hidden, 4 * hidden, heads, heads, hidden // heads, dtype_bytes)
    layer = dataclasses.replace(layer, dtype_bytes=dtype_bytes)
    kept = round(layer.bytes(batch * seq, seq))
    keepable = None
    if device_memory_bytes is not None:
        room = (memory_high - keep_margin) * device_memory_bytes - other_memory_bytes - saved
        keepable = max(0, min(layers, int(room // kept))) if kept > 0 else layers
        keepable = 0 if decoder_layers else keepable
    return Estimate(
        layers=layers,
        hidden=hidden,
        seq=seq,
        batch=batch,
        dtype=dtype,
        dtype_bytes=dtype_bytes,
        saved_bytes=saved,
        freed_bytes=saved,
        pinned_bytes=pinned,
        copy_bytes=copy_bytes,
        host_bandwidth_gbps=float(host_bandwidth_gbps),
        copy_seconds=copy_bytes / (host_bandwidth_gbps * 1e9),
        host_available_bytes=host_available_bytes,
        host_fits=host_fits,
        ranks_per_node=ranks_per_node,
        node_pinned_bytes=node_pinned,
        host_budget_bytes=host_budget_bytes,
        budget_layers=budget_layers,
        pinnable_bytes=pinnable_bytes,
        pinnable_note=pinnable_note,
        device_memory_bytes=device_memory_bytes,
        device_memory_source=device_memory_source if device_memory_bytes is not None else "unknown",
        seq_high=seq_high,
        verdict=verdict,
        recommendation=text,
        layer_activation_bytes=kept + per_layer,
        kept_layer_bytes=kept,
        keepable_layers=keepable,
        other_memory_bytes=other_memory_bytes,
        memory_high=memory_high,
        keep_margin=keep_margin,
        streams=streams,
        decoder_layers=decoder_layers,
        target_seq=target_seq if decoder_layers else None,
    )


def _fitting(stacks: list[tuple[int, int, int]], budget: int) -> int:
    """Layers whose host buffers fit ``budget``, the largest first (the order the controller offloads in)."""
    fitted = 0
    for count, _, buffer in sorted(stacks, key=lambda stack: -stack[2]):
        take = min(count, budget // buffer)
        fitted, budget = fitted + take, budget - take * buffer
        if take < count:
            break
    return fitted


def _recommend(
    saved: int, pinned: int, seq: int, seq_high: int, device: int | None, host: int | None, other: int = 0
) -> tuple[str, str]:
    """Why each branch: the job cannot fit when the rest of the step (``other``: weights, gradients, optimizer
    state) alone fills the device, since offload moves only the saved inputs; offload is needed when the saved
    inputs and that rest cannot fit together; ``auto`` turns it on for long sequences (seq_high) or a full device
    (memory_high, measured at run time, so only hinted at here); and whenever it turns on, the pinned copies must
    fit in host memory."""
    if device and other >= device:
        return "cannot-fit", (
            f"the job cannot fit: the rest of the step (--other-memory, {gib(other)}) alone exceeds device memory "
            f"({gib(device)}), and offload moves only the saved layer inputs ({gib(saved)})"
        )
    share = saved / device if device else None
    if device and saved + other >= device:
        verdict = "required"
        text = f"offload required: the saved inputs alone ({gib(saved)}) exceed device memory ({gib(device)})"
        if other:
            text = (
                f"offload required: the saved inputs ({gib(saved)}) and the rest of the step ({gib(other)}) exceed "
                f"device memory ({gib(device)})"
            )
    elif seq >= seq_high:
        verdict = "auto"
        text = f"auto: offload will switch on for sequences like this (seq {seq} >= AUTOOFFLOAD_SEQ_HIGH={seq_high})"
    elif share is not None and share >= LARGE_SHARE:
        verdict = "auto"
        text = (
            f"auto: the saved inputs take {share:.0%} of device memory; offload switches on when a step's "
            "peak reaches AUTOOFFLOAD_MEMORY_HIGH"
        )
    else:
        against = f"saved inputs are {share:.0%} of device memory" if share is not None else "device memory unknown"
        return "not-needed", f"offload not needed: seq {seq} < AUTOOFFLOAD_SEQ_HIGH={seq_high}, {against}"
    if host is not None and pinned > host:
        need, have = gib(pinned), gib(host)
        return (
            "host-too-small",
            f"host too small: offload needs {need} of pinned host memory on the node, it has {have}",
        )
    return verdict, text


def normalize_dtype(name: str) -> str:
    key = name.strip().lower()
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise EstimateError(f"unknown dtype {shown(name)}; expected one of {', '.join(DTYPE_BYTES)}")
    return key


def _require_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise EstimateError(f"{name} must be a positive number, got {shown(value)}")


def gib(nbytes: float) -> str:
    """Bytes in GiB, or in MiB below one GiB so that small shapes do not print as 0.00."""
    if nbytes < GIB:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / GIB:.2f} GiB"


def seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def render(result: Estimate) -> str:
    """The short table for a terminal."""
    if result.host_available_bytes is None:
        host = "host memory unknown"
    else:
        enough = "enough" if result.host_fits else "NOT enough"
        host = f"the node has {gib(result.host_available_bytes)} available: {enough}"
    if result.device_memory_bytes is None:
        device = "unknown (no --device-memory, no GPU readable through NVML)"
    else:
        share = f"{result.saved_bytes / result.device_memory_bytes:.1%}"
        device = f"{gib(result.device_memory_bytes)} ({result.device_memory_source}); saved inputs are {share} of it"
    all_layers = result.layers + result.decoder_layers
    per_layer = gib(result.pinned_bytes // all_layers)
    budget = "unknown" if result.host_budget_bytes is None else gib(result.host_budget_bytes)
    budget_note = "AUTOOFFLOAD_HOST_MEMORY"
    if result.budget_layers is not None:
        budget_note += f"; fits {result.budget_layers} of {all_layers} layers per rank"
    pinnable = "no limit read" if result.pinnable_bytes is None else gib(result.pinnable_bytes)
    bandwidth = f"{result.host_bandwidth_gbps:g} GB/s"
    rows = [
        ("saved layer inputs on device", gib(result.saved_bytes), "layers x batch x seq x hidden x dtype-bytes"),
        ("freed on device by offload", gib(result.freed_bytes), "every checkpointed layer offloaded"),
        (
            "pinned host memory per rank",
            gib(result.pinned_bytes),
            f"{result.layers} x {per_layer}" if not result.decoder_layers else f"{all_layers} layers, both stacks",
        ),
        ("pinned host memory, node", gib(result.node_pinned_bytes), f"{result.ranks_per_node} rank(s); {host}"),
        ("host memory budget, node", budget, budget_note),
        ("pinnable per process", pinnable, result.pinnable_note),
        ("copy volume per step", gib(result.copy_bytes), "device->host in forward + host->device in backward"),
        ("copy time per step", seconds(result.copy_seconds), f"at {bandwidth}; on the compute stream, so it adds"),
    ]
    head = (
        f"autooffload estimate: {result.layers} layers x hidden {result.hidden}"
        f"{f' x {result.streams} streams' if result.streams > 1 else ''}, batch {result.batch} x seq "
        f"{result.seq}, {result.dtype} ({result.dtype_bytes} B)"
    )
    if result.decoder_layers:
        head = (
            f"autooffload estimate: encoder {result.layers} layers x seq {result.seq} + decoder "
            f"{result.decoder_layers} layers x seq {result.target_seq}, hidden {result.hidden}, batch "
            f"{result.batch}, {result.dtype} ({result.dtype_bytes} B)"
        )
    if result.decoder_layers:
        keepable = ("layers that could keep", "0", "encoder-decoder: autooffload keeps no layer on these models")
    elif result.keepable_layers is None:
        keepable = ("layers that could keep", "unknown", "no device memory given or read")
    else:
        rest = f", {gib(result.other_memory_bytes)} for the rest" if result.other_memory_bytes else " (upper bound)"
        keepable = (
            "layers that could keep",
            f"{result.keepable_layers} of {result.layers}",
            f"under memory_high {result.memory_high:g} less keep_margin {result.keep_margin:g} of the device, "
            f"after the saved inputs{rest}",
        )
    rows += [
        (
            "one layer's full activations",
            gib(result.layer_activation_bytes),
            "what a layer holds run without checkpointing (AUTOOFFLOAD_RECOMPUTE=auto keeps the last layers)",
        ),
        keepable,
    ]
    lines = [head] + [f"  {label:<28}  {value:>11}  {note}" for label, value, note in rows]
    lines += [f"  {'device memory':<28}  {device}", f"  recommendation: {result.recommendation}"]
    return "\n".join(lines)
