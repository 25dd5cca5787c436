"""TRL's trainers and PEFT's LoRA through the real code, on a tiny random Qwen3 and a tokenizer built here
(nothing is downloaded): the bytes each step moves equal the arithmetic for the micro-batch that ran."""

from __future__ import annotations

import contextlib
import unittest.mock
import warnings

import datasets
import peft
import pytest
import torch
import trl
from conftest import NEW_NAMES, InOrderTrainer, dataset, expected_bytes, model, training_args
from transformers import PreTrainedTokenizerFast, TrainerCallback

from autooffload import AutoOffloadCallback, AutoOffloadWarning
from autooffload.callback import checkpointing_kwargs
from autooffload.history import read_history
from autooffload.observe.ours import ours

PREFIX = "activation" if NEW_NAMES else "gradient"


def tokenizer() -> PreTrainedTokenizerFast:
    """One token per word, ``w2`` ... ``w255``, with pad and end-of-sequence tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(2, 256)]
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w2"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>")


def words(count: int, seed: int) -> str:
    return " ".join(f"w{(seed * 7 + i * 3) % 254 + 2}" for i in range(count))


class Fixed:
    """A policy that always asks for the same number of layers."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def decide(self, observation) -> int:
        return self.layers


class Steps(TrainerCallback):
    """Per optimizer step: the tokens of the training forwards (read from the model's own inputs, not from
    autooffload), the controller's active fraction and the bytes it moved."""

    def __init__(self, callback: AutoOffloadCallback, net: torch.nn.Module) -> None:
        self.controller = callback.controller
        self.rows: list[tuple[int, float, int]] = []
        self._tokens = 0
        net.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        if module.training and torch.is_grad_enabled():
            self._tokens += kwargs.get("input_ids", args[0] if args else None).numel()

    def on_step_end(self, args, state, control, **kwargs):
        self.rows.append((self._tokens, self.controller.record.active, self.controller.last_step_bytes))
        self._tokens = 0


def config(kind, tmp_path, steps: int, kwargs: dict, **extra):
    arguments = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=1,
        max_steps=steps,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        **{f"{PREFIX}_checkpointing": True, f"{PREFIX}_checkpointing_kwargs": kwargs},
    )
    return kind(**{**arguments, **extra})


# ---- DPO: the reference forward disables and re-enables checkpointing on every step ---------------------


def test_dpo_runs_as_decided_on_every_step(tmp_path):
    # DPOTrainer (TRL >= 0.20) runs the reference forward between gradient_checkpointing_disable() and
    # gradient_checkpointing_enable(args.gradient_checkpointing_kwargs): transformers' own functions, the
    # ``offload`` key included, are back on every layer at each step's end.
    pairs = datasets.Dataset.from_dict(
        {
            "prompt": [words(8, i) for i in range(3)],
            "chosen": [words(5, 10 + i) for i in range(3)],
            "rejected": [words(7, 20 + i) for i in range(3)],
        }
    )
    net = model()
    callback = AutoOffloadCallback(probe=None, policy=Fixed(2))
    steps = Steps(callback, net)
    trainer = trl.DPOTrainer(
        model=net,
        ref_model=model(),
        args=config(trl.DPOConfig, tmp_path, 3, {"offload": "auto"}),
        train_dataset=pairs,
        processing_class=tokenizer(),
        callbacks=[callback, steps],
    )
    trainer.train()
    assert callback.controller.settings.mode == "auto"
    assert all(tokens >= 2 * (8 + 7) for tokens, *_ in steps.rows)  # chosen and rejected: one batch of two
    assert [(active, moved) for _, active, moved in steps.rows] == [
        (0.5, expected_bytes(tokens, layers=2)) for tokens, *_ in steps.rows
    ]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["autooffload/offloaded_bytes"] for h in logs] == [moved for *_, moved in steps.rows]
    assert [h["autooffload/active"] for h in logs] == [0.5] * 3


