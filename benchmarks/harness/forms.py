"""The other ways to hold checkpointed inputs that the benchmarks hold autooffload against: torch's ``save_on_cpu``
around transformers' checkpoint (the wrap transformers' ``offload=True`` makes), transformers' ``offload=True`` as it
runs on a device, torchtitan's selective checkpointing policy and torchtune's ``OffloadActivations``."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import sys
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from autooffload import OffloadStats
from autooffload.apply.host_memory import page_round, pageable
from harness.models import enable_checkpointing, has_native_offload


def install_save_on_cpu(model: torch.nn.Module, device: str, stats: OffloadStats) -> None:
    """The wrap transformers' native offload makes (checkpoint under torch's ``save_on_cpu``), for releases
    and devices where it cannot be used. torch's own pack and unpack functions do the work; the pack is
    wrapped only to count the bytes. Pinned memory only on an accelerator, as on a CPU-only build there is none."""

    def checkpoint_save_on_cpu(function, *args, **kwargs):
        inner = save_on_cpu(pin_memory=device != "cpu", device_type=device)

        def pack(tensor: torch.Tensor) -> Any:
            stats.add(tensor.numel() * tensor.element_size())
            return inner.pack_hook(tensor)

        with saved_tensors_hooks(pack, inner.unpack_hook):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)

    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = checkpoint_save_on_cpu


class HostSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
    """``save_on_cpu`` on a machine without pinned memory: every tensor saved in the block is copied into a host
    buffer of its own outside torch's allocator (an anonymous mapping) and copied back at its unpack."""

    def __init__(self, pin_memory: bool = False, device_type: str = "cpu") -> None:
        def pack(tensor: torch.Tensor) -> tuple:
            nbytes = tensor.numel() * tensor.element_size()
            host = pageable(page_round(nbytes))[:nbytes].view(tensor.dtype).view(tensor.shape)
            host.copy_(tensor)
            return tensor.device, host

        def unpack(packed: tuple) -> torch.Tensor:
            device, host = packed
            return torch.empty(host.shape, dtype=host.dtype, device=device).copy_(host)

        super().__init__(pack, unpack)


@contextlib.contextmanager
def transformers_offload_on_this_machine():
    """transformers' ``offload=True`` as it runs on a device: on a CPU-only build its ``save_on_cpu`` is
    :class:`HostSaveOnCpu` (pinning fails there at the first forward)."""
    import transformers.modeling_utils as modeling_utils

    original = modeling_utils.save_on_cpu
    if not torch.cuda.is_available():
        modeling_utils.save_on_cpu = HostSaveOnCpu
    try:
        yield
    finally:
        modeling_utils.save_on_cpu = original


def torchtitan_policy() -> Any:
    """torchtitan's op-level selective checkpointing policy, as a ``context_fn``: inside each checkpointed layer
    the outputs of attention and of every other matmul are saved, everything else is recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    saved = {
        aten.mm.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    cudnn = getattr(aten, "_scaled_dot_product_cudnn_attention", None)
    if cudnn is not None:
        saved.add(cudnn.default)

    def context_fn() -> Any:
        counts: dict[str, int] = defaultdict(int)

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            key = "recompute" if ctx.is_recompute else "forward"
            if op == aten.mm.default:
                counts[key] += 1
            keep = op in saved and not (op == aten.mm.default and counts[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def transformers_options() -> set[str]:
    """The checkpointing options this transformers release takes: ``every_n_layers`` (5.16), ``offload`` (5.17)."""
    model = transformers.PreTrainedModel
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    return set(inspect.signature(enable).parameters)


def torchtune_offloading() -> tuple[Any, str]:
    """torchtune's ``OffloadActivations`` and ``NoOpManager``, and where they came from; ``(None, why)`` where not.

    ``import torchtune`` needs torchao and the package's data stack (``datasets``, ``torchdata``, ...), which the
    GPU machine lacks; its activation offloading needs none of them. Where the package is installed (its wheel
    carried, ``pip install --no-deps``) but does not import, its ``training/_activation_offloading.py`` is loaded
    on its own, with three names it imports only for other paths (torchao's ``NF4Tensor``, an ``isinstance`` in
    an error path; ``TiedLinear`` and ``get_logger``, for its recipe helper) given stand-ins: the class itself
    runs unchanged."""
    try:
        import torchtune
        from torchtune.training import NoOpManager, OffloadActivations

        return (OffloadActivations, NoOpManager), f"torchtune {torchtune.__version__}"
    except Exception as error:  # ImportError, or a package that does not import on this torch: said, and loaded alone
        why = f"import torchtune failed: {type(error).__name__}: {' '.join(str(error).split())}"
    spec = importlib.util.find_spec("torchtune") if "torchtune" not in sys.modules else None
    if spec is None or not spec.submodule_search_locations:
        return None, f"torchtune is not installed ({why})"
    path = Path(next(iter(spec.submodule_search_locations))) / "training" / "_activation_offloading.py"
    stand_ins = {
        "torchao": types.ModuleType("torchao"),
        "torchao.dtypes": types.ModuleType("torchao.dtypes"),
        "torchao.dtypes.nf4tensor": types.ModuleType("torchao.dtypes.nf4tensor"),
        "torchtune": types.ModuleType("torchtune"),
        "torchtune.modules": types.ModuleType("torchtune.modules"),
        "torchtune.utils": types.ModuleType("torchtune.utils"),
    }
    stand_ins["torchao"].__version__ = "0"  # type: ignore[attr-defined]
    stand_ins["torchao.dtypes.nf4tensor"].NF4Tensor = type("NF4Tensor", (), {})  # type: ignore[attr-defined]
    stand_ins["torchtune.modules"].TiedLinear = type("TiedLinear", (), {})  # type: ignore[attr-defined]
    stand_ins["torchtune.utils"].get_logger = lambda level=None: logging.getLogger("torchtune")  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in stand_ins}
    try:
        sys.modules.update(stand_ins)
        module_spec = importlib.util.spec_from_file_location("torchtune_activation_offloading", path)
        module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as error:
        return None, f"{why}; loading {path.name} alone failed too ({type(error).__name__}: {error})"
    finally:
        for name, before in saved.items():
            sys.modules.pop(name) if before is None else sys.modules.__setitem__(name, before)
    version = _installed_version("torchtune")
    return (module.OffloadActivations, module.NoOpManager), f"torchtune {version}, {path.name} loaded alone ({why})"


def _installed_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


class Installed:
    """A mode installed on a model shared by every mode before each of its steps and taken off after, so that modes
    interleave step by step (a fair comparison on a machine whose load drifts): checkpointing, with transformers'
    ``offload=True`` (``offload``: on a device whose release has it, else the ``save_on_cpu`` wrap, its bytes
    counted in ``stats``), or with an autooffload ``controller``, which lives as long as the mode does: re-attaching
    keeps its policy state and its host memory, as in one continuous run."""

    def __init__(self, model: torch.nn.Module, device: str, offload: bool = False, controller: Any = None) -> None:
        self.model, self.device, self.controller = model, device, controller
        self.native = offload and device != "cpu" and has_native_offload(model)
        self.stats = OffloadStats() if offload and not self.native else None

    def activate(self) -> None:
        enable_checkpointing(self.model, native_offload=self.native)
        if self.stats is not None:
            install_save_on_cpu(self.model, self.device, self.stats)
        if self.controller is not None:
            self.controller.attach(self.model)

    def deactivate(self) -> None:
        if self.controller is not None:
            self.controller.detach()
