"""The ladder (AUTOOFFLOAD_RECOMPUTE=auto): keep, recompute or offload per checkpointed layer and micro-batch.

Keep runs a checkpointed layer without checkpointing. What holds for recompute and offload holds with keep:
losses and parameters equal plain checkpointing's bit for bit (fp32, CPU, dropout on), on transformers'
layers and torch's CheckpointWrapper; the plan keeps only what fits under memory_high with a margin, measured
by counting what a kept layer saves; nothing is kept without a memory reading.
"""

from __future__ import annotations

import pytest
import torch
from conftest import LAYERS, InOrderTrainer, dataset, expected_bytes, training_args

from autooffload import AutoOffloadCallback, AutoOffloadWarning, MemoryReading, OffloadController, Settings
from autooffload.apply.keep import SavedBytesCounter
from autooffload.apply.offload import OffloadStats
from autooffload.apply.switch import CheckpointSwitch
from autooffload.decide import ladder
from autooffload.decide.activations import KeptLayerModel, LayerShape
from autooffload.demo import tiny_qwen3
from autooffload.observe.targets import find_targets

HIDDEN = 64


def qwen3(dropout: float = 0.1, attention: str = "sdpa", layers: int = LAYERS) -> torch.nn.Module:
    return tiny_qwen3(layers, HIDDEN, 256, 0, attention_dropout=dropout, attn_implementation=attention)


def checkpointed(net: torch.nn.Module) -> torch.nn.Module:
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return net.train()


class Ample:
    """A device with room to spare: every reading is 1% of it."""

    def read(self) -> MemoryReading:
        return MemoryReading(10**7, 10**9)


def ids(seq: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seq))


