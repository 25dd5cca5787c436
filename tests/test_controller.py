"""The controller without Trainer: what a custom loop relies on."""

from __future__ import annotations

import pytest
import torch
from conftest import LAYERS, expected_bytes, model

from autooffload import AutoOffloadWarning, OffloadController, Rescue, ScriptedProbe, Settings
from autooffload.decide.activations import LayerShape


def checkpointed_model():
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    return net


def step(net, controller, seq):
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
    net(input_ids=ids, labels=ids).loss.backward()
    controller.end_step()


def test_custom_loop_with_attach_and_end_step():
    net = checkpointed_model()
    controller = OffloadController(Settings(seq_high=200, seq_low=100, min_steps=0), probe=None)
    assert controller.attach(net)
    for seq in (64, 256, 64):
        step(net, controller, seq)
    assert controller.step == 3 and controller.record.switches == 2
    assert controller.stats.total_bytes == expected_bytes(256)


def test_detach_leaves_plain_checkpointing_and_no_hook():
    net = checkpointed_model()
    controller = OffloadController(Settings(mode="on"), probe=None)
    controller.attach(net)
    step(net, controller, 64)
    controller.detach()
    step(net, controller, 64)
    assert controller.last_step_bytes == 0
    assert not net._forward_pre_hooks


def test_evaluation_forwards_are_not_micro_batches():
    net = checkpointed_model()
    controller = OffloadController(Settings(seq_high=200, seq_low=100), probe=None)
    controller.attach(net)
    with torch.no_grad():
        net(input_ids=torch.zeros(1, 512, dtype=torch.long))
    assert controller.level == 0 and controller.record.switches == 0


def test_an_unknown_checkpoint_function_is_left_alone_with_a_warning():
    net = checkpointed_model()

    def custom(function, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)

    net.model.layers[0]._gradient_checkpointing_func = custom
    controller = OffloadController(Settings(mode="on"), probe=None)
    with pytest.warns(AutoOffloadWarning, match=r"checkpoint function of model.layers.0 is not torch"):
        controller.attach(net)
    assert net.model.layers[0]._gradient_checkpointing_func is custom
    step(net, controller, 64)
    assert controller.last_step_bytes == expected_bytes(64, layers=LAYERS - 1)


def test_inputs_embeds_count_as_tokens():
    net = checkpointed_model()
    controller = OffloadController(Settings(seq_high=200, seq_low=100), probe=None)
    controller.attach(net)
    embeds = torch.randn(2, 256, 64, requires_grad=True)
    net(inputs_embeds=embeds).logits.sum().backward()
    controller.end_step()
    assert (controller.sizes.batch.seq_len, controller.sizes.batch.tokens) == (256, 512)
    assert controller.last_step_bytes == expected_bytes(256, batch=2)


def test_a_policy_whose_state_methods_raise_cannot_stop_a_save_or_a_resume():
    class Fragile:
        def decide(self, observation):
            return 0

        def state_dict(self):
            raise RuntimeError("boom")

        def load_state_dict(self, state):
            raise AttributeError("gone")

    controller = OffloadController(Settings(), probe=None, policy=Fragile())
    with pytest.warns(AutoOffloadWarning, match=r"state_dict\(\) raised RuntimeError"):
        state = controller.state_dict()
    assert state["policy"] is None
    with pytest.warns(AutoOffloadWarning, match="does not fit Fragile"):
        controller.load_state_dict({**state, "policy": {"any": 1}})


class Fixed:
    """A policy that always asks for the same number of layers."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def decide(self, observation) -> int:
        return self.layers


def reenable(net, kwargs):
    """What TRL's DPO, GRPO and RLOO trainers do around the reference forward, on every step."""
    net.gradient_checkpointing_disable()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.mark.parametrize("kwargs", [{"offload": "auto"}, {"use_reentrant": False}])
def test_checkpointing_re_enabled_every_step_runs_as_decided(kwargs):
    net = checkpointed_model()
    controller = OffloadController(Settings(), probe=None, policy=Fixed(2))
    controller.attach(net)
    moved, active = [], []
    for seq in (64, 96, 80, 64):
        step(net, controller, seq)
        moved.append(controller.last_step_bytes)
        active.append(controller.record.active)
        reenable(net, kwargs)
    assert moved == [expected_bytes(s, layers=2) for s in (64, 96, 80, 64)]
    assert active == [0.5] * 4 and controller.record.switches == 0
    assert controller.record.reinstalls == 3  # before the forwards of steps 2, 3 and 4