# ---- SFT: packed and padding-free batches are one long row ------------------------------------------


TEXT_WORDS = (12, 30, 9, 21, 17, 26)


def sft_steps(tmp_path, **extra):
    texts = datasets.Dataset.from_dict({"text": [words(n, i) for i, n in enumerate(TEXT_WORDS)]})
    net = model()
    callback = AutoOffloadCallback(mode="on", probe=None)
    steps = Steps(callback, net)
    trainer = trl.SFTTrainer(
        model=net,
        args=config(trl.SFTConfig, tmp_path, 2, {"use_reentrant": False}, **extra),
        train_dataset=texts,
        processing_class=tokenizer(),
        callbacks=[callback, steps],
    )
    trainer.train()
    return steps.rows


def test_sft_with_packing_moves_the_packed_length(tmp_path):
    rows = sft_steps(tmp_path, packing=True, max_length=48)
    assert all(tokens > max(TEXT_WORDS) + 1 for tokens, *_ in rows)  # longer than any one text: packed
    assert [(active, moved) for _, active, moved in rows] == [(1.0, expected_bytes(tokens)) for tokens, *_ in rows]


def test_sft_padding_free_moves_the_concatenated_length(tmp_path):
    rows = sft_steps(tmp_path, padding_free=True, per_device_train_batch_size=2, max_length=None)
    lengths = [n + 1 for n in TEXT_WORDS]  # each text and its end-of-sequence token, no padding
    sums = {a + b for i, a in enumerate(lengths) for b in lengths[i + 1 :]}
    assert all(tokens in sums for tokens, *_ in rows)
    assert [(active, moved) for _, active, moved in rows] == [(1.0, expected_bytes(tokens)) for tokens, *_ in rows]


# ---- TRL's own activation offloading: autooffload stays out ------------------------------------------


