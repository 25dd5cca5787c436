"""autooffload for PyTorch Lightning: a ``Callback`` that does for ``lightning.pytorch.Trainer`` what
:class:`~autooffload.AutoOffloadCallback` does for transformers' Trainer::

    import lightning.pytorch as pl
    from autooffload.integrations.lightning import AutoOffload

    trainer = pl.Trainer(callbacks=[AutoOffload()], accumulate_grad_batches=4)
    trainer.fit(module)  # a LightningModule whose transformers model has checkpointing on

What it controls: the LightningModule's first module (itself included) that has a ``config`` (a transformers
model, or a PEFT model around one), else the LightningModule; ``model=`` names another (an attribute's name or a
function of the LightningModule). Checkpointing must be on before ``fit`` (``activation_checkpointing_enable()``
or ``gradient_checkpointing_enable()`` in the module's ``__init__`` or ``configure_model``).

The events, in Lightning's order (lightning 2.6):

- ``on_train_start`` (the model is on its device, wrapped for DDP/FSDP, the optimizers built, a checkpoint's
  callback state loaded): a fresh run starts fresh, a run resumed from a checkpoint with this callback's state
  continues it; then ``attach`` and each rank's history file opened (cut back to the step the run starts from).
- Each micro-batch is decided by the controller's pre-forward hook; one optimizer step ends at the first
  ``on_train_batch_end`` where ``trainer.global_step`` moved, so ``accumulate_grad_batches`` micro-batches make one
  step, as they do Lightning's (an epoch's last, shorter accumulation included).
- At each step's end the ``autooffload/*`` values go to Lightning's loggers (``pl_module.log``, on step, this
  rank's values) and, every ``log_every_n_steps``, the history records to
  ``<trainer.log_dir>/autooffload/history[-rank{N}].jsonl``.
- ``state_dict`` / ``load_state_dict``: the controller's state in Lightning's checkpoints (one state, rank 0's,
  as Lightning saves one checkpoint: a resumed rank 1 counts its moved bytes on from rank 0's).
- ``on_train_end``: the summary (a collective on every rank; rank 0 logs it), the history written, detached.
  ``on_exception``: the history written and detached, without a collective (the other ranks may not get there).

No rescue of out-of-memory steps: Lightning runs a micro-batch's backward inside its optimizer closure and keeps
the accumulated micro-batches nowhere, so no call a callback can wrap reruns a step (the ``rescue`` setting, if
asked for, gets one ``rescue-off`` warning). Lightning is imported here only: ``import autooffload`` does not.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..console import say
from ..controller import OffloadController
from ..decide.policy import Policy
from ..guard import guarded, passes_on
from ..history import history_path, truncate_history
from ..observe.probe import MemoryProbe
from ..settings import ENV_PREFIX, Settings

try:
    from lightning.pytorch import Callback
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "autooffload.integrations.lightning needs PyTorch Lightning: pip install 'autooffload[lightning]'"
    ) from error


RESCUE_REFUSAL = (
    "out-of-memory steps are not rescued under Lightning: it runs each micro-batch's backward inside its "
    "optimizer closure and keeps no step's micro-batches, so no call a callback can wrap reruns a step"
)


class AutoOffload(Callback):
    """The Lightning callback; the module docstring says what it does at each event.

    The settings are :class:`~autooffload.AutoOffloadCallback`'s: keyword arguments over ``AUTOOFFLOAD_*`` over
    the defaults (:class:`~autooffload.Settings`), a ``probe`` (default ``"auto"``: NVML on the model's GPU) and
    a ``policy`` (a name or an object). ``model``: what to control, an attribute name of the LightningModule or a
    function of it (default: see the module docstring). ``history_dir``: where the history goes (default:
    ``trainer.log_dir``, which is ``default_root_dir`` without a logger).
    """

    def __init__(
        self,
        mode: str | None = None,
        memory_high: float | None = None,
        memory_low: float | None = None,
        seq_high: int | None = None,
        seq_low: int | None = None,
        min_steps: int | None = None,
        compile_max_switches: int | None = None,
        engine: str | None = None,
        sync_ranks: bool | None = None,
        recompute: str | None = None,
        *,
        probe: MemoryProbe | str | None = "auto",
        policy: Policy | str | None = None,
        rescue: bool | None = None,
        host_memory: str | float | None = None,
        keep_margin: float | None = None,
        model: str | Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        history_dir: str | os.PathLike | None = None,
    ) -> None:
        given = dict(
            mode=mode, memory_high=memory_high, memory_low=memory_low, seq_high=seq_high, seq_low=seq_low,
            min_steps=min_steps, compile_max_switches=compile_max_switches, engine=engine, sync_ranks=sync_ranks,
            recompute=recompute, rescue=rescue, host_memory=host_memory, keep_margin=keep_margin,
            policy=policy if isinstance(policy, str) else None,
        )  # fmt: skip
        self.explicit = {key: value for key, value in given.items() if value is not None}
        self.controller = OffloadController(
            Settings.from_env(**self.explicit), probe=probe, policy=None if isinstance(policy, str) else policy
        )
        self.model = model
        self.history_dir = history_dir
        self.history_path: Path | None = None
        self._saved: dict[str, Any] | None = None  # a checkpoint's state, loaded before on_train_start
        self._global_step = 0  # trainer.global_step when the last step ended
        self._step_open = False

    # ---- the run -------------------------------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # trainer.log_dir is a broadcast under DDP: read first on every rank, whatever fails below on one of them (a
        # rank that skipped it would leave the others in it, then in DDP's next collective: gloo aborts, or a hang).
        directory = self.history_dir
        if directory is None:
            with contextlib.suppress(Exception):
                directory = trainer.log_dir
        self._start(trainer, pl_module, directory)

    # Its own work: the log directory's read (every rank, a failure suppressed), then the guarded start.
    on_train_start = passes_on(on_train_start, "Lightning on_train_start")

    @guarded("Lightning on_train_start", always=True)
    def _start(self, trainer: Any, pl_module: Any, directory: str | os.PathLike | None) -> None:
        saved, self._saved = self._saved, None
        if self.controller.failed:  # gave up in this fit already (loading its checkpoint's state)
            self.controller.attach(self.controlled(pl_module))  # attaches nothing; under torch.distributed, joins
            return
        if saved is not None:
            self.controller.load_state_dict(saved)
        else:
            self.controller.reset()
        self._global_step, self._step_open = trainer.global_step, False
        optimizers = getattr(trainer, "optimizers", None) or [None]
        self.controller.attach(self.controlled(pl_module), optimizer=optimizers[0])
        self._refuse_rescue()
        self._open_history(trainer, directory)

    def controlled(self, pl_module: torch.nn.Module) -> torch.nn.Module:
        """The module the controller attaches to (the ``model`` argument; see the module docstring)."""
        if callable(self.model):
            return self.model(pl_module)
        if isinstance(self.model, str):
            return getattr(pl_module, self.model)
        return next((m for m in pl_module.modules() if getattr(m, "config", None) is not None), pl_module)

    @guarded("Lightning on_train_batch_start")
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._step_open:  # the step's first micro-batch: its peak starts here
            self._step_open = True
            self.controller.begin_step()

    @guarded("Lightning on_train_batch_end")
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._global_step:
            return  # a micro-batch that accumulates: the step goes on
        self._global_step, self._step_open = trainer.global_step, False
        self.controller.end_step()
        if self.controller.switch is None:
            return
        pl_module.log_dict(self.controller.metrics(), on_step=True, on_epoch=False, batch_size=1)
        if trainer.global_step % max(int(getattr(trainer, "log_every_n_steps", 1) or 1), 1) == 0:
            self._write_history()

    @guarded("Lightning on_validation_end")
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.controller.note_side_work()

    @guarded("Lightning on_train_end", always=True)
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        attached = self.controller.switch is not None
        summary = self.controller.finish()  # every rank, one that gave up too: a collective under torch.distributed
        if attached and trainer.is_global_zero:
            say(summary)
        self._write_history()
        self.controller.detach()

    @guarded("Lightning on_exception", always=True)
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """``fit`` raised (or was interrupted): write the history and detach, with no collective; a give-up ends
        with the run, so the next ``fit`` tries again."""
        self._write_history()
        self.controller.detach()
        self.controller.end_run()

    # ---- checkpoints ---------------------------------------------------------------------------------

    @guarded("Lightning state_dict", {})
    def state_dict(self) -> dict[str, Any]:
        """What Lightning saves: nothing where the run gave up or the state could not be read (a resume then starts
        afresh)."""
        return {"controller_state": self.controller.state_dict()}

    @guarded("Lightning load_state_dict")
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning loads callback states before on_train_start: keep it until the run starts there.
        self._saved = state_dict.get("controller_state")

    @guarded("Lightning on_save_checkpoint")
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.controller.note_side_work()
        self._write_history()

    # ---- history and refusals ------------------------------------------------------------------------

    def _open_history(self, trainer: Any, directory: str | os.PathLike | None) -> None:
        """Each rank's history file, cut back to the step the run starts from (as the Trainer callback's)."""
        self.history_path = None
        if self.controller.switch is None or not directory:
            return
        self.controller.history.clear()
        self.history_path = history_path(directory, trainer.global_rank, trainer.world_size)
        try:
            truncate_history(self.history_path, self.controller.step)
        except OSError as error:
            self.controller.warn("history-write", f"cannot rewrite the history at {self.history_path} ({error})")

    def _write_history(self) -> None:
        if self.history_path is not None:
            self.controller.write_history(self.history_path)

    def _refuse_rescue(self) -> None:
        asked = "rescue" in self.explicit or ENV_PREFIX + "RESCUE" in os.environ
        if asked and self.controller.settings.rescue and self.controller.switch is not None:
            self.controller.warn("rescue-off", RESCUE_REFUSAL)