def test_checkpointing_turned_off_mid_run_reports_level_0_with_one_warning_until_it_is_back():
    net = checkpointed_model()
    controller = OffloadController(Settings(mode="on"), probe=None)
    controller.attach(net)
    rows = []
    with pytest.warns(AutoOffloadWarning, match="checkpointing was turned off") as caught:
        for index, seq in enumerate((64, 96, 80, 72, 64)):
            if index == 1:
                net.gradient_checkpointing_disable()
            if index == 4:
                net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            step(net, controller, seq)
            active = controller.metrics()["autooffload/active"]
            rows.append((controller.record.active, controller.last_step_bytes, active))
    assert len([w for w in caught if issubclass(w.category, AutoOffloadWarning)]) == 1
    off = (0.0, 0, 0.0)
    assert rows == [(1.0, expected_bytes(64), 1.0), off, off, off, (1.0, expected_bytes(64), 1.0)]
    assert controller.sizes.token_bytes == expected_bytes(1) / LAYERS


class Recording:
    """A policy that records the observations it is given and decides as the predictive policy does."""

    def __init__(self, policy=None):
        from autooffload import PredictivePolicy

        self.policy = policy or PredictivePolicy()
        self.observations = []

    def decide(self, observation):
        self.observations.append(observation)
        return self.policy.decide(observation)


