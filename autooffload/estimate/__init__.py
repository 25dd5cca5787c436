"""``autooffload estimate``: what offload would free and cost for a model and a sequence length, before a job runs.

No network and no torch work: the model is a local ``config.json`` (or ``--layers/--hidden``).

This module is the command line, and the public names of the three it stands on, so that
``from autooffload import estimate as est`` reaches them all: the arithmetic and its verdict
(:mod:`autooffload.estimate.arithmetic`), reading a config (:mod:`autooffload.estimate.config`) and reading the
machine (:mod:`autooffload.estimate.machine`). :func:`main` calls the machine readers through their module, so
a test that patches them there changes what the command reads.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, NoReturn

from ..settings import Settings, SettingsError, shown
from . import machine
from .arithmetic import (
    DEFAULT_HOST_BANDWIDTH_GBPS,
    DTYPE_ALIASES,
    DTYPE_BYTES,
    GIB,
    LARGE_SHARE,
    LARGEST,
    VERDICTS,
    Estimate,
    EstimateError,
    estimate,
    gib,
    normalize_dtype,
    render,
    seconds,
)
from .config import (
    HIDDEN_KEYS,
    LAYER_KEYS,
    TEXT_CONFIG_KEYS,
    hub_cache,
    local_config,
    read_config,
    read_encoder_decoder,
    read_layer_shape,
    read_streams,
)
from .machine import host_available_bytes, host_budget, host_total_bytes, nvml_total_bytes, pinnable_limit

__all__ = [
    "DEFAULT_HOST_BANDWIDTH_GBPS",
    "DTYPE_ALIASES",
    "DTYPE_BYTES",
    "GIB",
    "HIDDEN_KEYS",
    "LARGE_SHARE",
    "LAYER_KEYS",
    "TEXT_CONFIG_KEYS",
    "VERDICTS",
    "Estimate",
    "EstimateError",
    "build_parser",
    "estimate",
    "gib",
    "host_available_bytes",
    "host_budget",
    "host_total_bytes",
    "hub_cache",
    "local_config",
    "main",
    "normalize_dtype",
    "nvml_total_bytes",
    "pinnable_limit",
    "read_config",
    "read_encoder_decoder",
    "read_layer_shape",
    "read_streams",
    "render",
    "seconds",
]


class _Parser(argparse.ArgumentParser):
    """argparse, but every error is one line on stderr and exit code 2, like the estimator's own errors."""

    def error(self, message: str) -> NoReturn:
        _print_error(message)
        raise SystemExit(2)


def _print_error(message: str) -> None:
    print(f"autooffload estimate: error: {message}", file=sys.stderr)


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = _number(text, kind)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{shown(text)} must be positive")
        return value

    parse.__name__ = kind.__name__
    return parse