def test_sft_with_trls_own_activation_offloading_keeps_autooffload_out_with_one_warning(tmp_path, monkeypatch):
    """TRL's ``activation_offloading`` wraps each training step in saved-tensor hooks that move every activation to
    host memory itself: autooffload attached beside it would move some of the same layers' inputs, or report
    nothing moved while TRL moves them. It stays out, with one warning naming TRL's option."""
    if "activation_offloading" not in trl.SFTConfig.__dataclass_fields__:
        pytest.skip(f"TRL {trl.__version__}'s SFTConfig has no activation_offloading")
    # TRL's offload runs only where torch names an accelerator: made while this CPU is named as one, it runs here
    # as there, copying each activation into pageable host memory on one stream (use_pin_memory, use_streams off).
    import trl.trainer.sft_trainer as sft_trainer

    # (TRL 0.19's needs CUDA streams: there the step runs without it, and the test checks autooffload alone.)
    made, runs = sft_trainer.get_act_offloading_ctx_manager, []

    def on_this_cpu(model, **kwargs):
        with unittest.mock.patch.object(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu")):
            try:
                manager = made(model, **{**kwargs, "use_pin_memory": False, "use_streams": False})
            except (AssertionError, RuntimeError):  # Torch not compiled with CUDA enabled
                return contextlib.nullcontext()
        runs.append(manager)
        return manager

    monkeypatch.setattr(sft_trainer, "get_act_offloading_ctx_manager", on_this_cpu)
    texts = datasets.Dataset.from_dict({"text": [words(n, i) for i, n in enumerate(TEXT_WORDS)]})
    net = model()
    callback = AutoOffloadCallback(mode="on", probe=None)
    seen = []

    class During(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            functions = [layer._gradient_checkpointing_func for layer in net.model.layers]
            trl_moved = getattr(trainer.maybe_activation_offload_context, "tensor_id", 0) > 0
            seen.append((callback.controller.switch, any(ours(f) for f in functions), trl_moved))

    trainer = trl.SFTTrainer(
        model=net,
        args=config(trl.SFTConfig, tmp_path, 2, {"use_reentrant": False}, activation_offloading=True),
        train_dataset=texts,
        processing_class=tokenizer(),
        callbacks=[callback, During()],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    ours_warned = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours_warned) == 1 and "activation_offloading" in ours_warned[0], ours_warned
    assert seen == [(None, False, bool(runs))] * 2  # not attached, no function of autooffload's; TRL's offload ran
    assert callback.controller.history == [] and not (tmp_path / "autooffload").exists()


# ---- LoRA: frozen embeddings make the first layer's input a leaf that requires grad ------------------


@pytest.mark.parametrize("engine", ["sync", "stream"])
def test_lora_first_layer_input_is_offloaded_by_both_engines(tmp_path, engine):
    net = peft.get_peft_model(model(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    # Trainer's checkpointing does this itself from transformers 5; before, PEFT's docs ask the user to.
    net.enable_input_require_grads()
    first_inputs = []
    layers = net.base_model.model.model.layers
    layers[0].register_forward_pre_hook(lambda module, args: first_inputs.append(args[0]))
    callback = AutoOffloadCallback(engine=engine, probe=None, policy=Fixed(1))
    recorder = Steps(callback, net)
    args = training_args(tmp_path, 3, offload="auto")
    InOrderTrainer(model=net, args=args, train_dataset=dataset([64, 96, 80]), callbacks=[callback, recorder]).train()
    assert all(x.is_leaf and x.requires_grad for x in first_inputs)  # what enable_input_require_grads() makes
    assert [moved for *_, moved in recorder.rows] == [expected_bytes(s, layers=1) for s in (64, 96, 80)]


# ---- KTO: a no-grad forward of the policy in train mode after checkpointing was re-enabled -------------


class KtoOrder(InOrderTrainer):
    """``compute_loss`` in the order of TRL's KTOTrainer: the KL forward (the policy, in train mode, under
    ``torch.no_grad()``), the forward that trains, then the reference forward between
    ``gradient_checkpointing_disable()`` and ``gradient_checkpointing_enable(kwargs)``, which puts transformers'
    own functions back with the user's kwargs (``offload`` included). The next step's no-grad forward runs
    those unless something repairs them first."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with torch.no_grad():
            model(input_ids=inputs["input_ids"])
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        model.gradient_checkpointing_disable()
        with torch.no_grad():
            model(input_ids=inputs["input_ids"])
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(self.args))
        return loss


def test_no_grad_forward_after_re_enable_runs_and_only_the_training_forward_counts(tmp_path):
    lengths = [64, 96, 80]
    plain = KtoOrder(
        model=model(), args=training_args(tmp_path / "plain", 3, offload=False), train_dataset=dataset(lengths)
    )
    plain.args.__dict__[f"{PREFIX}_checkpointing_kwargs"] = {"use_reentrant": False}
    plain.train()
    net = model()
    callback = AutoOffloadCallback(probe=None, policy=Fixed(2))
    steps = Steps(callback, net)
    trainer = KtoOrder(
        model=net,
        args=training_args(tmp_path, 3, offload="auto"),
        train_dataset=dataset(lengths),
        callbacks=[callback, steps],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if issubclass(w.category, AutoOffloadWarning)]  # checkpointing was never off
    assert steps.rows == [(s, 0.5, expected_bytes(s, layers=2)) for s in lengths]
    assert [r["seq_lens"] for r in read_history(callback.history_path)] == [
        [s] for s in lengths
    ]  # one micro-batch each
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == [h["loss"] for h in plain.state.log_history if "loss" in h]
    for (name, a), (_, b) in zip(net.named_parameters(), plain.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def kto_trainer(tmp_path, net, callbacks, kwargs):
    examples = datasets.Dataset.from_dict(
        {
            "prompt": [words(6 + i % 3, i) for i in range(8)],
            "completion": [words(4 + i % 4, 30 + i) for i in range(8)],
            "label": [i % 2 == 0 for i in range(8)],
        }
    )
    return trl.KTOTrainer(
        model=net,
        ref_model=model(),
        args=config(trl.KTOConfig, tmp_path, 3, kwargs, per_device_train_batch_size=2),
        train_dataset=examples,
        processing_class=tokenizer(),
        callbacks=callbacks,
    )


def test_kto_trains_as_decided_on_every_step(tmp_path):
    # KTOTrainer (TRL 1.x) runs the KL forward of the policy under torch.no_grad() in train mode, right after the
    # previous step's reference forward toggled checkpointing off and on with the user's kwargs.
    net = model()
    callback = AutoOffloadCallback(probe=None, policy=Fixed(2))
    steps = Steps(callback, net)
    no_grad = []
    net.register_forward_pre_hook(lambda module, args: no_grad.append(module.training and not torch.is_grad_enabled()))
    trainer = kto_trainer(tmp_path, net, [callback, steps], {"offload": "auto"})
    trainer.train()
    assert no_grad == [True, False] * 3  # per step: the KL forward without gradients, then the one that trains
    assert len(steps.rows) == 3 and all(tokens > 0 for tokens, *_ in steps.rows)
    assert [(active, moved) for _, active, moved in steps.rows] == [
        (0.5, expected_bytes(tokens, layers=2)) for tokens, *_ in steps.rows
    ]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["autooffload/offloaded_bytes"] for h in logs] == [moved for *_, moved in steps.rows]


# ---- GRPO: generation, then the training forward over prompt and completion ------------------------------


def completion_length(completions, **kwargs) -> list[float]:
    return [float(len(completion)) for completion in completions]


@pytest.mark.skipif(not hasattr(trl, "GRPOTrainer"), reason="this TRL has no GRPOTrainer")
def test_grpo_trains_as_decided_on_every_step(tmp_path):
    prompts = datasets.Dataset.from_dict({"prompt": [words(6 + i % 3, i) for i in range(8)]})
    net = model()
    callback = AutoOffloadCallback(probe=None, policy=Fixed(2))
    steps = Steps(callback, net)
    trainer = trl.GRPOTrainer(
        model=net,
        reward_funcs=completion_length,
        args=config(
            trl.GRPOConfig,
            tmp_path,
            3,
            {"offload": "auto"},
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=8,
            beta=0.0,
            num_iterations=2,
        ),
        train_dataset=prompts,
        processing_class=tokenizer(),
        callbacks=[callback, steps],
    )
    trainer.train()
    assert len(steps.rows) == 3 and all(tokens > 0 for tokens, *_ in steps.rows)
    assert [(active, moved) for _, active, moved in steps.rows] == [
        (0.5, expected_bytes(tokens, layers=2)) for tokens, *_ in steps.rows
    ]


@pytest.mark.skipif(
    "num_generations" not in getattr(getattr(trl, "RLOOConfig", None), "__dataclass_fields__", {}),
    reason="this TRL's RLOOTrainer is the earlier one (a policy, a reference policy and a reward model)",
)
def test_rloo_trains_as_decided_on_every_step(tmp_path):
    prompts = datasets.Dataset.from_dict({"prompt": [words(6 + i % 3, i) for i in range(8)]})
    net = model()
    callback = AutoOffloadCallback(probe=None, policy=Fixed(2))
    steps = Steps(callback, net)
    trainer = trl.RLOOTrainer(
        model=net,
        reward_funcs=completion_length,
        args=config(
            trl.RLOOConfig, tmp_path, 2, {"offload": "auto"},
            per_device_train_batch_size=2, num_generations=2, max_completion_length=8, beta=0.0,
        ),
        train_dataset=prompts,
        processing_class=tokenizer(),
        callbacks=[callback, steps],
    )  # fmt: skip
    trainer.train()
    assert len(steps.rows) == 2 and all(tokens > 0 for tokens, *_ in steps.rows)
    assert [(active, moved) for _, active, moved in steps.rows] == [
        (0.5, expected_bytes(tokens, layers=2)) for tokens, *_ in steps.rows
    ]


@pytest.mark.skipif(not hasattr(trl, "RewardTrainer"), reason="this TRL has no RewardTrainer")
def test_reward_trainer_moves_chosen_and_rejected(tmp_path):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    pairs = datasets.Dataset.from_dict(
        {"chosen": [words(6 + i % 3, i) for i in range(4)], "rejected": [words(5 + i % 2, 9 + i) for i in range(4)]}
    )
    config_ = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, use_cache=False, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    net = Qwen3ForSequenceClassification(config_)
    callback = AutoOffloadCallback(mode="on", probe=None)
    steps = Steps(callback, net)
    trainer = trl.RewardTrainer(
        model=net,
        args=config(trl.RewardConfig, tmp_path, 2, {"use_reentrant": False}, per_device_train_batch_size=2),
        train_dataset=pairs,
        processing_class=tokenizer(),
        callbacks=[callback, steps],
    )
    trainer.train()
    assert len(steps.rows) == 2 and all(tokens > 0 for tokens, *_ in steps.rows)
    assert [moved for *_, moved in steps.rows] == [expected_bytes(tokens) for tokens, *_ in steps.rows]


# ---- Distillation: the student is called through a redirection ------------------------------------------


class BackboneTokens(TrainerCallback):
    """Per optimizer step, the tokens of the training calls of the student's backbone (``model.model``), which
    TRL's ``DistillationTrainer`` calls inside a redirected top-level forward that carries no ``input_ids``."""

    def __init__(self, callback: AutoOffloadCallback, net: torch.nn.Module) -> None:
        self.controller = callback.controller
        self.rows: list[tuple[int, int]] = []
        self.records: list = []
        self._tokens = 0
        net.model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        if module.training and torch.is_grad_enabled():
            self._tokens += kwargs["input_ids"].numel()

    def on_step_end(self, args, state, control, **kwargs):
        self.rows.append((self._tokens, self.controller.last_step_bytes))
        self.records.append(self.controller.history[-1])
        self._tokens = 0


@pytest.mark.skipif(not hasattr(trl, "DistillationTrainer"), reason="this TRL has no DistillationTrainer")
@pytest.mark.parametrize("mode", ["on", "auto"])
def test_distillation_decides_where_the_tokens_are(tmp_path, mode):
    # DistillationTrainer (TRL 1.16) calls model(unwrapped, inputs, n) with the student's forward patched to its
    # loss: the top model's call has no input_ids; the backbone's call inside it has them.
    prompts = datasets.Dataset.from_dict({"prompt": [words(6 + i % 3, i) for i in range(8)]})
    net = model()
    callback = AutoOffloadCallback(mode=mode, probe=None, seq_high=4, seq_low=2, policy="hysteresis")
    steps = BackboneTokens(callback, net)
    trainer = trl.DistillationTrainer(
        model=net,
        teacher_model=model(seed=1),
        args=config(
            trl.DistillationConfig, tmp_path, 2, {"use_reentrant": False},
            per_device_train_batch_size=2, max_completion_length=6,
        ),
        train_dataset=prompts,
        processing_class=tokenizer(),
        callbacks=[callback, steps],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if issubclass(w.category, AutoOffloadWarning)]
    records = steps.records
    assert len(steps.rows) == 2 and all(tokens > 0 for tokens, _ in steps.rows)
    assert [sum(r.tokens) for r in records] == [tokens for tokens, _ in steps.rows]
    assert all(seq > 4 for r in records for seq in r.seq_lens)  # above seq_high: auto's trigger fires too
    assert [moved for _, moved in steps.rows] == [expected_bytes(tokens) for tokens, _ in steps.rows]