def test_the_observation_carries_the_model_terms_and_the_optimizer_state_still_to_come():
    net = checkpointed_model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    recording = Recording()
    controller = OffloadController(Settings(), probe=None, policy=recording)
    controller.attach(net, optimizer=optimizer)
    for seq in (64, 64, 64):
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        net(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.end_step()
    first, second, third = recording.observations
    params = sum(p.numel() * 4 for p in net.parameters())
    # AdamW allocates its two moments at the first step(): step 0's reading lacks them, step 1's holds them.
    assert [o.pending_bytes for o in (first, second, third)] == [0, 2 * params, 0]
    # fp32 logits and their gradient, vocab 256; one layer's working set, hidden 64, intermediate 128: what the layer
    # saves kept (the keep seed, above the (4 x hidden + 3 x intermediate) x 4 floor), which its recompute remakes.
    assert first.logits_bytes_per_token == 256 * 8
    shape = LayerShape(64, 128, 4, 2, 16, 4)
    assert first.layer_work_bytes_per_token == shape.bytes_per_token() > (4 * 64 + 3 * 128) * 4


class Device:
    """A simulated device for a tiny model: a micro-batch of t tokens with k of its 4 layers offloaded needs
    300,000 + t x 3584 - k x t x 256 bytes, and allocations fail once 750,000 bytes are in use (fragmentation),
    well below the 1,000,000 the device has. The failed attempt's reading stops below the failure, as
    ``max_memory_allocated`` does: it never holds the allocation that failed."""

    TOTAL, FAILS_AT, TRIED = 1_000_000, 750_000, 50_000

    def __init__(self, controller):
        self.controller = controller
        self.peak = 0
        self.failures = []

    def need(self):
        c = self.controller
        return 300_000 + c.sizes.batch.tokens * 3584 - c.level * c.sizes.batch.tokens * 256

    def forward_hook(self, module, args):
        if not (module.training and torch.is_grad_enabled()):
            return
        need = self.need()
        if need > self.FAILS_AT:
            self.peak = max(self.peak, self.FAILS_AT - 10_000)
            self.failures.append((self.controller.step, self.controller.level))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.83 KiB. GPU 0 has ...")
        self.peak = max(self.peak, need)

    def reset(self):
        self.peak = 0

    def read(self):
        from autooffload import MemoryReading

        reading, self.peak = MemoryReading(self.peak, self.TOTAL), 0
        return reading


def test_a_rescued_length_is_planned_with_more_offload_than_the_one_that_failed():
    net = checkpointed_model()
    controller = OffloadController(Settings(), probe=None)
    device = Device(controller)
    controller.memory.choice = device
    controller.attach(net)
    net.model.norm.register_forward_pre_hook(device.forward_hook)
    rescue = Rescue(controller, net)
    levels = []
    for seq in (100, 100, 130, 130, 130, 130):
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        rescue.run(lambda ids=ids: net(input_ids=ids, labels=ids).loss.backward())
        levels.append(controller.level)
        controller.end_step()
    # Step 2, the first of 130 tokens, is planned from the config's seed slope (the loss's buffers, a layer's
    # recompute and the inputs, all per token) and offloads. Step 3, planned from step 2's sample (765,920 bytes as
    # if nothing offloaded, under 90%), plans nothing and fails; the rerun offloads every layer. The reading
    # (740,000) says less than the prediction, but the failure says the step needed the device: the next steps of
    # that length offload more than the attempt that failed, and do not fail again.
    assert levels[2] > 0
    assert device.failures == [(3, 0)] and controller.record.rescues == 1
    assert levels[4] > 0 and levels[5] > 0


class ResettingProbe(ScriptedProbe):
    def reset(self) -> None:
        pass


@pytest.mark.parametrize("probe_kind, clean", [(ScriptedProbe, False), (ResettingProbe, True)])
def test_side_work_before_the_steps_reset_leaves_its_reading_clean(probe_kind, clean):
    # Evaluation between two steps: with a probe that resets at the step's start it is out of the next reading;
    # with one that cannot reset, it may be in it, and the step is no sample.
    controller = OffloadController(Settings(), probe=probe_kind([0.5]))
    controller.attach(checkpointed_model())
    controller.note_side_work()
    controller.begin_step()
    controller.end_step()
    assert controller.memory.last.clean is clean
    controller.begin_step()
    controller.note_side_work()  # within the step, after the reset: in the reading whatever the probe
    controller.end_step()
    assert controller.memory.last.clean is False


class NumpyProbe:
    """A user's probe whose numbers come from numpy (np.int64 is no int: json cannot write it)."""

    def read(self):
        import numpy as np

        from autooffload import MemoryReading

        return MemoryReading(np.int64(95 * 10**9), np.int64(100 * 10**9))


@pytest.mark.parametrize("policy", ["hysteresis", "predictive"])
def test_a_probe_with_numpy_numbers_leaves_a_state_json_can_write(policy):
    import json

    net = checkpointed_model()
    controller = OffloadController(Settings(policy=policy), probe=NumpyProbe())
    controller.attach(net)
    for seq in (64, 64, 64):
        step(net, controller, seq)
    state = json.loads(json.dumps(controller.state_dict()))  # Trainer writes it into trainer_state.json
    resumed = OffloadController(Settings(policy=policy), probe=NumpyProbe())
    resumed.attach(checkpointed_model())
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    # the 95% readings were read as numbers: over memory_high, every step after the first offloaded
    assert [r.memory_fraction for r in controller.history] == [0.95] * 3
    assert [max(r.offloaded) for r in controller.history][1:] == [LAYERS] * 2


def test_a_run_resumed_after_its_first_step_still_foresees_the_optimizer_state():
    # Adam's state is allocated at the first optimizer.step(), inside step 0: its reading (85% of the device)
    # lacks the state (10% more), so step 1 must offload. A checkpoint taken after step 0 must carry that.
    from autooffload import MemoryReading

    def run(resume_from=None):
        torch.manual_seed(0)
        net = checkpointed_model()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        state_bytes = 2 * sum(p.numel() * p.element_size() for p in net.parameters())
        total = 10 * state_bytes

        class Probe:
            def read(self):
                return MemoryReading(round(0.85 * total), total)

        controller = OffloadController(Settings(), probe=Probe())
        controller.attach(net, optimizer=optimizer)
        if resume_from is not None:
            optimizer.step()  # the checkpoint's optimizer state, loaded before training resumes
            controller.load_state_dict(resume_from)
        else:
            ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
            net(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            controller.end_step()
        saved = controller.state_dict()
        ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
        net(input_ids=ids, labels=ids).loss.backward()
        return controller.level, saved

    level, saved = run()
    assert level == LAYERS
    assert run(resume_from=saved)[0] == LAYERS
