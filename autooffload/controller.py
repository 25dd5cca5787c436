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

import dataclasses
import logging
import os
from typing import Any

import torch

from . import lifecycle
from .apply.compile_guard import CompileBudget, is_compiled
from .apply.host_memory import HostMemory, node_budget, page_round, ranks_per_node
from .apply.keep import count_backwards, matrix_weights
from .apply.offload import OffloadStats
from .apply.paths import uncontrolled
from .apply.stacks import Stack, entries, plan_stacks, read_lengths
from .apply.switch import CheckpointSwitch, find_targets, install_plain
from .decide import ladder
from .decide.keep_plan import KeepPlanner
from .decide.policy import Observation, Policy
from .decide.predictive import compile_levels, make_policy
from .distributed import AgreementGroup, RankPeak, agree, agree_plan, every_rank, world_size, worst_rank
from .guard import guarded
from .history import HistoryRecorder, StepRecord, fixed_reason, policy_reason
from .observe import model as observe
from .observe.model import optimizer_state_bytes
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


class OffloadController:
    """Decides per micro-batch how many checkpointed layers keep their saved input in host memory.

    ``settings``: a :class:`~autooffload.settings.Settings` (default: ``Settings.from_env()``); the keyword
    arguments of :class:`~autooffload.callback.AutoOffloadCallback` (``mode="on"``, ``min_steps=4``, ...)
    override it, or ``AUTOOFFLOAD_*`` variables where no ``settings`` is given.
    ``probe``: a :class:`~autooffload.observe.probe.MemoryProbe`, ``"auto"`` (NVML on the model's CUDA device) or
    ``None`` (no memory signal). ``policy``: a policy's name (the ``policy`` setting) or any object with
    ``decide(Observation) -> int`` (default: the one ``settings.policy`` names; an object given here is the
    caller's: :meth:`reset` does not reset it). ``compiled``: force or deny the torch.compile budget; by default
    it is on when the attached model is compiled. ``host``: the host memory manager both engines take buffers
    from (default: one whose budget is set at attach from ``settings.host_memory`` and ``LOCAL_WORLD_SIZE``).
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
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
        rescue: bool | None = None,
        host_memory: str | None = None,
        probe: MemoryProbe | str | None = "auto",
        policy: Policy | str | None = None,
        host: HostMemory | None = None,
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
            sync_ranks=sync_ranks,
            recompute=recompute,
            rescue=rescue,
            host_memory=host_memory,
            policy=policy if isinstance(policy, str) else None,
        )
        given = {key: value for key, value in given.items() if value is not None}
        if settings is None:
            settings = Settings.from_env(**given)
        elif given:
            settings = dataclasses.replace(settings, **given)
        self.settings = settings
        self.host = host if host is not None else HostMemory()
        self.agreement: AgreementGroup | None = None
        self.ranks_agree = True  # False when a rank found no layers at attach: then no rank makes collectives
        self._cap_logged = False
        self.policy_choice: Policy | None = None if isinstance(policy, str) else policy
        self.probe_choice = probe
        self.probe: MemoryProbe | None = None
        self.stats = OffloadStats()
        self.compiled = False
        self.logits_token_bytes: float | None = None
        self.work_token_bytes: float | None = None
        self.optimizer: Any = None
        self.switch: CheckpointSwitch | None = None
        self.reinstalls = 0
        self._model: torch.nn.Module | None = None
        self._dormant: list[tuple[torch.nn.Module, str, Any]] = []
        self._hook: Any = None
        self._hooks: list[Any] = []  # the post-forward hooks, and the entry modules' pre- and post-forward hooks
        self.stacks: list[Stack] = []
        self._stack_width: dict[str, float] = {}  # a stack's layer input per token, relative to layer_token_bytes
        self._inputless: set[int] = set()  # planned layers whose calls pass no tensor positionally: nothing moves
        self._config_width: dict[str, float] = {}  # the same from the config (hidden sizes): what a new run starts with
        self._active: torch.nn.Module | None = None  # the entry whose call decided the running micro-batch
        self._attached_identity: dict[str, Any] | None = None  # the attached model's (autooffload.lifecycle)
        self._layer_bytes_guess: float | None = None  # its bytes per token of a layer input, from the config
        self.warn = WarnOnce()
        self._keep_config: tuple | None = None  # the keep planner's layers and seed, for the attached model
        self._backward_hook: Any = None  # counts backwards for the keep planner (recompute="auto")
        self.failed = False  # autooffload.guard gave up: plain checkpointing for the rest of the run
        self.reset()

    def reset(self) -> None:
        """Start a new run: forget the steps, the dwell, the switches, the memory readings, the policy's samples,
        the measured bytes and the history not yet written. The settings, the probe, a policy object given at
        construction and the model it is attached to stay. The Trainer callback calls it at every ``train()``
        that does not resume from a checkpoint; a custom loop that trains again from scratch calls it itself."""
        self.policy = self._fresh_policy()
        self.stats.step_bytes = self.stats.total_bytes = self.stats.tensors = 0  # the switch holds this object
        self.budget = CompileBudget(self.settings.compile_max_switches)
        self.identity: dict[str, Any] | None = self._attached_identity if self._model is not None else None
        self.step = 0
        self.switches = 0
        self.steps_offloading = 0
        self.latched = False
        self.memory_fraction: float | None = None
        self.memory_bytes: int | None = None
        self.total_bytes: int | None = None
        self.layer_token_bytes: float | None = self._layer_bytes_guess if self._model is not None else None
        self._stack_width = dict(self._config_width)  # a width learned is relative to the measured bytes just dropped
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
        self._reported = False  # an offloaded layer's call said its input's bytes in this step
        self.peak_memory_fraction: float | None = None
        self.last_step_bytes = 0
        self.active = 0.0
        self.last_seq_len = 0
        self.last_tokens = 0
        self.bytes_per_layer: int | None = None  # a planned layer's saved input in this micro-batch, the mean
        # Per planned layer (module order), what the running micro-batch's decision sized its saved inputs at, all
        # its calls, before the forward ran them (None before any bytes per token are known).
        self.planned_layer_bytes: tuple[int, ...] | None = None
        self._running: tuple[frozenset[int], list[float]] | None = None  # its offloaded layers, layer-tokens
        self.last_observation: Observation | None = None
        self.last_lengths: dict[str, tuple[int, int]] = {}
        self._micro_batches = 0
        self._offloaded_this_step = False
        self._policy_failed = False
        self.level: int | None = None
        self.worst_rank: RankPeak | None = None
        # The ladder's keep rung (recompute="auto"): its planner (autooffload.decide.keep_plan: per-layer costs,
        # forwards alive before a backward, the reading's correction), configured anew for the attached model.
        self.kept_model = KeepPlanner()
        if self._keep_config is not None:
            self.kept_model.configure(*self._keep_config)
        self.kept = 0.0
        self._keep_plain: float | None = None  # the all-recompute peak the last keep plan was made from
        self.reason: str | None = None  # why the last micro-batch got its level (autooffload.history.REASONS)
        self.recorder = HistoryRecorder()

    def _fresh_policy(self) -> Policy:
        """The policy a new run starts with: the caller's object as it is, or the named one with a fresh state (the
        same object, when it is of the kind the settings name: a caller may hold it)."""
        if self.policy_choice is not None:
            return self.policy_choice
        fresh = make_policy(self.settings)
        current = getattr(self, "policy", None)
        if type(current) is not type(fresh):
            return fresh
        current.load_state_dict(fresh.state_dict())
        return current

    # ---- apply ---------------------------------------------------------------------------------------

    @guarded("attach", False, retry=True)
    def attach(self, model: torch.nn.Module, *, compiled: bool | None = None, optimizer: Any = None) -> bool:
        """Install the checkpoint functions and the pre-forward hook. False (with a warning) if nothing to do.

        ``optimizer``: the run's optimizer, so that state it has not allocated yet (Adam's, before the first
        ``step()``) is foreseen in the first steps; without it that state is unknown until a reading holds it.
        """
        self.failed = False
        self.detach()
        lifecycle.take_over(model, self)
        self._model = model  # from here on, a failure leaves this model on plain checkpointing
        targets, unknown = find_targets(model)
        for key, message in uncontrolled(model, unknown):
            self.warn(key, message)
        self._join_ranks(bool(targets))
        if not targets:
            lifecycle.let_go(model, self)
            self._model = None
            if not unknown:  # otherwise checkpointing is on, and the warning above named the function it runs
                self.warn("no-targets", f"no checkpointed layers found, so autooffload does nothing: {ENABLE_HINT}")
            return False
        if self.host.budget_bytes is None:
            self.host.budget_bytes = node_budget(self.settings.host_memory) // ranks_per_node()
        self.switch = CheckpointSwitch(targets, self.stats, self.settings.engine, warn=self.warn, host=self.host)
        self._plan_stacks(model, targets)
        self._measured_on(model)
        self._configure_keep(model)
        self._model, self._dormant = model, []
        self.compiled = is_compiled(model) if compiled is None else compiled
        self.layer_token_bytes = self.layer_token_bytes or self._layer_bytes_guess
        self.switch.forward.on_first_call = self._on_first_call
        self.logits_token_bytes, self.work_token_bytes = observe.token_terms(model)
        self.optimizer = optimizer if optimizer is not None else self.optimizer
        self.probe = self._make_probe(observe.model_devices(model))
        self._watch_model(model)
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        self._hooks = [model.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)]
        for module, stacks in entries(model, self.stacks):
            if module is not model:
                self._hooks += self._entry_hooks(module, stacks)
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

    def give_up(self, where: str, error: BaseException) -> None:
        """An entry point raised (:mod:`autooffload.guard`): one warning, then plain checkpointing for the rest
        of the run (the hook removed, transformers-equivalent checkpoint functions installed)."""
        self.failed = True
        self.warn(
            "failed",
            f"internal error in {where} ({type(error).__name__}: {error}); autooffload stops and the run goes on "
            "with plain checkpointing (please report this with the model's config)",
        )
        model = self._model
        try:
            self.detach()
        except Exception:  # the switch itself is broken: forget it, the functions are replaced below
            self.switch, self._hook = None, None
        if model is not None:
            install_plain(model)

    @guarded("a layer call's report")
    def _on_first_call(self, position: int, nbytes: int) -> None:
        """A planned layer's first call in this micro-batch, with its input's real bytes. They replace the
        running micro-batch's estimate for that layer (what :meth:`planned_bytes` and the step's measurement
        count) and set its stack's bytes per token for the next decision; before any bytes were measured, the
        first stack's call sets ``layer_token_bytes`` itself, in place of the config's guess."""
        if self.switch is None or position >= len(self.switch.layers):
            return
        if nbytes == 0:
            self._inputless.add(position)
            target = self.switch.layers[position].target
            self.warn(
                "keyword-input",
                f"{target.name or type(target.module).__name__} passes no tensor positionally to its checkpoint "
                "(its hidden states go as a keyword argument, which torch's checkpoint does not save): none of its "
                "input can move to host memory, so autooffload counts it as freeing nothing",
            )
        else:
            self._inputless.discard(position)
        stack = self.switch.layers[position].target.stack
        tokens = self.last_lengths.get(stack, (0, 0))[1]
        if tokens > 0 and nbytes > 0:
            guessed = not (self.last_step_bytes or self.stats.total_bytes)
            if guessed and stack == self.switch.layers[0].target.stack:
                self.layer_token_bytes = nbytes / (tokens * self._stack_width.get(stack, 1.0))
            elif self.layer_token_bytes:
                self._stack_width[stack] = nbytes / (tokens * self.layer_token_bytes)
        if self._running is not None and self.layer_token_bytes:
            self._running[1][position] = nbytes / self.layer_token_bytes
            self._reported |= position in self._running[0]

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
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._active, self._running, self.stacks = [], None, None, []
        unwatch = getattr(self.probe, "unwatch_model", None)
        if callable(unwatch):
            unwatch()
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
        lifecycle.let_go(self._model, self)
        self._model, self._dormant, self.optimizer = None, [], None
        self.host.release_all()

    def retire(self) -> None:
        """Another controller takes this one's model over: remove the hooks and put back the functions found."""
        self.detach(restore=True)

    def _measured_on(self, model: torch.nn.Module) -> None:
        """Take the identity of the model being attached; drop measurements taken on a model of another one."""
        assert self.switch is not None
        self._layer_bytes_guess = observe.layer_token_bytes(model)
        identity = lifecycle.model_identity(
            model, layers=len(self.switch.layers), hidden=observe.hidden_size(model), recompute=self.settings.recompute
        )
        held = self.state_dict()
        kept = lifecycle.measurements_for(held, identity)
        if kept is not held:
            self.reset()
            self._restore(kept)
        self._attached_identity = self.identity = identity

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

    def _repair_for_no_grad(self) -> None:
        """Before a train-mode forward without gradients: follow what is installed, but decide and count nothing.

        TRL's KTO trainer runs its KL forward so, right after the reference forward's toggle, and transformers
        before 5.24 checkpoints such forwards too: the functions the toggle installed (``offload`` key and all)
        would run. While every target has checkpointing off (a reference forward inside the toggle) nothing runs
        a checkpoint function, so nothing is rebuilt and the level stays as the last training forward left it.
        """
        if self.switch is None:
            return
        targets = self.switch.targets
        if targets and all(getattr(t.module, "gradient_checkpointing", True) is False for t in targets):
            return
        self._follow_installed()

    def _rebuild(self) -> None:
        assert self.switch is not None and self._model is not None
        targets, unknown = find_targets(self._model)
        for key, message in uncontrolled(self._model, unknown):
            self.warn(key, message)
        if not targets:
            watched = [(t.module, t.attribute) for t in self.switch.targets] or [(m, a) for m, a, _ in self._dormant]
            self._dormant = [(m, a, getattr(m, a, None)) for m, a in watched]
        if not targets and not unknown:
            self.warn(
                "checkpointing-off",
                "checkpointing was turned off during training, so nothing is offloaded and autooffload reports "
                "level 0 until it is turned on again",
            )
        level = max(self.switch.offloaded, 0)
        self.switch.close()
        self.switch = CheckpointSwitch(targets, self.stats, self.switch.engine, warn=self.warn)
        self.switch.forward.on_first_call = self._on_first_call
        self._plan_stacks(self._model, targets)
        self._running = None
        self._configure_keep(self._model)
        self.reinstalls += 1
        self._apply(level)
        logger.debug(
            "autooffload: checkpoint functions replaced from outside; %d layer(s) now", len(self.switch.layers)
        )

    def _watch_model(self, model: torch.nn.Module) -> None:
        """Hand the model to a probe that counts it itself (``watch_model``: SimulatedDevice); one that fails
        to take it is dropped, with a warning, and training goes on without memory readings."""
        watch = getattr(self.probe, "watch_model", None)
        if not callable(watch):
            return
        try:
            watch(model, lambda: self.optimizer)
        except Exception as error:
            self.warn("probe-watch", f"memory probe watch_model failed ({error!r}); no memory reading from it")
            self.probe = None

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

    def _plan_stacks(self, model: torch.nn.Module, targets: list) -> None:
        """The planned stacks, and each one's layer input per token relative to ``layer_token_bytes`` (its hidden
        size over the model's: an encoder and a decoder of different widths)."""
        self._inputless = set()
        self.stacks, warning = plan_stacks(model, targets)
        if warning is not None:
            self.warn(*warning)
        reference = observe.hidden_size(model)
        self._config_width = {
            stack.name: stack.hidden / reference if stack.hidden and reference else 1.0 for stack in self.stacks
        }
        learned = {name: width for name, width in self._stack_width.items() if name in self._config_width}
        self._stack_width = {**self._config_width, **learned}  # learned or restored ones stay (a rebuild, a resume)

    def _entry_hooks(self, module: torch.nn.Module, stacks: list[Stack]) -> list[Any]:
        """A pre- and a post-forward hook on a module that a micro-batch may enter without the attached model
        (TRL's Liger-loss path calls ``model.model``): it decides there for the stacks it runs."""

        def enter(entered: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            self._enter(entered, stacks, args, kwargs)

        return [
            module.register_forward_pre_hook(enter, with_kwargs=True),
            module.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True),
        ]

    @torch.compiler.disable
    def _post_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._active is module:
            self._active = None

    @torch.compiler.disable
    def _pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._enter(module, self.stacks, args, kwargs)

    @torch.compiler.disable
    @guarded("the pre-forward hook")
    def _enter(self, module: torch.nn.Module, stacks: list[Stack], args: tuple, kwargs: dict) -> None:
        """The first entry a call reaches decides, once for the micro-batch and every stack the call runs;
        the entries inside it (an encoder-decoder's encoder and decoder) then find it decided."""
        if self._active is not None:
            return
        self._active = module
        if self.switch is not None:
            self.switch.new_forward()
        if not module.training:
            return
        if not torch.is_grad_enabled():
            self._repair_for_no_grad()
            return
        lengths = read_lengths(module, stacks, args, kwargs) if stacks else {}
        if not lengths:
            shape = token_shape(args, kwargs)
            if shape is None and self.switch is not None and self.switch.layers:
                self.warn(
                    "no-tokens",
                    f"{type(module).__name__} was called without input_ids or inputs_embeds; the sequence-length "
                    "trigger is off for such calls and only the memory reading decides",
                )
            shape = shape or (0, 0)
            lengths = {stack.name: shape for stack in stacks}
            seq_len, tokens = shape
        else:
            # Stacks of one role read one input (HRM's two text stacks the same input_ids): its tokens count once.
            by_role = {stack.role: lengths[stack.name][1] for stack in stacks if stack.name in lengths}
            seq_len, tokens = max(seq for seq, _ in lengths.values()), sum(by_role.values())
        if not self._step_begun:
            self.begin_step()
        if len(self.stacks) > 1:
            self.before_forward(seq_len, tokens, lengths)
        else:  # one stack: the two-argument call that tests and benchmarks wrap
            self.before_forward(seq_len, tokens)

    def before_forward(self, seq_len: int, tokens: int, lengths: dict[str, tuple[int, int]] | None = None) -> int:
        """Decide for the micro-batch about to run and install the decision. Returns the layers offloaded.

        ``seq_len``: the longest of the stacks' lengths (the sequence trigger reads it); ``tokens``: the micro-batch's
        input tokens (an encoder-decoder's source and target together; stacks that read one input, such as HRM's,
        count it once). ``lengths``: (sequence length, tokens) per planned stack, by name; a stack
        not named runs no tokens, and without ``lengths`` every planned stack runs ``seq_len`` and ``tokens``."""
        if self.switch is None:
            return 0
        self._close_micro_batch()
        self._follow_installed()
        self.switch.engine.begin_forward()
        self._settle_budget()
        self.last_seq_len, self.last_tokens = seq_len, tokens
        self.last_lengths = dict(lengths) if lengths is not None else {s.name: (seq_len, tokens) for s in self.stacks}
        per_call, layer_tokens, order = self._layer_tokens_and_order()
        ltb = self.layer_token_bytes
        self.planned_layer_bytes = tuple(round(t * ltb) for t in layer_tokens) if ltb else None
        planned = self.planned_layer_bytes
        layer_bytes = tuple(planned[i] for i in order) if planned is not None else None  # in offload order
        self.bytes_per_layer = round(sum(layer_bytes) / len(layer_bytes)) if layer_bytes else None
        cap = self._host_cap(tokens, layer_bytes)
        decided = self._capped(self._decide(seq_len, tokens, cap, layer_bytes), cap) if self.switch.layers else 0
        if len(self.stacks) > 1:
            level, keep = agree(self, decided, cap), 0  # several stacks: the keep rung keeps nothing
        elif self.settings.recompute == "auto":
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
                self.step + 1,
                seq_len,
                self.switch.offloaded,
                level,
                len(self.switch.layers),
            )
        auto = self.settings.recompute == "auto" and not self.compiled and len(self.stacks) <= 1
        measure = auto and self.kept_model.wants(level, tokens, seq_len)
        self._apply(level, keep, measure, order)
        self.kept_model.forward(tokens, seq_len, self.switch.kept, self._keep_plain)
        self._offloaded_this_step |= level > 0
        self._running = (frozenset(order[: self.switch.offloaded]), per_call)
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

    def _layer_tokens_and_order(self) -> tuple[list[float], list[float], tuple[int, ...]]:
        """Per planned layer, the tokens of one call's saved input in this micro-batch, in units of
        ``layer_token_bytes`` (its stack's tokens x its stack's width), and of all its calls (times its calls in
        the last forward that ran it: HRM's cycles); and the order the layers offload in: those that free the
        most first, module order among equals (the earliest first)."""
        assert self.switch is not None
        calls = self.switch.forward.last
        per_call = []
        for position, slot in enumerate(self.switch.layers):
            stack = slot.target.stack
            tokens = 0 if position in self._inputless else self.last_lengths.get(stack, (0, 0))[1]
            per_call.append(tokens * self._stack_width.get(stack, 1.0))
        layer_tokens = [count * tokens for count, tokens in zip(calls, per_call, strict=True)]
        order = tuple(sorted(range(len(layer_tokens)), key=lambda i: -layer_tokens[i]))
        return per_call, layer_tokens, order

    def planned_bytes(self) -> float | None:
        """What the running micro-batch's offloaded layers move by autooffload's arithmetic: each one's calls so
        far x its stack's tokens x its stack's width x ``layer_token_bytes``; None before any bytes per token are
        known. After the backward it is what the engine must have moved (the conformance sweep checks it)."""
        if self.switch is None or self._running is None or not self.layer_token_bytes:
            return None
        offloaded, per_call = self._running
        counts = self.switch.forward.counts
        return self.layer_token_bytes * sum(counts[p] * per_call[p] for p in offloaded if p < len(counts))

    def _close_micro_batch(self) -> None:
        """The micro-batch that ran last is over: add its offloaded layers' saved tokens, as their calls counted
        them, to the step's (``end_step`` measures ``layer_token_bytes`` from them and the bytes moved where no
        layer call reported its bytes)."""
        if self.switch is None:
            return
        counts = self.switch.forward.take_counts()
        if self._running is None:
            return
        offloaded, per_call = self._running
        self._running = None
        self._layer_tokens += sum(counts[p] * per_call[p] for p in offloaded if p < len(counts))

    def _host_cap(self, tokens: int, layer_bytes: tuple[int, ...] | None = None) -> int | None:
        """The most layers whose saved inputs fit this rank's host budget at ``tokens``; None if not known yet."""
        assert self.switch is not None
        if self.host.budget_bytes is None or not self.layer_token_bytes or tokens <= 0:
            return None
        layers = len(self.switch.layers)
        if layer_bytes is None:
            cap = min(layers, self.host.budget_bytes // page_round(round(self.layer_token_bytes * tokens)))
        else:
            cap, held = 0, 0
            for nbytes in layer_bytes:
                held += page_round(nbytes)
                if held > self.host.budget_bytes:
                    break
                cap += 1
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
                self.step + 1,
                cap,
                level,
                self.host.budget_bytes / 2**20,
                self.settings.host_memory,
                self.last_tokens,
            )
        return cap

    def _decide(
        self, seq_len: int, tokens: int, host_layers: int | None = None, layer_bytes: tuple[int, ...] | None = None
    ) -> int:
        assert self.switch is not None
        self.last_observation = None
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
            bytes_per_layer=self.bytes_per_layer,
            layer_bytes=layer_bytes if layer_bytes and len(set(layer_bytes)) > 1 else None,
            levels=compile_levels(layers, self.settings.compile_max_switches) if self.compiled else None,
            last_step_rescued=self.last_step_rescued,
            logits_bytes_per_token=self.logits_token_bytes,
            layer_work_bytes_per_token=self.work_token_bytes,
            pending_bytes=self.pending_bytes,
            last_step_clean=self.last_step_clean,
            host_layers=host_layers,
        )
        self.last_observation = observation
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
        if len(self.stacks) > 1:
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
        try:
            predicted = predict(tokens, self.bytes_per_layer)  # sized as the decision sized it: each stack's width
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
        self._keep_config = (weights, weight_bytes, observe.layer_shape(model))
        self.kept_model.configure(*self._keep_config)
        if self._backward_hook is None and self.settings.recompute == "auto":
            self._backward_hook = count_backwards(model, lambda: self.kept_model.backward())

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

    @guarded("rescue", False)
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
            self.step + 1,
            len(self.switch.layers),
        )
        return True

    # ---- open and close a step -----------------------------------------------------------------------

    @guarded("begin_step")
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

    @guarded("end_step")
    def end_step(self) -> None:
        """Close an optimizer step: bytes moved, memory reading, dwell counter."""
        self._close_micro_batch()
        self._settle_budget()
        self.last_step_bytes = self.stats.next_step()
        # Where the layer calls said their bytes, the step's tokens are those bytes over layer_token_bytes itself:
        # measuring it again would only fold in what the engine did not move (the stream engine's last layer, an
        # input already moved), step after step, towards 0.
        if self.last_step_bytes and self._layer_tokens and not self.rescuing and not self._reported:
            self.layer_token_bytes = self.last_step_bytes / self._layer_tokens
        self._layer_tokens, self._reported = 0, False
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

    def _apply(self, level: int, keep: int = 0, measure: bool = False, order: tuple[int, ...] | None = None) -> None:
        assert self.switch is not None
        self.switch.apply(level, keep, measure, order)
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
            "stack_width": dict(self._stack_width),
            "last_step_rescued": self.last_step_rescued,
            "last_step_clean": self.last_step_clean,
            "pending_bytes": self.pending_bytes,
            "policy": self._policy_state(),
            "kept_model": self.kept_model.state_dict(),
            "identity": self.identity,
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
        """Continue the run a checkpoint saved: everything of this controller's run is replaced by ``state``.

        Measurements taken on a model of another identity than the attached one (:mod:`autooffload.lifecycle`)
        are dropped, with one INFO line; before attach, :meth:`attach` checks them.
        """
        if self._model is not None:
            state = lifecycle.measurements_for(state, self.identity)
        self.reset()
        self._restore(state)
        # The checkpoint was written after its last step; in the uninterrupted run the next reading follows
        # that save, and here it follows the load: either way no clean sample, unless the probe's reset at the
        # step's start keeps the work out of it.
        self._side_work = True
        if self.switch is not None:
            self._apply(self.level if self.level is not None else max(self.switch.offloaded, 0))

    def _restore(self, state: dict[str, Any]) -> None:
        self.step = int(state.get("step", 0))
        self.switches = int(state.get("switches", 0))
        self.steps_offloading = int(state.get("steps_offloading", 0))
        self.stats.total_bytes = int(state.get("total_bytes", 0))
        self.latched = bool(state.get("latched", False))
        self.budget.spent = int(state.get("budget_spent", 0))
        self.rescues = int(state.get("rescues", 0))
        memory = state.get("memory") or {}
        self.memory_fraction = memory.get("fraction")
        self.memory_bytes = memory.get("bytes")
        self.total_bytes = memory.get("total")
        self.peak_memory_fraction = state.get("peak_memory_fraction")
        self.layer_token_bytes = state.get("layer_token_bytes") or self.layer_token_bytes
        widths = state.get("stack_width")
        if isinstance(widths, dict):  # before attach every name; after, those of the planned stacks
            known = self._config_width or widths
            self._stack_width.update({str(name): float(width) for name, width in widths.items() if name in known})
        self.last_step_rescued = bool(state.get("last_step_rescued", False))
        self.last_step_clean = bool(state.get("last_step_clean", True))
        self.pending_bytes = int(state.get("pending_bytes") or 0)  # a checkpoint after step 0: Adam's state to come
        self.level = state.get("level")
        legacy = {key: state[key] for key in ("longest_read_tokens", "reading_kept_bytes") if key in state}
        self.kept_model.load_state_dict({**legacy, **(state.get("kept_model") or {})})
        if "identity" in state and self._model is None:
            self.identity = state["identity"]
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
