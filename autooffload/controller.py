"""The controller: observe -> decide -> apply, with no training framework in sight.

``attach(model)`` installs autooffload's checkpoint functions on the checkpointed modules and a forward
pre-hook that reads every micro-batch's token count and decides, before that micro-batch's forward, how
many layers offload. ``begin_step()`` starts an optimizer step's peak (the pre-hook calls it at a step's
first micro-batch if nothing did); ``end_step()`` closes the step: it reads the memory probe and the bytes
moved. The Trainer callback is a thin layer over these calls; a custom loop makes them itself::

    controller = OffloadController()
    controller.attach(model, optimizer=optimizer)  # the optimizer: its state, not yet allocated, is foreseen
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.end_step()
    print(controller.finish())  # on every rank: under torch.distributed it gathers the worst rank's memory

Nothing here may stop a training run: a probe that fails, a policy that raises, a model with nothing
checkpointed or inputs it cannot read each produce one :class:`~autooffload.warn.AutoOffloadWarning` and a safe
fallback.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from .apply.compile_guard import CompileBudget, is_compiled
from .apply.host_memory import HostMemory, node_budget, page_round, ranks_per_node
from .apply.keep import count_backwards, matrix_weights
from .apply.offload import OffloadStats
from .apply.paths import uncontrolled
from .apply.switch import CheckpointSwitch, find_targets
from .decide import ladder
from .decide.activations import LayerShape
from .decide.keep_plan import KeepPlanner
from .decide.peak import layer_work_bytes_per_token, logits_bytes_per_token, optimizer_state_factor
from .decide.policy import Observation, Policy
from .decide.predictive import compile_levels, make_policy
from .distributed import AgreementGroup, RankPeak, agree, agree_plan, every_rank, world_size, worst_rank
from .history import HistoryRecorder, StepRecord, fixed_reason, policy_reason
from .observe.probe import MemoryProbe, NvmlProbe, ProbeUnavailable
from .settings import Settings
from .warn import WarnOnce

logger = logging.getLogger("transformers.autooffload")

ENABLE_HINT = (
    "enable checkpointing first: TrainingArguments(activation_checkpointing=True) "
    "(gradient_checkpointing=True before transformers 5.23) or model.gradient_checkpointing_enable()"
)


def token_shape(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(sequence length, tokens) of a model call, from ``input_ids`` or ``inputs_embeds``; None if neither."""
    ids = kwargs.get("input_ids")
    if ids is None and args and torch.is_tensor(args[0]) and not args[0].is_floating_point():
        ids = args[0]
    if torch.is_tensor(ids) and ids.dim() >= 1:
        return int(ids.shape[-1]), int(ids.numel())
    embeds = kwargs.get("inputs_embeds")
    if torch.is_tensor(embeds) and embeds.dim() >= 2:
        return int(embeds.shape[-2]), int(embeds.numel() // embeds.shape[-1])
    return None


def _layer_token_bytes(model: torch.nn.Module) -> float | None:
    """Bytes one token's checkpointed layer input takes, from the config: hidden size x parameter dtype bytes.

    A first guess only: the controller replaces it with what the hooks measure once a step has offloaded.
    """
    hidden = _text_hidden_size(getattr(model, "config", None))
    for parameter in model.parameters():
        if isinstance(hidden, int) and parameter.is_floating_point():
            return float(hidden * parameter.element_size())
    return None


def _model_devices(model: torch.nn.Module) -> list[torch.device]:
    """Every device the parameters are on (several with ``device_map="auto"``); the CPU when there are none."""
    devices = {parameter.device for parameter in model.parameters()}
    return sorted(devices, key=str) or [torch.device("cpu")]


def _text_hidden_size(config: Any) -> int | None:
    """The hidden size of the stack that consumes the tokens: the text config's where the top level has none
    (a VLM's top-level ``hidden_size`` is None on transformers 5.x)."""
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(hidden, int) and hasattr(config, "get_text_config"):
        try:
            hidden = getattr(config.get_text_config(), "hidden_size", None)
        except Exception:  # an ambiguous composite config
            return None
    return hidden if isinstance(hidden, int) and not isinstance(hidden, bool) else None


def _layer_shape(model: torch.nn.Module) -> LayerShape | None:
    """The text stack's layer sizes from the model's config: the seed of the keep model."""
    config = getattr(model, "config", None)
    if config is not None and not isinstance(getattr(config, "hidden_size", None), int):
        try:
            config = config.get_text_config()
        except Exception:  # no text config, or an ambiguous composite one
            return None
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return LayerShape.from_config(config, parameter.element_size())
    return None


def _token_terms(model: torch.nn.Module) -> tuple[float | None, float | None]:
    """(logits, one layer's recompute working set) in bytes per token, from the config; None where unknown."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    dtype_bytes = next((p.element_size() for p in model.parameters() if p.is_floating_point()), None)
    vocab, hidden = getattr(config, "vocab_size", None), getattr(config, "hidden_size", None)
    intermediate = getattr(config, "intermediate_size", None)
    if not dtype_bytes:
        return None, None
    logits = logits_bytes_per_token(vocab, dtype_bytes) if isinstance(vocab, int) else None
    if not isinstance(hidden, int):
        return logits, None
    intermediate = intermediate if isinstance(intermediate, int) else 4 * hidden
    return logits, layer_work_bytes_per_token(hidden, intermediate, dtype_bytes)


def _unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (and alike)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def optimizer_state_bytes(optimizer: Any) -> tuple[int, int | None]:
    """(bytes the optimizer's state holds now, bytes it holds once every trainable parameter has its state).

    The second is None when the optimizer's kind is unknown. torch's Adam and SGD allocate their state lazily,
    at the first ``step()``, so before it the first number is 0 and the difference is still to come.
    """
    inner = _unwrap_optimizer(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        return 0, None
    groups = inner.param_groups
    factor = optimizer_state_factor(type(inner).__name__, groups[0].get("momentum") if groups else None)
    held = sum(
        t.numel() * t.element_size()
        for state in inner.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    if factor is None:
        return held, None
    trainable = sum(p.numel() * p.element_size() for g in groups for p in g["params"] if p.requires_grad)
    if any(g.get("amsgrad") for g in groups):
        factor += 1.0
    return held, round(factor * trainable)


class OffloadController:
    """Decides per micro-batch how many checkpointed layers keep their saved input in host memory.

    ``settings``: a :class:`~autooffload.settings.Settings` (default: ``Settings.from_env()``).
    ``probe``: a :class:`~autooffload.observe.probe.MemoryProbe`, ``"auto"`` (NVML on the model's CUDA device) or
    ``None`` (no memory signal). ``policy``: any object with ``decide(Observation) -> int`` (default: the
    one ``settings.policy`` names). ``compiled``: force or deny the torch.compile budget; by default it is on
    when the attached model is compiled. ``host``: the host memory manager both engines take buffers from
    (default: one whose budget is set at attach from ``settings.host_memory`` and ``LOCAL_WORLD_SIZE``).
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        probe: MemoryProbe | str | None = "auto",
        policy: Policy | None = None,
        host: HostMemory | None = None,
    ) -> None:
        self.settings = settings if settings is not None else Settings.from_env()
        self.host = host if host is not None else HostMemory()
        self.agreement: AgreementGroup | None = None
        self.ranks_agree = True  # False when a rank found no layers at attach: then no rank makes collectives
        self._cap_logged = False
        self.policy = policy if policy is not None else make_policy(self.settings)
        self.probe_choice = probe
        self.probe: MemoryProbe | None = None
        self.stats = OffloadStats()
        self.budget = CompileBudget(self.settings.compile_max_switches)
        self.step = 0
        self.switches = 0
        self.steps_offloading = 0
        self.latched = False
        self.compiled = False
        self.memory_fraction: float | None = None
        self.memory_bytes: int | None = None
        self.total_bytes: int | None = None
        self.layer_token_bytes: float | None = None
        self.logits_token_bytes: float | None = None
        self.work_token_bytes: float | None = None
        self.optimizer: Any = None
        self.pending_bytes = 0
        self.last_step_clean = True
        self._side_work = False
        self._step_begun = False
        self._state_at_start = 0
        self._tried_bytes: int | None = None
        self.rescues = 0
        self.rescuing = False
        self.last_step_rescued = False
        self._layer_tokens = 0
        self.peak_memory_fraction: float | None = None
        self.last_step_bytes = 0
        self.active = 0.0
        self.last_seq_len = 0
        self.last_tokens = 0
        self.switch: CheckpointSwitch | None = None
        self.reinstalls = 0
        self._model: torch.nn.Module | None = None
        self._dormant: list[tuple[torch.nn.Module, str, Any]] = []
        self._hook: Any = None
        self._micro_batches = 0
        self._offloaded_this_step = False
        self._policy_failed = False
        self.level: int | None = None
        self.worst_rank: RankPeak | None = None
        self.warn = WarnOnce()
        # The ladder's keep rung (recompute="auto"): its planner (autooffload.decide.keep_plan: per-layer costs,
        # forwards alive before a backward, the reading's correction) and the fraction kept on the last micro-batch.
        self.kept_model = KeepPlanner()
        self.kept = 0.0
        self._keep_plain: float | None = None  # the all-recompute peak the last keep plan was made from
        self._backward_hook: Any = None
        self.reason: str | None = None  # why the last micro-batch got its level (autooffload.history.REASONS)
        self.recorder = HistoryRecorder()

    # ---- apply ---------------------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module, *, compiled: bool | None = None, optimizer: Any = None) -> bool:
        """Install the checkpoint functions and the pre-forward hook. False (with a warning) if nothing to do.

        ``optimizer``: the run's optimizer, so that state it has not allocated yet (Adam's, before the first
        ``step()``) is foreseen in the first steps; without it that state is unknown until a reading holds it.
        """
        self.detach()
        targets, unknown = find_targets(model)
        for key, message in uncontrolled(model, unknown):
            self.warn(key, message)
        self._join_ranks(bool(targets))
        if not targets:
            self.warn("no-targets", f"no checkpointed layers found, so autooffload does nothing: {ENABLE_HINT}")
            return False
        if self.host.budget_bytes is None:
            self.host.budget_bytes = node_budget(self.settings.host_memory) // ranks_per_node()
        self.switch = CheckpointSwitch(targets, self.stats, self.settings.engine, warn=self.warn, host=self.host)
        self._configure_keep(model)
        self._model, self._dormant = model, []
        self.compiled = is_compiled(model) if compiled is None else compiled
        self.layer_token_bytes = self.layer_token_bytes or _layer_token_bytes(model)
        self.logits_token_bytes, self.work_token_bytes = _token_terms(model)
        self.optimizer = optimizer if optimizer is not None else self.optimizer
        self.probe = self._make_probe(_model_devices(model))
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        if self.compiled and self.budget.exhausted and self.settings.mode == "auto":
            self._latch()
        fixed = self._fixed_level()
        self._apply(fixed if fixed is not None else self.level or 0)
        logger.info(
            "autooffload: controlling %d checkpointed layer(s), mode=%s, memory signal=%s, compiled=%s, "
            "host memory budget %.1f MiB for this rank (AUTOOFFLOAD_HOST_MEMORY=%s over %d rank(s) of the node)",
            len(self.switch.layers),
            self.settings.mode,
            type(self.probe).__name__ if self.probe is not None else "none",
            self.compiled,
            self.host.budget_bytes / 2**20,
            self.settings.host_memory,
            ranks_per_node(),
        )
        return True

    def _join_ranks(self, ready: bool) -> None:
        """Every rank attaches at the same point, with layers to control or not: make the side group there
        (``new_group`` is a collective) and learn whether every rank has layers; if one has none, no rank
        makes the per-micro-batch and end-of-training collectives, which that rank would never join."""
        if not self.settings.sync_ranks or world_size() < 2:
            return
        if self.agreement is None:
            self.agreement = AgreementGroup()
        self.ranks_agree = every_rank(ready, self.agreement)
        if not self.ranks_agree:
            self.warn(
                "ranks-without-layers",
                "a rank has no checkpointed layers for autooffload to control, so the ranks do not agree on one "
                "offload level: each decides alone (AUTOOFFLOAD_SYNC_RANKS=0 silences this)",
            )

    def detach(self, *, restore: bool = False) -> None:
        """Remove the pre-forward hook. Plain checkpointing stays installed unless ``restore`` puts back
        the functions that were found (which, on some transformers releases, fail or always offload)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._backward_hook is not None:
            self._backward_hook.remove()
            self._backward_hook = None
        if self.switch is not None:
            self.switch.close()
            if restore:
                self.switch.restore()
            else:
                self.switch.apply(0)
            self.switch = None
        self._model = None
        self.host.release_all()

    def _follow_installed(self) -> None:
        """Rebuild the targets if the checkpoint functions changed hands since the last forward.

        TRL's DPO, GRPO and RLOO trainers run the reference forward between ``gradient_checkpointing_disable()``
        and ``gradient_checkpointing_enable(kwargs)`` on every step, which puts transformers' own functions
        (with the ``offload`` key, if the kwargs have it) back on every layer; a user may also turn
        checkpointing off or on mid-run. The check is identities only; a rebuild reads what is installed now.
        """
        assert self.switch is not None
        if self.switch.targets:
            if self.switch.intact():
                return
        elif all(
            getattr(m, a, None) is f and not getattr(m, "gradient_checkpointing", False) for m, a, f in self._dormant
        ):
            return
        self._rebuild()

    def _rebuild(self) -> None:
        assert self.switch is not None and self._model is not None
        targets, unknown = find_targets(self._model)
        for key, message in uncontrolled(self._model, unknown):
            self.warn(key, message)
        if not targets:
            watched = [(t.module, t.attribute) for t in self.switch.targets] or [(m, a) for m, a, _ in self._dormant]
            self._dormant = [(m, a, getattr(m, a, None)) for m, a in watched]
            self.warn(
                "checkpointing-off",
                "checkpointing was turned off during training, so nothing is offloaded and autooffload reports "
                "level 0 until it is turned on again",
            )
        level = max(self.switch.offloaded, 0)
        self.switch.close()
        self.switch = CheckpointSwitch(targets, self.stats, self.switch.engine, warn=self.warn)
        self._configure_keep(self._model)
        self.reinstalls += 1
        self._apply(level)
        logger.debug(
            "autooffload: checkpoint functions replaced from outside; %d layer(s) now", len(self.switch.layers)
        )

    def _make_probe(self, devices: list[torch.device]) -> MemoryProbe | None:
        if self.probe_choice != "auto":
            return self.probe_choice  # type: ignore[return-value]
        try:
            return NvmlProbe(devices if len(devices) > 1 else devices[0])
        except ProbeUnavailable as error:
            if self.settings.mode == "auto":
                self.warn(
                    "no-probe",
                    f"no device memory reading ({error}); offload follows the sequence-length trigger alone "
                    f"(AUTOOFFLOAD_SEQ_HIGH={self.settings.seq_high})",
                )
            return None

    # ---- observe and decide --------------------------------------------------------------------------

    @torch.compiler.disable
    def _pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.switch is not None:
            self.switch.new_forward()
        if not module.training or not torch.is_grad_enabled():
            return
        shape = token_shape(args, kwargs)
        if shape is None:
            self.warn(
                "no-tokens",
                f"{type(module).__name__} was called without input_ids or inputs_embeds; the sequence-length "
                "trigger is off for such calls and only the memory reading decides",
            )
            shape = (0, 0)
        if not self._step_begun:
            self.begin_step()
        self.before_forward(*shape)

    def before_forward(self, seq_len: int, tokens: int) -> int:
        """Decide for the micro-batch about to run and install the decision. Returns the layers offloaded."""
        if self.switch is None:
            return 0
        self._follow_installed()
        self.switch.engine.begin_forward()
        self._settle_budget()
        self.last_seq_len, self.last_tokens = seq_len, tokens
        cap = self._host_cap(tokens)
        decided = self._capped(self._decide(seq_len, tokens, cap), cap) if self.switch.layers else 0
        if self.settings.recompute == "auto":
            level, keep = agree_plan(self, decided, self._plan_keep(seq_len, tokens, decided), cap)
        else:
            level, keep = agree(self, decided, cap), 0
        if level != decided:
            self.reason = "rank_agreement"
        if self.compiled and (level, keep) != (self.switch.offloaded, self.switch.kept) and self._micro_batches > 0:
            self.budget.switched()
        switched = level != self.switch.offloaded and self._micro_batches > 0
        if switched:
            self.switches += 1
            logger.info(
                "autooffload: step %d, seq %d: offload %d -> %d of %d layer(s)",
                self.step,
                seq_len,
                self.switch.offloaded,
                level,
                len(self.switch.layers),
            )
        auto = self.settings.recompute == "auto" and not self.compiled
        measure = auto and self.kept_model.wants(level, tokens, seq_len)
        self._apply(level, keep, measure)
        self.kept_model.forward(tokens, seq_len, self.switch.kept, self._keep_plain)
        self._offloaded_this_step |= level > 0
        self._layer_tokens += self.switch.offloaded * tokens
        self._micro_batches += 1
        self.recorder.micro_batch(self, seq_len, tokens, switched)
        return level

    def _fixed_level(self) -> int | None:
        assert self.switch is not None
        if self.latched or self.rescuing or self.settings.mode == "on":
            return len(self.switch.layers)
        if self.settings.mode == "off":
            return 0
        return None

    def _host_cap(self, tokens: int) -> int | None:
        """The most layers whose saved inputs fit this rank's host budget at ``tokens``; None if not known yet."""
        assert self.switch is not None
        if self.host.budget_bytes is None or not self.layer_token_bytes or tokens <= 0:
            return None
        layers = len(self.switch.layers)
        cap = min(layers, self.host.budget_bytes // page_round(round(self.layer_token_bytes * tokens)))
        if self.compiled:
            cap = max(level for level in compile_levels(layers, self.settings.compile_max_switches) if level <= cap)
        return cap

    def _capped(self, level: int, cap: int | None) -> int:
        if cap is None or level <= cap:
            return level
        self.reason = "host_cap"
        if not self._cap_logged:
            self._cap_logged = True
            logger.info(
                "autooffload: step %d: offload capped at %d of the %d layer(s) asked for: the host memory budget "
                "(%.1f MiB for this rank, AUTOOFFLOAD_HOST_MEMORY=%s) holds no more at %d tokens",
                self.step,
                cap,
                level,
                self.host.budget_bytes / 2**20,
                self.settings.host_memory,
                self.last_tokens,
            )
        return cap

    def _decide(self, seq_len: int, tokens: int, host_layers: int | None = None) -> int:
        assert self.switch is not None
        fixed = self._fixed_level()
        if fixed is not None:
            self.reason = fixed_reason(self.latched, self.rescuing, self.settings.mode)
            return fixed
        if self._policy_failed:
            self.reason = "policy_failed"
            return 0
        layers = len(self.switch.layers)
        memory_bytes, memory_fraction = self._memory_as_if_all_recomputed()
        observation = Observation(
            self.step,
            seq_len,
            tokens,
            memory_fraction,
            layers,
            memory_bytes=memory_bytes,
            total_bytes=self.total_bytes,
            bytes_per_layer=round(self.layer_token_bytes * tokens) if self.layer_token_bytes else None,
            levels=compile_levels(layers, self.settings.compile_max_switches) if self.compiled else None,
            last_step_rescued=self.last_step_rescued,
            logits_bytes_per_token=self.logits_token_bytes,
            layer_work_bytes_per_token=self.work_token_bytes,
            pending_bytes=self.pending_bytes,
            last_step_clean=self.last_step_clean,
            host_layers=host_layers,
        )
        try:
            level = max(0, min(int(self.policy.decide(observation)), layers))
        except Exception as error:  # a user's policy must not end the run
            self._policy_failed = True
            self.reason = "policy_failed"
            self.warn(
                "policy", f"policy {type(self.policy).__name__} raised {error!r}; plain checkpointing from now on"
            )
            return 0
        self.reason = policy_reason(self.policy)
        return level

    def _memory_as_if_all_recomputed(self) -> tuple[int | None, float | None]:
        """The last reading less what kept layers added to it: what the policies plan from (they know nothing
        of keep, so a step that kept must not look fuller to them than its all-recompute peak)."""
        kept_bytes = self.kept_model.reading_kept_bytes
        if not kept_bytes or self.memory_bytes is None or not self.total_bytes:
            return self.memory_bytes, self.memory_fraction
        memory_bytes = max(round(self.memory_bytes - kept_bytes), 0)
        return memory_bytes, memory_bytes / self.total_bytes

    def _plan_keep(self, seq_len: int, tokens: int, level: int) -> int:
        """How many of the last layers run without checkpointing for this micro-batch (recompute="auto").

        None kept where anything is fixed or unknown: offload decided (or forced by mode, latch, rescue), no
        reading yet, a micro-batch longer than any a reading has covered, or a policy that cannot predict.
        The count is the keep planner's (:mod:`autooffload.decide.keep_plan`).
        """
        assert self.switch is not None
        self._keep_plain = None
        if level > 0 or self.settings.mode != "auto" or self._fixed_level() is not None or self._policy_failed:
            return 0
        if self.total_bytes is None or tokens <= 0 or tokens > self.kept_model.longest_read_tokens:
            return 0
        predict = getattr(self.policy, "predict", None)
        if predict is None:
            self.warn(
                "keep-no-prediction",
                f"AUTOOFFLOAD_RECOMPUTE=auto needs a policy that predicts the peak (predictive); "
                f"{type(self.policy).__name__} does not, so every layer recomputes",
            )
            return 0
        per_layer = round(self.layer_token_bytes * tokens) if self.layer_token_bytes else None
        try:
            predicted = predict(tokens, per_layer)
        except Exception as error:  # a user's policy must not end the run
            self.warn("keep-predict", f"{type(self.policy).__name__}.predict raised {error!r}; nothing is kept")
            return 0
        if predicted is None:
            return 0
        self._keep_plain = predicted
        layers = len(self.switch.layers)
        levels = ladder.keep_levels(layers, self.settings.compile_max_switches) if self.compiled else None
        limit = self.settings.memory_high * self.total_bytes
        return self.kept_model.count(predicted, tokens, seq_len, limit, ladder.KEEP_MARGIN * self.total_bytes, levels)

    def _configure_keep(self, model: torch.nn.Module | None) -> None:
        """Tell the keep planner the planned layers (each one's matrix weights, for its casts under autocast) and
        the config's seed; count the backwards, so that it knows how many forwards are alive together."""
        assert self.switch is not None
        self.switch.on_measured = self._on_measured
        if model is None:
            return
        weights = [matrix_weights(slot.target.module, slot.target.size) for slot in self.switch.layers]
        weight_bytes = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 0)
        self.kept_model.configure(weights, weight_bytes, _layer_shape(model))
        if self._backward_hook is None and self.settings.recompute == "auto":
            self._backward_hook = count_backwards(model, self.kept_model.backward)

    def _on_measured(self, position: int, nbytes: int, cast_bytes: int) -> None:
        self.kept_model.measured(position, self.last_tokens, self.last_seq_len, nbytes, cast_bytes)

    def _settle_budget(self) -> None:
        if not self.compiled:
            return
        self.budget.settle()
        if self.budget.exhausted and not self.latched and self.settings.mode == "auto":
            self._latch()

    def _latch(self) -> None:
        self.latched = True
        self.warn(
            "latched",
            f"torch.compile: {self.budget.spent} offload switch(es) triggered recompilation, the budget "
            f"AUTOOFFLOAD_COMPILE_MAX_SWITCHES={self.settings.compile_max_switches} is spent; offload stays on "
            "(the memory-safe state) for the rest of the run",
        )

    def rescue(self, tried_bytes: int | None = None) -> bool:
        """Offload every layer until this step ends, for a rerun after an out-of-memory error.

        ``tried_bytes``: the allocation that failed, where the error says ("Tried to allocate X"). The step's
        reading is then raised to at least the reading plus it, and at least the device's size: a policy
        learns that the step needed more than it had, and plans more offload for that length next time.
        False when a rerun cannot help: nothing is controlled, or mode ``off`` forbids offload.
        """
        if self.switch is None or not self.switch.layers or self.settings.mode == "off":
            return False
        self.rescues += 1
        self.rescuing = True
        self._tried_bytes = max(self._tried_bytes or 0, tried_bytes or 0)
        self.recorder.rescue()
        logger.warning(
            "autooffload: step %d ran out of device memory; rerunning it with all %d layer(s) offloaded",
            self.step,
            len(self.switch.layers),
        )
        return True

    # ---- open and close a step -----------------------------------------------------------------------

    def begin_step(self) -> None:
        """Start an optimizer step: its peak starts here (the probe's ``reset()``, where it has one), so
        evaluation and checkpoint saving between two steps stay out of the next reading. Trainer's callback
        calls it at ``on_step_begin``; otherwise the pre-forward hook does at a step's first micro-batch."""
        self._step_begun = True
        self._state_at_start = optimizer_state_bytes(self.optimizer)[0] if self.optimizer is not None else 0
        reset = getattr(self.probe, "reset", None)
        if reset is None:
            return
        try:
            reset()
        except Exception as error:  # a probe's failure must not end the run; the reading still works
            self.warn("probe-reset", f"memory probe reset failed ({error!r}); a step's peak may include earlier work")
            return
        self._side_work = False  # evaluation or saving before the reset is not in this step's reading

    def note_side_work(self) -> None:
        """Evaluation or a checkpoint save ran since the last reading: the next reading is not a sample of
        training (the callback calls it from ``on_evaluate`` and ``on_save``), unless the probe's ``reset()`` at
        the next step's start keeps that work out of it, as it does under Trainer (evaluation and saving run
        after ``on_step_end``, before the next ``on_step_begin``)."""
        self._side_work = True

    def end_step(self) -> None:
        """Close an optimizer step: bytes moved, memory reading, dwell counter."""
        self._settle_budget()
        self.last_step_bytes = self.stats.next_step()
        if self.last_step_bytes and self._layer_tokens and not self.rescuing:
            self.layer_token_bytes = self.last_step_bytes / self._layer_tokens
        self._layer_tokens = 0
        self.last_step_rescued, self.rescuing = self.rescuing, False
        self.steps_offloading += int(self._offloaded_this_step)
        self._offloaded_this_step = False
        self.memory_fraction = self._read_memory()
        reading = self.memory_bytes if self.memory_fraction is not None else None
        self.kept_model.end_step(reading, clean=not self._side_work and not self.last_step_rescued)
        if self.memory_fraction is not None:
            self.peak_memory_fraction = max(self.peak_memory_fraction or 0.0, self.memory_fraction)
        if self.last_step_rescued and self.memory_bytes is not None and self.total_bytes:
            # The reading misses the allocation that failed: what the step needed is at least the device.
            self.memory_bytes = max(self.memory_bytes + (self._tried_bytes or 0), self.total_bytes)
        self._tried_bytes = None
        self.last_step_clean, self._side_work = not self._side_work, False
        self.pending_bytes = self._pending_optimizer_bytes()
        self._step_begun = False
        self.step += 1
        self.host.end_step()
        if self.switch is not None:
            self._record_step()

    def _pending_optimizer_bytes(self) -> int:
        """Optimizer state that did not exist when the step just read began, so its reading lacks it.

        Only while the state is still empty at a step's start (torch's optimizers create it whole at their
        first ``step()``): once any exists, what the count says of it (ZeRO's partitions, a state restored
        on resume) is noise, not state still to come, and a resumed run must decide as the uninterrupted one.
        """
        if self.optimizer is None or self._state_at_start > 0:
            return 0
        expected = optimizer_state_bytes(self.optimizer)[1]
        return max(0, expected) if expected is not None else 0

    # ---- history -------------------------------------------------------------------------------------

    @property
    def history(self) -> list[StepRecord]:
        """One record per optimizer step not yet written (autooffload.history describes the fields)."""
        return self.recorder.pending

    def write_history(self, path: str | os.PathLike) -> int:
        """Append the records not yet written to ``path`` (JSON Lines) and forget them; returns how many.
        A file that cannot be written gives one warning; the records wait for the next call."""
        try:
            return self.recorder.write(path)
        except OSError as error:
            self.warn("history-write", f"cannot write the history to {path} ({error}); the records wait in memory")
            return 0

    def _record_step(self) -> None:
        self.recorder.end_step(self)
        if self.recorder.dropped:
            self.warn(
                "history-dropped",
                f"{self.recorder.limit} history records were never written; the oldest are dropped "
                "(call controller.write_history(path) now and then)",
            )

    def _read_memory(self) -> float | None:
        self.memory_bytes = None
        if self.probe is None:
            return None
        try:
            reading = self.probe.read()
        except Exception as error:  # NVML can fail mid-run (driver reset, XID); training goes on
            self.probe = None
            self.warn(
                "probe-failed",
                f"memory reading failed ({error!r}); the sequence-length trigger alone decides from now on",
            )
            return None
        if reading is None:
            return None
        # Plain ints (a user's probe may hand numpy's): the state goes into Trainer's trainer_state.json.
        self.memory_bytes, self.total_bytes = int(reading.used_bytes), int(reading.total_bytes)
        return self.memory_bytes / self.total_bytes

    def _apply(self, level: int, keep: int = 0, measure: bool = False) -> None:
        assert self.switch is not None
        self.switch.apply(level, keep, measure)
        self.level = self.switch.offloaded
        self.active = self.level / len(self.switch.layers) if self.switch.layers else 0.0
        self.kept = self.switch.kept / len(self.switch.layers) if self.switch.layers else 0.0

    # ---- report and resume ---------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """The ``autooffload/*`` values for a training log."""
        logs = {
            "autooffload/active": self.active,
            "autooffload/kept": self.kept,
            "autooffload/offloaded_bytes": float(self.last_step_bytes),
            "autooffload/switches": float(self.switches),
            "autooffload/rescues": float(self.rescues),
            "autooffload/host_bytes": float(self.host.held_bytes),
        }
        if self.memory_fraction is not None:
            logs["autooffload/memory_fraction"] = self.memory_fraction
        return logs

    def summary(self) -> str:
        share = self.steps_offloading / self.step if self.step else 0.0
        text = (
            f"autooffload: mode={self.settings.mode}, {self.step} step(s), offload in {self.steps_offloading} "
            f"({share:.0%}), {self.switches} switch(es), {self.stats.total_bytes / 2**20:.1f} MiB moved to host"
        )
        if self.peak_memory_fraction is not None:
            text += f", peak memory {self.peak_memory_fraction:.2f} of device"
        if self.worst_rank is not None:
            worst = self.worst_rank
            text += f", worst of {worst.world_size} ranks: rank {worst.rank} at {worst.fraction:.2f}"
        if self.compiled:
            text += f", compile: {self.budget.spent}/{self.settings.compile_max_switches} recompiling switch(es)"
            text += ", latched on" if self.latched else ""
        return text

    def finish(self) -> str:
        """End of training, called on every rank: under torch.distributed (with ``sync_ranks``) one collective
        gathers the worst rank's peak memory into the summary, since rank 0's own device says little about the
        others'. Returns the summary."""
        enabled = self.settings.sync_ranks and self.ranks_agree
        self.worst_rank = worst_rank(self.peak_memory_fraction, enabled, self.agreement)
        return self.summary()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: enough for a resumed run to decide as the uninterrupted one would have: the
        offload level, dwell counter, switch count, compile budget, the last step's memory reading (the first
        step after the resume decides from it, and a policy learns from it, with the optimizer state it lacks and
        whether it is a clean sample) and the measured layer bytes."""
        return {
            "step": self.step,
            "switches": self.switches,
            "steps_offloading": self.steps_offloading,
            "total_bytes": self.stats.total_bytes,
            "level": self.level,
            "latched": self.latched,
            "budget_spent": self.budget.spent,
            "rescues": self.rescues,
            "memory": {"fraction": self.memory_fraction, "bytes": self.memory_bytes, "total": self.total_bytes},
            "peak_memory_fraction": self.peak_memory_fraction,
            "layer_token_bytes": self.layer_token_bytes,
            "last_step_rescued": self.last_step_rescued,
            "last_step_clean": self.last_step_clean,
            "pending_bytes": self.pending_bytes,
            "policy": self._policy_state(),
            "kept_model": self.kept_model.state_dict(),
        }

    def _policy_state(self) -> dict[str, Any] | None:
        if not hasattr(self.policy, "state_dict"):
            return None
        try:
            return self.policy.state_dict()
        except Exception as error:  # a user's policy must not stop a checkpoint save
            self.warn("policy-save", f"policy {type(self.policy).__name__}.state_dict() raised {error!r}; not saved")
            return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.switches = int(state["switches"])
        self.steps_offloading = int(state.get("steps_offloading", 0))
        self.stats.total_bytes = int(state.get("total_bytes", 0))
        self.latched = bool(state["latched"])
        self.budget.spent = int(state["budget_spent"])
        self.rescues = int(state.get("rescues", 0))
        memory = state.get("memory") or {}
        self.memory_fraction = memory.get("fraction")
        self.memory_bytes = memory.get("bytes")
        self.total_bytes = memory.get("total")
        self.peak_memory_fraction = state.get("peak_memory_fraction")
        self.layer_token_bytes = state.get("layer_token_bytes") or self.layer_token_bytes
        self.last_step_rescued = bool(state.get("last_step_rescued", False))
        self.last_step_clean = bool(state.get("last_step_clean", True))
        self.pending_bytes = int(state.get("pending_bytes") or 0)  # a checkpoint after step 0: Adam's state to come
        self.level = state.get("level")
        legacy = {key: state[key] for key in ("longest_read_tokens", "reading_kept_bytes") if key in state}
        self.kept_model.load_state_dict({**legacy, **(state.get("kept_model") or {})})
        if self.level is not None:
            self._micro_batches = 1  # the next change of level is a switch, as it would have been
        if state.get("policy") is not None and hasattr(self.policy, "load_state_dict"):
            try:
                self.policy.load_state_dict(state["policy"])
            except Exception as error:  # saved by another policy (AUTOOFFLOAD_POLICY changed), or a user's policy
                self.warn(
                    "policy-state",
                    f"the saved policy state does not fit {type(self.policy).__name__} ({error!r}); it starts afresh",
                )
        if self.switch is not None and self.level is not None:
            self._apply(self.level)