def train_loop(net, controller, lengths, budget=None):
    """Forward, backward and AdamW per length; the losses, and what each step kept (fraction of layers)."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    torch.manual_seed(1)  # dropout draws from here
    losses, kept = [], []
    for seq in lengths:
        loss = net(input_ids=ids(seq), labels=ids(seq)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if controller is not None:
            controller.end_step()
            kept.append(controller.record.kept)
    return losses, kept


# ---- the setting ------------------------------------------------------------------------------------------


def test_recompute_setting_default_environment_argument_and_bad_values(monkeypatch):
    assert Settings.from_env({}).recompute == "always"
    assert Settings.from_env({"AUTOOFFLOAD_RECOMPUTE": "Auto"}).recompute == "auto"
    assert AutoOffloadCallback(recompute="auto", probe=None).controller.settings.recompute == "auto"
    with pytest.raises(ValueError, match=r"AUTOOFFLOAD_RECOMPUTE='sometimes' is not allowed: expected one of always"):
        Settings.from_env({"AUTOOFFLOAD_RECOMPUTE": "sometimes"})
    monkeypatch.setenv("AUTOOFFLOAD_RECOMPUTE", "never")
    with pytest.raises(ValueError, match="AUTOOFFLOAD_RECOMPUTE='never'"):
        AutoOffloadCallback()


# ---- the pure plan ----------------------------------------------------------------------------------------


def test_plan_keeps_what_fits_under_the_limit_less_the_margin():
    assert ladder.plan(None, 10, 5, 4, 1000) == ladder.Rungs(0, 0)  # no prediction: no reading yet
    assert ladder.plan(600, 100, 5, 4, 1000, margin=50) == ladder.Rungs(0, 3)  # 350 of room: 3 layers of 100
    assert ladder.plan(100, 100, 5, 4, 1000) == ladder.Rungs(0, 4)  # never more than the layers
    assert ladder.plan(600, None, 5, 4, 1000) == ladder.Rungs(0, 0)  # kept bytes unknown
    assert ladder.plan(960, 100, 5, 4, 1000, margin=50) == ladder.Rungs(0, 0)  # inside the margin
    # Over the limit: the fewest offloaded layers that bring it under, at most all but the last; nothing kept.
    assert ladder.plan(1012, 100, 5, 4, 1000) == ladder.Rungs(3, 0)
    assert ladder.plan(1100, 100, 5, 4, 1000) == ladder.Rungs(3, 0)
    assert ladder.plan(1004, 100, 5, 4, 1000) == ladder.Rungs(1, 0)
    # torch.compile: rounded down to an allowed number of kept layers.
    assert ladder.plan(600, 100, 5, 4, 1000, margin=50, keep_levels=(0, 2, 4)) == ladder.Rungs(0, 2)
    assert ladder.keep_levels(36, 4) == (0, 12, 24, 36) and ladder.keep_levels(4, 1) == (0, 4)


# ---- the memory model of keep -----------------------------------------------------------------------------


def test_counter_counts_each_storage_once_and_passes_tensors_through():
    base = torch.randn(64, requires_grad=True)
    x = base * 1.0
    with SavedBytesCounter(set()) as counter:
        y = (x[:32] * x[32:]).sum()  # mul saves two views of x's storage
    assert counter.bytes == 64 * 4
    y.backward()
    assert torch.equal(base.grad, torch.cat([x[32:], x[:32]]).detach())


def test_counter_hands_tensors_to_the_hooks_around_it():
    packed = []
    x = torch.randn(16, requires_grad=True)
    outer = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.numel()) or t, lambda t: t)
    with outer, SavedBytesCounter(set()) as counter:
        y = (x.exp() * 2).sum()
    y.backward()
    assert counter.bytes == 16 * 4 and packed == [16]


def test_a_measured_step_leaves_no_layer_input_for_the_garbage_collector(monkeypatch):
    """recompute="auto" counts what a layer would keep inside plain checkpointing (the measuring plain function).
    Once the step is over, the measured calls' inputs are freed at once, as plain checkpointing frees them.
    Before: the counter and its pack hook referred to each other, and the hook holds the checkpoint's, whose frame
    holds the measured call's inputs: every measured layer's input (and the position embeddings) stayed allocated
    until Python's cyclic collector ran, steps later (on an H200, 648 MiB through the next steps, of every run
    sharing the device, for a 16-layer Qwen3 at 16384 tokens)."""
    import gc
    import weakref

    from autooffload.apply import switch

    inputs = []
    measuring = switch.measuring_plain_function

    def watching(plain, excluded, reporter, *rest):
        measured = measuring(plain, excluded, reporter, *rest)

        def checkpoint(function, *args, **kwargs):
            inputs.append(weakref.ref(args[0]))  # the layer's input (its hidden states)
            return measured(function, *args, **kwargs)

        return checkpoint

    monkeypatch.setattr(switch, "measuring_plain_function", watching)
    net = checkpointed(qwen3(dropout=0.0))
    controller = OffloadController(Settings(recompute="auto"), probe=Ample())
    controller.attach(net)
    collecting = gc.isenabled()
    gc.disable()
    try:
        net(input_ids=ids(64), labels=ids(64)).loss.backward()  # no reading yet: every layer recomputes, measured
        net.zero_grad(set_to_none=True)
        controller.end_step()
        assert controller.switch.measuring and len(inputs) == LAYERS
        assert [i for i, ref in enumerate(inputs) if ref() is not None] == []  # the layers whose input lives
    finally:
        if collecting:
            gc.enable()
        controller.detach()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_measured_bytes_and_the_fit_across_lengths(attention):
    net = checkpointed(qwen3(dropout=0.0, attention=attention))
    controller = OffloadController(Settings(recompute="auto"), probe=Ample())
    controller.attach(net)
    train_loop(net, controller, [64, 128, 64, 128, 96, 64])
    # Measured once per length and layer, where it kept (every layer here): the layers are alike.
    every = controller.planner.keep.samples
    assert set(every) == {(i, t, t) for i in range(LAYERS) for t in (64, 128, 96)}
    assert len({every[(i, 96, 96)] for i in range(LAYERS)}) == 1
    samples = controller.planner.keep.layers[-1].samples
    shape = controller.planner.keep.layers[-1].seed
    if attention == "sdpa":
        # fp32, SDPA on a CPU: linear in tokens, and the seed's arithmetic is the count (4.52.4) or one
        # hidden-sized tensor per token above it (5.23 saves one less).
        assert samples[(128, 128)] == 2 * samples[(64, 64)]
        for (tokens, seq), counted in samples.items():
            assert shape.bytes(tokens, seq) - counted in (0, 2 * HIDDEN * 4 * tokens)
    else:
        # Eager attention saves its probabilities: a term in tokens x seq, which the fit through two lengths
        # predicts at the third exactly.
        model = KeptLayerModel(shape)
        model.add(64, 64, samples[(64, 64)])
        model.add(128, 128, samples[(128, 128)])
        assert model.predict(96, 96) == pytest.approx(samples[(96, 96)])
        assert samples[(128, 128)] > 2 * samples[(64, 64)]


def test_seed_from_a_config_and_state_round_trip():
    shape = LayerShape.from_config(qwen3(attention="eager").config, 2)
    assert (shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim) == (64, 128, 4, 2, 16)
    assert shape.quadratic and shape.dropout and shape.bytes_per_token_and_position() > 0
    assert shape.bytes(64, 128) - shape.bytes(64, 64) == 64 * 64 * shape.bytes_per_token_and_position()
    model = KeptLayerModel(shape)
    assert model.predict(64, 64) == shape.bytes(64, 64)  # the seed until a measurement
    model.add(64, 64, 1000.0)
    assert model.predict(64, 64) == 1000.0
    assert model.predict(128, 64) == pytest.approx(1000.0 * shape.bytes(128, 64) / shape.bytes(64, 64))
    again = KeptLayerModel(shape)
    again.load_state_dict(model.state_dict())
    assert again.samples == model.samples and again.cast_bytes == 0


# ---- results equal plain checkpointing --------------------------------------------------------------------


def test_keep_trains_bit_identically_to_plain_checkpointing_with_dropout():
    lengths = [64, 96, 64, 96, 64]
    reference = checkpointed(qwen3())
    plain_losses, _ = train_loop(reference, None, lengths)
    net = checkpointed(qwen3())
    controller = OffloadController(Settings(recompute="auto"), probe=Ample())
    controller.attach(net)
    losses, kept = train_loop(net, controller, lengths)
    # Step 0 has no reading; step 1 is longer than any a reading has covered; from then on every layer keeps.
    assert kept == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert losses == plain_losses
    for (name, parameter), other in zip(net.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter, other), name


def test_all_three_rungs_at_once_match_plain_checkpointing_and_offload_the_arithmetic():
    reference = checkpointed(qwen3())
    net = checkpointed(qwen3())
    targets, _ = find_targets(net)
    stats = OffloadStats()
    switch = CheckpointSwitch(targets, stats)
    switch.apply(1, 2)  # layer 0 offloads, layer 1 recomputes, layers 2 and 3 keep
    assert (switch.offloaded, switch.kept) == (1, 2)
    for model in (reference, net):
        torch.manual_seed(1)
        model(input_ids=ids(80, batch=2), labels=ids(80, batch=2)).loss.backward()
    assert stats.step_bytes == expected_bytes(80, batch=2, layers=1)
    for (name, parameter), other in zip(net.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter.grad, other.grad), name
    switch.apply(3, 4)  # keep is what the offload leaves
    assert (switch.offloaded, switch.kept) == (3, 1)


def test_checkpoint_wrapper_keep_calls_the_wrapped_module():
    wrapping = pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    lengths = [64, 64, 64]
    reference = qwen3().train()
    net = qwen3().train()
    for index, layer in enumerate(net.model.layers):
        net.model.layers[index] = wrapping.checkpoint_wrapper(layer)  # accelerate's FSDP2 wrap, RNG preserved
    controller = OffloadController(Settings(recompute="auto"), probe=Ample())
    controller.attach(net)
    losses, kept = train_loop(net, controller, lengths)
    assert kept == [0.0, 1.0, 1.0]
    assert losses == train_loop(reference, None, lengths)[0]
    names = [name.replace(wrapping._CHECKPOINT_PREFIX, "") for name, _ in net.named_parameters()]
    for name, parameter, other in zip(names, net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter, other), name


# ---- when it keeps --------------------------------------------------------------------------------------


class CountingProbe:
    """A device whose memory is a fixed part (weights, gradients, optimizer) plus the saved activations alive
    at the end of the forward, counted exactly by saved-tensor hooks around every forward (offloaded inputs
    do not count: they are in host memory)."""

    def __init__(self, static: int, total: int) -> None:
        self.static, self.total = static, total
        self.peak = 0
        self.counted: list[int] = []

    def forward(self, net, seq):
        with SavedBytesCounter({(p.device, p.untyped_storage().data_ptr()) for p in net.parameters()}) as counter:
            loss = net(input_ids=ids(seq), labels=ids(seq)).loss
        self.peak = max(self.peak, counter.bytes)
        self.counted.append(counter.bytes)
        return loss

    def read(self) -> MemoryReading:
        peak, self.peak = self.peak, 0
        return MemoryReading(self.static + peak, self.total)


def test_keeps_the_last_layers_that_fit_and_the_counted_peak_stays_under_memory_high():
    # Calibrate: what a 64- and a 256-token step hold with every layer recomputing and with none.
    def counted(seq, keep):
        net = checkpointed(qwen3(dropout=0.0))
        switch = CheckpointSwitch(find_targets(net)[0], OffloadStats())
        switch.apply(0, keep)
        probe = CountingProbe(0, 1)
        probe.forward(net, seq).backward()
        return probe.counted[0]

    recompute, everything = counted(256, 0), counted(256, LAYERS)
    per_layer = (everything - recompute) / LAYERS
    static, high = 10**6, 0.9
    # Room for 2.5 kept layers at 256 tokens beyond the margin, and for all of them at 64.
    total = round((static + recompute + 2.5 * per_layer) / (high - ladder.KEEP_MARGIN))
    net = checkpointed(qwen3(dropout=0.0))
    probe = CountingProbe(static, total)
    controller = OffloadController(Settings(recompute="auto", memory_high=high, memory_low=0.5), probe=probe)
    controller.attach(net)
    lengths = [64, 256, 64, 256, 64, 256]
    kept = []
    for seq in lengths:
        probe.forward(net, seq).backward()
        net.zero_grad()
        kept.append(controller.switch.kept)
        controller.end_step()
    assert kept == [0, 0, LAYERS, 2, LAYERS, 2]
    # The last layers keep: layers 2 and 3 run the keep function at 256 tokens.
    functions = [layer._gradient_checkpointing_func.__name__ for layer in net.model.layers]
    assert functions == ["checkpoint_plain"] * 2 + ["checkpoint_keep"] * 2
    assert all(static + value <= high * total for value in probe.counted)
    assert controller.metrics()["autooffload/kept"] == 0.5


def test_without_a_reading_auto_behaves_as_always():
    lengths = [64, 64, 256, 64]
    runs = {}
    for recompute in ("always", "auto"):
        net = checkpointed(qwen3())
        controller = OffloadController(Settings(recompute=recompute, seq_high=200, seq_low=100), probe=None)
        controller.attach(net)
        losses, kept = train_loop(net, controller, lengths)
        runs[recompute] = (losses, kept, controller.stats.total_bytes, controller.record.switches)
    assert runs["auto"] == runs["always"]
    assert runs["auto"][1] == [0.0] * 4 and runs["auto"][2] >= expected_bytes(256)


def test_trainer_logs_the_kept_fraction_and_the_policy_sees_the_peak_as_if_all_recomputed(tmp_path):
    seen = []
    callback = AutoOffloadCallback(recompute="auto", probe=Ample())
    policy = callback.controller.policy
    decide = policy.decide
    policy.decide = lambda observation: seen.append(observation.memory_bytes) or decide(observation)
    net = qwen3(dropout=0.0)
    args = training_args(tmp_path, 4)
    trainer = InOrderTrainer(model=net, args=args, train_dataset=dataset([64] * 4), callbacks=[callback])
    trainer.train()
    kept = [h["autooffload/kept"] for h in trainer.state.log_history if "loss" in h]
    assert kept == [0.0, 1.0, 1.0, 1.0]
    # The policy sees each reading less what the kept layers added. Ample reads no segments, so that is read off the
    # whole steps: its reading is the same whatever keeps, so the kept layers added nothing of what they save.
    keep = callback.controller.planner.keep
    assert keep.kept_bytes(LAYERS, 64, 64) > 0 and keep.growth([(LAYERS, 64, 64)]) == 0
    assert seen == [None, 10**7, 10**7, 10**7]


def test_keep_is_off_while_offloading_rescuing_or_in_fixed_modes():
    net = checkpointed(qwen3(dropout=0.0))
    controller = OffloadController(Settings(recompute="auto"), probe=Ample())
    controller.attach(net)
    train_loop(net, controller, [64, 64])
    assert controller.before_forward(64, 64) == 0 and controller.switch.kept == LAYERS
    assert controller.rescue()
    assert controller.before_forward(64, 64) == LAYERS and controller.switch.kept == 0  # rescue: all offload
    controller.end_step()
    # The rescue taught the policy to offload at this length: while it offloads, nothing is kept.
    assert controller.before_forward(64, 64) > 0 and controller.switch.kept == 0
    for mode in ("on", "off"):
        fixed = OffloadController(Settings(recompute="auto", mode=mode), probe=Ample())
        fixed.attach(checkpointed(qwen3(dropout=0.0)))
        fixed.end_step()
        fixed.planner.keep.longest_read_tokens = 64
        fixed.before_forward(64, 64)
        assert fixed.switch.kept == 0


def test_a_micro_batch_that_offloads_counts_nothing():
    """Counting what a layer keeps holds its activations until its forward ends: a micro-batch whose plan offloads
    (its budget is tight) does not count, even for the layers that do not offload."""

    class Two:  # offloads two layers, whatever the memory says
        def decide(self, observation):
            return 2

    net = checkpointed(qwen3(dropout=0.0))
    controller = OffloadController(Settings(recompute="auto"), probe=Ample(), policy=Two())
    controller.attach(net)
    train_loop(net, controller, [64, 96])
    assert controller.switch.offloaded == 2 and not controller.switch.measuring
    assert controller.planner.keep.samples == {}


def test_a_policy_that_cannot_predict_keeps_nothing_with_one_warning():
    net = checkpointed(qwen3(dropout=0.0))
    controller = OffloadController(Settings(recompute="auto", policy="hysteresis"), probe=Ample())
    controller.attach(net)
    with pytest.warns(AutoOffloadWarning, match="RECOMPUTE=auto needs a policy that predicts"):
        _, kept = train_loop(net, controller, [64, 64, 64])
    assert kept == [0.0, 0.0, 0.0]


# ---- many ranks, resume -----------------------------------------------------------------------------------


def test_ranks_agree_on_the_most_offload_and_the_least_keep(monkeypatch):
    from autooffload import distributed

    sent = []
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "AgreementGroup", lambda: None)  # the join at attach: both ranks have layers
    monkeypatch.setattr(distributed, "join_ranks", lambda ready, gave_up, group, made: made() or (True, None))
    # The other rank asks for one kept layer; values are distributed.message()'s: [offload, -host cap, -keep, ...].
    monkeypatch.setattr(
        distributed,
        "all_reduce_max",
        lambda values, group=None, made=None: made() or sent.append(values) or [*values[:2], -1, *values[3:]],
    )
    net = checkpointed(qwen3(dropout=0.0))
    controller = OffloadController(Settings(recompute="auto"), probe=Ample())
    controller.attach(net)
    train_loop(net, controller, [64, 64])
    # This rank asked for all layers kept; the other rank for one: one runs, with one collective per micro-batch.
    assert controller.switch.kept == 1
    assert sent == [distributed.message(0, LAYERS, 0), distributed.message(0, LAYERS, LAYERS)]


def test_the_measured_model_is_in_the_saved_state():
    net = checkpointed(qwen3(dropout=0.0))
    controller = OffloadController(Settings(recompute="auto"), probe=Ample())
    controller.attach(net)
    train_loop(net, controller, [64, 64, 64])
    state = controller.state_dict()
    resumed = OffloadController(Settings(recompute="auto"), probe=Ample())
    resumed.load_state_dict(state)
    resumed.attach(checkpointed(qwen3(dropout=0.0)))
    samples = resumed.planner.keep.samples
    assert samples == controller.planner.keep.samples and (3, 64, 64) in samples
    assert resumed.planner.keep.longest_read_tokens == 64
    # The last reading is in the state too: the first micro-batch after the resume keeps, as the uninterrupted
    # run's would, and measures nothing again.
    resumed.before_forward(64, 64)
    controller.before_forward(64, 64)
    assert resumed.switch.kept == controller.switch.kept == LAYERS and not resumed.switch.measuring


def test_a_container_models_kept_calls_run_the_layer_directly():
    from test_layers import LAYERS as CALLS
    from test_layers import layer_bytes, remote_model

    lengths = [48, 48, 48]
    reference = remote_model()
    reference.gradient_checkpointing_enable()
    net = remote_model()
    net.gradient_checkpointing_enable()
    controller = OffloadController(Settings(recompute="auto"), probe=Ample())
    controller.attach(net)
    losses, kept = train_loop(net.train(), controller, lengths)
    assert kept == [0.0, 1.0, 1.0] and controller.switch.kept == CALLS
    assert losses == train_loop(reference.train(), None, lengths)[0]
    for parameter, other in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter, other)
    # The three rungs within one container's calls: call 0 offloads its layer input (not the mask), call 1
    # recomputes, call 2 runs the layer directly; gradients equal plain checkpointing's.
    controller.detach()
    net.zero_grad()
    reference.zero_grad()
    stats = OffloadStats()
    switch = CheckpointSwitch(find_targets(net)[0], stats)
    switch.apply(1, 1)
    switch.new_forward()
    for model in (net, reference):
        model(input_ids=ids(40), labels=ids(40)).loss.backward()
    assert stats.step_bytes == layer_bytes(40)
    for parameter, other in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter.grad, other.grad)


def test_keep_survives_a_trainer_that_disables_and_reenables_checkpointing():
    net = checkpointed(qwen3(dropout=0.0))
    controller = OffloadController(Settings(recompute="auto"), probe=Ample())
    controller.attach(net)
    train_loop(net, controller, [64, 64])
    samples = dict(controller.planner.keep.samples)
    net.gradient_checkpointing_disable()  # what TRL's reference forward does on every step
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, kept = train_loop(net, controller, [64])
    assert kept == [1.0] and controller.record.reinstalls == 1
    assert controller.planner.keep.samples == samples  # nothing measured again
    functions = {layer._gradient_checkpointing_func.__name__ for layer in net.model.layers}
    assert functions == {"checkpoint_keep"}


def test_a_resumed_trainer_run_keeps_as_the_uninterrupted_one(tmp_path):
    lengths = [64] * 5

    def kept_logs(trainer):
        return [h["autooffload/kept"] for h in trainer.state.log_history if "loss" in h]

    def trainer(path, steps, callback, **extra):
        args = training_args(path, steps, **extra)
        return InOrderTrainer(model=qwen3(dropout=0.0), args=args, train_dataset=dataset(lengths), callbacks=[callback])

    uninterrupted = trainer(tmp_path / "full", 5, AutoOffloadCallback(recompute="auto", probe=Ample()))
    uninterrupted.train()
    first = AutoOffloadCallback(recompute="auto", probe=Ample())
    trainer(tmp_path / "run", 3, first, save_strategy="steps", save_steps=3).train()
    second = AutoOffloadCallback(recompute="auto", probe=Ample())
    measured = []
    second.controller.planner.keep.add = lambda *sample: measured.append(sample)
    resumed = trainer(tmp_path / "run", 5, second, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert kept_logs(resumed) == kept_logs(uninterrupted) == [0.0, 1.0, 1.0, 1.0, 1.0]
    # The measured model came with the checkpoint: nothing is measured again.
    assert second.controller.planner.keep.samples == first.controller.planner.keep.samples != {} and measured == []


def test_the_history_records_the_kept_layers_per_micro_batch():
    net = checkpointed(qwen3(dropout=0.0))
    controller = OffloadController(Settings(recompute="auto"), probe=Ample())
    controller.attach(net)
    train_loop(net, controller, [64, 64])
    assert [record.kept for record in controller.record.history.pending] == [[0], [LAYERS]]
