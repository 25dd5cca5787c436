"""Where a rank that gave up makes the collective it owes: exactly where the other ranks make theirs, at the call
that decides a training micro-batch (the top model, or the entry a micro-batch enters through), never inside a
forward already running. One process stands for rank 1 of two: the group is stood in for, and each collective is
recorded in order with what the model ran around it (a forward pre-hook on each stack's embedding, registered
before autooffload's hooks). The two-rank runs are in tests/test_distributed.py and the fault matrix."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from conftest import model

from autooffload import AutoOffloadWarning, OffloadController, Settings, distributed
from autooffload.apply.host_memory import HostMemory
from autooffload.guard import ENTRY_POINTS


@pytest.fixture
def events(monkeypatch) -> list[str]:
    """Rank 1 of two whose group answers every agreement as it is: "agree" for an agreement, "tell" for the one
    that carries this rank's give-up, in order with the marks the tests add."""
    seen: list[str] = []
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "AgreementGroup", lambda: None)
    monkeypatch.setattr(distributed, "join_ranks", lambda ready, gave_up, group, made: made() or (True, None))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)

    def group(values, group=None, made=None):
        made()
        seen.append("tell" if values[3] else "agree")
        return values

    monkeypatch.setattr(distributed, "all_reduce_max", group)
    return seen


def mark(module: torch.nn.Module, events: list[str], name: str, end: bool = False) -> None:
    """Add ``name`` to ``events`` as each training call of ``module`` begins; with ``end``, "end" as it ends."""
    module.register_forward_pre_hook(lambda m, args: events.append(name) if m.training else None)
    if end:
        module.register_forward_hook(lambda m, args, output: events.append("end") if m.training else None)


def failing(monkeypatch, where: str, when) -> None:
    """The entry point ``where`` raises where ``when(controller, *args)`` says."""
    point = ENTRY_POINTS[where]
    original = point.method

    def method(owner, *args, **kwargs):
        if when(owner, *args):
            raise RuntimeError("injected")
        return original(owner, *args, **kwargs)

    monkeypatch.setattr(point, "method", method)


def qwen3(events: list[str], inner: bool = False) -> tuple[torch.nn.Module, OffloadController]:
    """A tiny Qwen3 attached; ``inner``: each call of ``model.model`` marked too (before autooffload's hook on it)."""
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    mark(net.model.embed_tokens, events, "embed")
    if inner:
        mark(net.model, events, "model.model")
    net.model.register_forward_hook(lambda m, args, output: events.append("end"))
    controller = OffloadController(Settings(), probe=None)
    assert controller.attach(net)
    return net, controller


def t5(events: list[str]) -> tuple[torch.nn.Module, OffloadController]:
    config = transformers.T5Config(
        vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    net = transformers.T5ForConditionalGeneration(config)
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    mark(net.encoder, events, "encoder")
    mark(net.decoder, events, "decoder", end=True)
    controller = OffloadController(Settings(), probe=None)
    assert controller.attach(net)
    return net, controller


def ids(seq: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))


def step(net: torch.nn.Module, controller: OffloadController, call=None) -> None:
    loss = call() if call is not None else net(input_ids=ids(), labels=ids()).loss
    loss.backward()
    controller.end_step()


def test_a_give_up_after_the_agreement_tells_at_the_next_micro_batch_not_at_an_inner_entry(events, monkeypatch):
    """Qwen3, the pre-forward hook failing after its micro-batch's agreement (``host.expect``): before, the notice
    fired at Qwen3Model's entry in the same forward, where the other ranks make no collective."""
    net, controller = qwen3(events)
    expect, calls = HostMemory.expect, []

    def failing_expect(self, sizes):
        calls.append(True)
        if len(calls) == 2:
            raise RuntimeError("injected")
        expect(self, sizes)

    monkeypatch.setattr(HostMemory, "expect", failing_expect)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        for _ in range(4):
            step(net, controller)
    assert events == ["agree", "embed", "end"] * 2 + ["tell", "embed", "end"] + ["embed", "end"]
    (warning,) = [str(w.message) for w in caught]
    assert "internal error in the pre-forward hook (RuntimeError: injected)" in warning
    assert controller.fallback.notice.hooks is None and not net.model._forward_pre_hooks


def test_an_encoder_decoder_failing_in_its_encoder_tells_at_the_next_micro_batch_not_its_decoder(events, monkeypatch):
    """T5, an encoder layer's report failing in the second micro-batch: before, the notice fired at the decoder
    stack's entry in the same forward."""
    net, controller = t5(events)
    failing(monkeypatch, "a layer call's report", lambda c, position, *rest: c.record.micro_batches == 2)
    for _ in range(3):
        step(net, controller)
    assert events == ["agree", "encoder", "decoder", "end"] * 2 + ["tell", "encoder", "decoder", "end"]


def test_a_micro_batch_that_enters_through_the_inner_model_hears_the_give_up_there(events, monkeypatch):
    """TRL's fused-loss path calls ``model.model`` and never the top model's forward: the notice stands at the inner
    entry, where the micro-batch is decided, and at the next micro-batch, not at a later layer of this one."""
    net, controller = qwen3(events, inner=True)

    def inner_loss():
        hidden = net.model(input_ids=ids()).last_hidden_state
        return net.lm_head(hidden).float().logsumexp(-1).mean()

    failing(monkeypatch, "a layer call's report", lambda c, position, *rest: c.record.micro_batches == 2)
    for _ in range(3):
        step(net, controller, inner_loss)
    assert events == ["model.model", "agree", "embed", "end"] * 2 + ["model.model", "tell", "embed", "end"]


def test_a_call_without_tokens_leaves_the_collective_to_the_entry_inside_it(events, monkeypatch):
    """A call of the top model that carries no tokens and passes them to the backbone (TRL's
    ``DistillationTrainer`` redirects the call to its loss function): the other ranks agree at the backbone's entry,
    so a rank that failed in that call's pre-forward hook, before its agreement, tells there too, not at the top."""
    net, controller = qwen3(events, inner=True)

    def redirected():
        net.forward = lambda **kwargs: net.lm_head(net.model(input_ids=ids()).last_hidden_state).float().mean()
        try:
            return net()
        finally:
            del net.forward

    failing(monkeypatch, "the pre-forward hook", lambda c, module, *rest: c.record.micro_batches == 1)
    for _ in range(2):
        step(net, controller, redirected)
    assert events == ["model.model", "agree", "embed", "end", "model.model", "tell", "embed", "end"]


def test_a_call_passed_by_whose_entry_never_runs_leaves_nothing_due(events, monkeypatch):
    """Item 4.4 of issue 37: a training call passed by (no tokens, an entry inside) whose entry is never called left
    the agreement due, so a give-up in the next ``end_step`` made its collective at once, where the other ranks make
    none. Nothing is due once the call was passed by: the give-up is told at the next micro-batch's agreement."""
    net, controller = qwen3(events)
    step(net, controller)
    net.forward = lambda **kwargs: net.lm_head.weight.sum()  # a call that never reaches the backbone
    net().backward()
    del net.forward
    failing(monkeypatch, "end_step", lambda c: True)
    controller.end_step()
    assert events == ["agree", "embed", "end"]
    step(net, controller)
    assert events == ["agree", "embed", "end", "tell", "embed", "end"]
