"""The Trainer adapter: a thin layer that feeds Trainer's events to an :class:`OffloadController`.

Trainer enables checkpointing inside ``train()``, after ``on_init_end`` and before ``on_train_begin``, so
the controller attaches in ``on_train_begin``. That also repairs what transformers made of ``offload``:
before 5.17 the key reaches torch's checkpoint and fails at the first forward; from 5.17 any truthy value,
``"auto"`` included, means always-on. Installing autooffload's functions replaces both.

Logs: Trainer appends a copy of ``logs`` to ``state.log_history`` and then calls the reporting callbacks
(TensorBoard, W&B) before user callbacks, so keys added in ``on_log`` would reach neither. The callback
therefore adds its keys on the way in, by wrapping the ``log`` method of the Trainer that runs it.
"""

from __future__ import annotations

import inspect
import os
import weakref
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from . import lifecycle
from .apply.compile_guard import is_compiled
from .console import say
from .controller import OffloadController
from .decide.policy import Policy
from .guard import guarded, in_step, nothing, passes_on, shielded_method
from .history import history_path, truncate_history
from .observe.paths import deepspeed_config_warning, trainer_offload_warning
from .observe.probe import MemoryProbe
from .settings import ENV_PREFIX, Settings, SettingsError, offload_mode

PEAKED_DELTA = "train_mem_gpu_peaked_delta"
# The log wrappers autooffload put on a Trainer (each calls its ``__wrapped__``): known by identity, never by an
# attribute (a MagicMock a test patches ``trainer.log`` with answers every one).
_LOG_WRAPPERS: weakref.WeakSet[Any] = weakref.WeakSet()


def checkpointing_kwargs(args: Any) -> dict[str, Any]:
    """The checkpointing kwargs from TrainingArguments, under either name (``activation_`` from 5.23)."""
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        value = getattr(args, name, None)
        if isinstance(value, dict) and value:
            return value
    return {}


# Methods Trainer calls that the fault matrix, which attaches to a built Trainer and restores no callback object, does
# not reach as entry points: shielded, their failure given up with at the next entry point (autooffload.guard).
INIT_END = in_step("the callback's settings at Trainer's init")
RESTORED = in_step("the callback's restored state")


def _controller(explicit: dict[str, Any], probe: Any, policy: Any) -> OffloadController:
    """The controller; where building it fails (not on a SettingsError), one that gave up (its join: at attach)."""
    try:
        return OffloadController(Settings.from_env(**explicit), probe=probe, policy=policy)
    except SettingsError:
        raise
    except Exception as error:
        controller = OffloadController(Settings(mode="off"), probe=None)
        controller.give_up("the callback's construction", error)
        return controller