def _non_negative(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{shown(text)} must be zero or positive")
    return value


def _number(text: str, kind: type) -> Any:
    """``text`` as ``kind``, finite and at most :data:`LARGEST` (a count, GiB or GB/s: anything larger is a typo,
    and would overflow the arithmetic's floats)."""
    try:
        value = kind(text)
    except (ValueError, OverflowError):
        expected = "number" if kind is float else "whole number"
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a {expected}") from None
    if isinstance(value, float) and math.isnan(value):  # float() reads "nan"
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number")
    if abs(value) > LARGEST:  # infinities included
        raise argparse.ArgumentTypeError(f"{shown(text)} is out of range (at most 2**40)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="autooffload estimate",
        description="What offloading checkpointed layer inputs frees on the device and costs in copies.",
    )
    parser.add_argument(
        "config",
        nargs="?",
        help="a local config.json of a transformers model, its folder, or a Hub id (Qwen/Qwen3-8B) already in the "
        "local Hugging Face cache; nothing is downloaded",
    )
    parser.add_argument("--layers", type=_positive(int), help="checkpointed layers (overrides the config)")
    parser.add_argument("--hidden", type=_positive(int), help="hidden size (overrides the config)")
    parser.add_argument(
        "--seq",
        type=_positive(int),
        required=True,
        help="sequence length in tokens (an encoder-decoder: the source length its encoder's layers see)",
    )
    parser.add_argument(
        "--target-seq",
        type=_positive(int),
        help="an encoder-decoder config's target length (the decoder's tokens); required for one, refused otherwise",
    )
    parser.add_argument("--batch", type=_positive(int), default=1, help="micro-batch size (default 1)")
    parser.add_argument("--dtype", default="bf16", help=f"one of {', '.join(DTYPE_BYTES)} (default bf16)")
    parser.add_argument(
        "--device-memory",
        type=_positive(float),
        metavar="GIB",
        help="device memory in GiB (2^30 bytes; an '80 GB' H100 has 79.6); default: the first GPU's total from NVML",
    )
    parser.add_argument(
        "--host-bandwidth",
        type=_positive(float),
        default=DEFAULT_HOST_BANDWIDTH_GBPS,
        metavar="GB/S",
        help=f"host<->device copy bandwidth in GB/s (default {DEFAULT_HOST_BANDWIDTH_GBPS:g}: an assumption, "
        "about PCIe Gen4 x16 with pinned memory and conservative for Gen5; measure yours)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=_positive(int),
        default=1,
        metavar="N",
        help="processes sharing this host (e.g. GPUs per node); the node's host memory is checked for all of them",
    )
    parser.add_argument(
        "--other-memory",
        type=_non_negative,
        default=0.0,
        metavar="GIB",
        help="device memory the rest of the step takes (weights, gradients, optimizer state) in GiB, for the "
        "number of layers that could keep (default 0: an upper bound)",
    )
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the estimate; 0 on success, 2 on bad input (argparse's own errors exit 2 as well)."""
    options = build_parser().parse_args(argv)
    try:
        layers = hidden = None
        if options.config is not None:
            options.config = local_config(options.config)
            layers, hidden = read_config(options.config)
        layers = options.layers or layers
        hidden = options.hidden or hidden
        if layers is None or hidden is None:
            raise EstimateError("give a config.json or both --layers and --hidden")
        stacks = read_encoder_decoder(options.config) if options.config is not None else None
        decoder_layers = 0
        if stacks is not None:
            if options.target_seq is None:
                raise EstimateError(
                    f"{options.config} is an encoder-decoder config: pass --target-seq, the decoder's length "
                    "(--seq is the encoder's)"
                )
            layers, decoder_layers = (options.layers or stacks[0]), stacks[1]
        elif options.target_seq is not None:
            raise EstimateError("--target-seq is for encoder-decoder configs (is_encoder_decoder); this has one stack")
        settings = Settings.from_env()
        pinnable, note = machine.pinnable_limit()
        if options.device_memory is not None:
            device, source = round(options.device_memory * GIB), "argument"
        else:
            device, source = machine.nvml_total_bytes(), "nvml"
        settings = Settings.from_env()
        dtype = normalize_dtype(options.dtype)
        layer = read_layer_shape(options.config, hidden, DTYPE_BYTES[dtype]) if options.config else None
        result = estimate(
            layers,
            hidden,
            options.seq,
            options.batch,
            dtype,
            device_memory_bytes=device,
            device_memory_source=source,
            host_available_bytes=machine.host_available_bytes(),
            host_bandwidth_gbps=options.host_bandwidth,
            seq_high=settings.seq_high,
            layer=layer,
            other_memory_bytes=round(options.other_memory * GIB),
            memory_high=settings.memory_high,
            keep_margin=settings.keep_margin,
            ranks_per_node=options.ranks_per_node,
            host_budget_bytes=machine.host_budget(settings.host_memory),
            pinnable_bytes=pinnable,
            pinnable_note=note,
            streams=read_streams(options.config) if options.config else 1,
            decoder_layers=decoder_layers,
            target_seq=options.target_seq,
        )
    except (EstimateError, SettingsError) as error:
        _print_error(str(error))
        return 2
    except (ArithmeticError, ValueError, RecursionError) as error:  # what the checks above did not foresee
        _print_error(f"the input is out of range for the arithmetic ({type(error).__name__}: {shown(str(error))})")
        return 2
    print(json.dumps(result.to_dict(), indent=2) if options.json else render(result))
    return 0