class AutoOffloadCallback(TrainerCallback, ExportableState):
    """Offload checkpointed activations to host memory when, and only when, a step needs it.

    Arguments override ``AUTOOFFLOAD_*`` environment variables, which override the ``offload`` key of the
    checkpointing kwargs, which overrides the defaults (see :class:`~autooffload.settings.Settings`).
    ``probe`` replaces the NVML reading. ``policy`` is a policy's name (the ``policy`` setting) or an object
    that replaces the named policies. To rescue out-of-memory steps as well, use :func:`attach`.
    """

    _latest: weakref.ReferenceType | None = None

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
    ) -> None:
        given = dict(
            mode=mode,
            memory_high=memory_high,
            memory_low=memory_low,
            seq_high=seq_high,
            seq_low=seq_low,
            min_steps=min_steps,
            compile_max_switches=compile_max_switches,
            engine=engine,
            policy=policy if isinstance(policy, str) else None,
            rescue=rescue,
            sync_ranks=sync_ranks,
            recompute=recompute,
            host_memory=host_memory,
            keep_margin=keep_margin,
        )
        policy = None if isinstance(policy, str) else policy
        self.explicit = {k: v for k, v in given.items() if v is not None}
        self.controller = _controller(self.explicit, probe, policy)
        self._log_wrapped = False
        self._training = False  # from on_train_begin to on_train_end (or abandon)
        self.history_path: Path | None = None
        self._predecessor = AutoOffloadCallback._latest
        AutoOffloadCallback._latest = weakref.ref(self)

    # ---- settings from TrainingArguments -------------------------------------------------------------

    def _resolve_settings(self, args: Any) -> None:
        mode = offload_mode(checkpointing_kwargs(args).get("offload"))
        settings = self.controller.settings
        if mode is not None and "mode" not in self.explicit and ENV_PREFIX + "MODE" not in os.environ:
            settings = Settings.from_env(**{**self.explicit, "mode": mode})
        self.controller.settings = settings

    @shielded_method(INIT_END, lambda callback: callback.controller.faults, nothing, raises=(SettingsError,))
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Settings as the training arguments say, already on a built Trainer (``on_train_begin`` reads them again:
        where this fails, the run gives up there)."""
        self._resolve_settings(args)

    # ---- training ------------------------------------------------------------------------------------

    @guarded("on_train_begin", always=True)
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None, **kwargs: Any
    ) -> None:
        if self._training:  # the last train() raised, which calls no on_train_end (attach(trainer) ends it then)
            self.abandon()
        self._training = True
        if self.controller.failed:  # gave up in this train() already (saving its state as the run began)
            if model is not None:
                self.controller.attach(model)  # attaches nothing; under torch.distributed, joins the other ranks
            return
        self._resolve_settings(args)
        saved = self._saved_state(state) if lifecycle.resumed(state) else None
        if saved is not None:
            self.controller.load_state_dict(saved)  # a failure gives up this run; attach below still joins
        else:
            self.controller.reset()
        trainer = lifecycle.running_trainer(Trainer)
        offloading = trainer_offload_warning(args)
        if offloading is not None:  # every rank reads the same arguments: none attaches, none joins the others
            self.controller.warn("trl-offloading", offloading)
            return
        compiled = bool(getattr(args, "torch_compile", False)) or None
        if trainer is not None and compiled is None:
            compiled = is_compiled(trainer.model_wrapped) or None
        optimizer = kwargs.get("optimizer") or getattr(trainer, "optimizer", None)
        if model is not None:  # also after giving up: under torch.distributed the other ranks join there
            self.controller.attach(model, compiled=compiled, optimizer=optimizer)
        self._open_history(args)
        self._warn_deepspeed(trainer)
        self._wrap_log(trainer)

    @guarded("on_step_begin")
    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.controller.memory.optimizer is None and optimizer is not None:
            self.controller.memory.optimizer = optimizer
        self.controller.begin_step()

    @guarded("on_step_end")
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.controller.end_step()

    @guarded("on_evaluate")
    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.controller.note_side_work()

    @guarded("on_save")
    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.controller.note_side_work()
        self._write_history()

    @guarded("on_log")
    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: Any = None, **kwargs: Any
    ) -> None:
        self._write_history()
        # Only where no Trainer was found to wrap: reporting callbacks before this one miss the keys.
        metrics = {} if self._log_wrapped else self._metrics_for(logs)
        if metrics:
            logs.update(metrics)
            if state.log_history:
                state.log_history[-1].update(metrics)

    def _metrics_for(self, logs: dict[str, float] | None) -> dict[str, float]:
        """The ``autooffload/*`` keys for a training log (one with a loss) while attached; none otherwise."""
        if logs is None or "loss" not in logs or self.controller.switch is None:
            return {}
        return self.controller.metrics()

    @guarded("on_train_end", always=True)
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._training = False
        attached = self.controller.switch is not None
        summary = self.controller.finish()  # every rank, one that gave up too: a collective under torch.distributed
        if attached and state.is_world_process_zero:
            say(summary)
        self._write_history()
        self.controller.detach()

    def abandon(self) -> None:
        """``train()`` raised: write the history and detach, as ``on_train_end`` would (without its collective).
        The user's error is the one to see: a failure of ours here is a warning beside it, and each part of the
        clean-up runs whether the one before it failed or not."""
        self._training = False
        for part in (self._write_history, self.controller.detach, self.controller.end_run):
            try:
                part()
            except Exception as error:
                self.controller.warn(
                    "failed",
                    f"internal error cleaning up after train() raised ({type(error).__name__}: {error}); the error "
                    "train() raised goes on (please report this with the model's config)",
                )

    # ---- history -------------------------------------------------------------------------------------

    def _open_history(self, args: Any) -> None:
        """Each rank's history file under ``output_dir``, cut back to the step this run starts from: a resumed
        run appends after its checkpoint's step, and the steps an earlier run wrote past it are dropped."""
        output_dir = getattr(args, "output_dir", None)
        if self.controller.switch is None or not output_dir:
            self.history_path = None
            return
        self.controller.history.clear()
        rank, world = getattr(args, "process_index", 0), getattr(args, "world_size", 1)
        self.history_path = history_path(output_dir, rank, world)
        try:
            truncate_history(self.history_path, self.controller.step)
        except OSError as error:
            self.controller.warn("history-write", f"cannot rewrite the history at {self.history_path} ({error})")

    def _write_history(self) -> None:
        if self.history_path is not None:
            self.controller.write_history(self.history_path)

    def _warn_deepspeed(self, trainer: Trainer | None) -> None:
        plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
        message = deepspeed_config_warning(getattr(plugin, "deepspeed_config", None))
        if message is not None:
            self.controller.warn("deepspeed-config", message)

    def _wrap_log(self, trainer: Trainer | None) -> None:
        self._log_wrapped = False
        if trainer is None:
            return
        log: Any = trainer.log
        if log in _LOG_WRAPPERS:
            log = log.__wrapped__

        def log_with_autooffload(logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            self._add_metrics(logs)
            return log(logs, *args, **kwargs)

        log_with_autooffload.__wrapped__ = log  # type: ignore[attr-defined]
        passes_on(log_with_autooffload, "the Trainer's log")
        _LOG_WRAPPERS.add(log_with_autooffload)
        trainer.log = log_with_autooffload  # type: ignore[method-assign]
        self._log_wrapped = True

    @guarded("the Trainer's log")
    def _add_metrics(self, logs: dict[str, float]) -> None:
        """Our keys into ``logs`` on their way into Trainer's ``log``, all or none: a failure reading them (an entry
        point: one warning, plain checkpointing) lets the log go out as Trainer made it."""
        metrics = self._metrics_for(logs)
        self._restore_peaked_delta(logs)
        logs.update(metrics)

    def _restore_peaked_delta(self, logs: dict[str, float]) -> None:
        """Trainer's ``train_mem_gpu_peaked_delta`` (``skip_memory_metrics=False``) is torch's peak counter at
        the end of ``train()`` minus what is allocated then; the probe resets that counter every step (see
        :class:`~autooffload.observe.probe.NvmlProbe` for why), so the metric would be the last step's
        peak. The probe kept the run's peak: put it back. The metrics dict is the one ``train()`` returns too.
        """
        run_peaked_delta = getattr(self.controller.memory.probe, "peaked_delta", None)
        if PEAKED_DELTA not in logs or run_peaked_delta is None:
            return
        try:
            logs[PEAKED_DELTA] = max(logs[PEAKED_DELTA], run_peaked_delta())
        except Exception as error:  # a metric must not stop training
            self.controller.warn("peaked-delta", f"{PEAKED_DELTA} may miss earlier steps' peaks ({error!r})")

    # ---- checkpoints ---------------------------------------------------------------------------------

    def _saved_state(self, state: Any) -> dict[str, Any] | None:
        # Trainer restores callback objects only with ``restore_callback_states_from_checkpoint=True``, but on
        # resume it always loads ``stateful_callbacks`` from the checkpoint into ``state``: read ours from there.
        entry = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__)
        if isinstance(entry, list):
            entry = entry[0] if entry else None
        return (entry or {}).get("attributes", {}).get("controller_state")

    @guarded("the callback's state", {"args": {}, "attributes": {}}, always=True)
    def state(self) -> dict[str, Any]:
        """What Trainer saves in a checkpoint; without the controller's state where that could not be read (a run
        that gave up, or a failure saving it): a resumed run then starts afresh."""
        saved = self._controller_state()
        return {"args": dict(self.explicit), "attributes": {} if saved is None else {"controller_state": saved}}

    @guarded("save")
    def _controller_state(self) -> dict[str, Any] | None:
        return self.controller.state_dict()

    @property
    def controller_state(self) -> dict[str, Any]:
        return self.controller.state_dict()

    @controller_state.setter
    @shielded_method(
        RESTORED, lambda callback: callback.controller.faults, lambda c, value: c.controller.load_state_dict(value)
    )
    def controller_state(self, value: dict[str, Any]) -> None:
        # On resume Trainer rebuilds this callback from ``state()["args"]`` and sets the attributes. A probe
        # or policy object cannot go through JSON, so take them from the instance this one replaces.
        previous = self._predecessor() if self._predecessor is not None else None
        if previous is not None and previous is not self:
            self.controller.memory.choice = previous.controller.memory.choice
            self.controller.planner.choice = previous.controller.planner.choice
        self.controller.load_state_dict(value)


def attach(trainer: Trainer, **kwargs: Any) -> AutoOffloadCallback:
    """Add autooffload to a built Trainer: the callback, and the rescue of out-of-memory steps.

    Uses the trainer's :class:`AutoOffloadCallback` if it has one (``kwargs`` must then be empty), else adds
    one built from ``kwargs``. A callback cannot catch an exception, so the rescue wraps
    ``trainer.training_step`` on this instance (see :mod:`autooffload.rescue`); it looks the callback up at
    every call, since resuming with ``restore_callback_states_from_checkpoint`` replaces it. Where a rerun
    is not safe (DeepSpeed, FSDP, a Trainer that overrides ``_prepare_inputs`` like TRL's GRPO), there is no
    rescue, and one warning says why.
    """
    try:  # a failure of autooffload's gives up (one warning, plain checkpointing); it does not stop the job
        return _attach(trainer, kwargs)
    except (SettingsError, _CallersArguments):
        raise
    except Exception as error:
        if (callback := _current(trainer)) is None:
            trainer.add_callback(callback := AutoOffloadCallback(mode="off", probe=None))
        callback.controller.give_up("attach(trainer)", error)
        return callback


def _current(trainer: Trainer) -> AutoOffloadCallback | None:
    return next((c for c in trainer.callback_handler.callbacks if isinstance(c, AutoOffloadCallback)), None)


class _CallersArguments(TypeError):
    """``attach(trainer, ...)``'s arguments are wrong: the caller's error, raised as it is (any other ``TypeError``
    inside ``attach`` is autooffload's, and gives up)."""


def _attach(trainer: Trainer, kwargs: dict[str, Any]) -> AutoOffloadCallback:
    from .rescue import clean_up_when_train_raises, rescue_refusal, with_rescue

    found = _current(trainer)
    if found is None:
        try:
            inspect.signature(AutoOffloadCallback).bind(**kwargs)
        except TypeError as error:
            raise _CallersArguments(f"attach(trainer, ...): {error}") from None
        found = AutoOffloadCallback(**kwargs)
        trainer.add_callback(found)
    elif kwargs:
        raise _CallersArguments(
            f"the trainer already has an AutoOffloadCallback; configure that one, not {sorted(kwargs)}"
        )
    refusal = rescue_refusal(trainer)
    if refusal is None:
        with_rescue(trainer, lambda: (_current(trainer) or found).controller)
    elif found.controller.settings.rescue:
        found.controller.warn("rescue-off", f"out-of-memory steps are not rescued: {refusal}")
    clean_up_when_train_raises(trainer, lambda: _current(trainer) or found)
    return found
