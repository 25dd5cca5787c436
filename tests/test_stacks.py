"""Which stacks are planned and where a micro-batch is decided, through the real Trainer.

- A loss computed from ``model.model(...)`` outputs (TRL's Liger-loss path) never calls the top model: the
  micro-batch is decided where the tokens are consumed, so a long one still gets offload.
- The text stack is the one the token embeddings feed, not the longest one near the embedding's path
  (phi4_multimodal's audio blocks sit under its ``embed_tokens_extend``).
- Stacks that run several times per forward (hrm_text's cycles): every call under grad is a layer call, counted,
  planned and moved.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import HIDDEN, LAYERS, InOrderTrainer, dataset, expected_bytes, model, training_args
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

from autooffload import AutoOffloadCallback
from autooffload.observe.layout import ModelLayout

BATCH, SEQ, VOCAB = 2, 32, 256


class Record(TrainerCallback):
    def __init__(self, callback: AutoOffloadCallback) -> None:
        self.controller = callback.controller
        self.steps: list[tuple[int, int]] = []
        self.decisions = 0

    def watch(self) -> None:
        decide = self.controller.before_forward

        def counted(*args, **kwargs):
            self.decisions += 1
            return decide(*args, **kwargs)

        self.controller.before_forward = counted

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append((self.controller.level, self.controller.last_step_bytes))
        self.layers = len(self.controller.switch.layers)
        self.calls = list(self.controller.switch.forward.calls_per_forward)


class InnerModelLoss(InOrderTrainer):
    """The loss from the inner model's hidden states and the head, as TRL's Liger-kernel path computes it."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        hidden = model.model(input_ids=inputs["input_ids"]).last_hidden_state
        logits = model.lm_head(hidden)[:, :-1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), inputs["labels"][:, 1:].flatten())


@pytest.mark.parametrize("trainer_class", [InOrderTrainer, InnerModelLoss])
def test_a_long_micro_batch_gets_offload_also_when_the_loss_bypasses_the_top_model(tmp_path, trainer_class):
    lengths = [32, 128, 32]
    callback = AutoOffloadCallback(probe=None, seq_high=100, seq_low=64, min_steps=1)
    record = Record(callback)
    record.watch()
    args = training_args(tmp_path, len(lengths))
    trainer = trainer_class(model=model(), args=args, train_dataset=dataset(lengths), callbacks=[callback, record])
    trainer.train()
    assert record.steps == [(0, 0), (LAYERS, expected_bytes(128)), (0, 0)]
    assert record.decisions == len(lengths)  # once per micro-batch, whichever module the call entered


def built(model_type: str, **fields) -> torch.nn.Module:
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in transformers {transformers.__version__}")
    config = AutoConfig.for_model(model_type)
    subs = [key for key in ("audio_config", "vision_config") if key in fields]
    if any(getattr(config, key, None) is None for key in subs):
        # transformers 4.52's phi4_multimodal has no default vision config: its sub-configs are built from the fields
        config = AutoConfig.for_model(model_type, **{key: fields.pop(key) for key in subs})
    for key in ("audio_config", "vision_config"):
        if key in fields:
            getattr(config, key).update(fields.pop(key))
    config.update(fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def train_fixed(tmp_path, net, steps: int = 2, **callback_args):
    """Train ``net`` on ``steps`` micro-batches of BATCH x SEQ; (the Record, losses, parameters)."""
    callback = AutoOffloadCallback(probe=None, **callback_args)
    record = Record(callback)
    args = training_args(tmp_path, steps, per_device_train_batch_size=BATCH)
    trainer = InOrderTrainer(
        model=net, args=args, train_dataset=dataset([SEQ] * (steps * BATCH)), callbacks=[callback, record]
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return record, losses, [p.detach().clone() for p in net.parameters()]


TINY = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=4, num_key_value_heads=4)
TINY.update(vocab_size=VOCAB, head_dim=16, pad_token_id=0)


def test_phi4_multimodal_reads_tokens_at_its_decoder_layers_not_at_the_audio_blocks_in_its_embedding_path(tmp_path):
    # The audio blocks are planned too, sized from the audio input they run on; a text-only batch runs none of them.
    audio = dict(hidden_size=32, intermediate_size=64, num_blocks=4, num_attention_heads=4, nemo_conv_channels=32)
    audio.update(ext_pw_out_channel=32, depthwise_separable_out_channel=32)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    net = built("phi4_multimodal", num_hidden_layers=3, audio_config=audio, vision_config=vision, **TINY)
    net.gradient_checkpointing_enable()
    stacks = ModelLayout.read(net).stacks
    assert [stack.name for stack in stacks if not stack.sources] == ["model.layers"]
    assert [stack.sources for stack in stacks if stack.sources] == [("pixel_values",), ("audio_input_features",)]
    record, _, _ = train_fixed(tmp_path, net, mode="on")
    assert record.steps == [(record.layers, expected_bytes(SEQ, BATCH, layers=3))] * 2


def hrm() -> torch.nn.Module:
    return built("hrm_text", num_layers_per_stack=2, H_cycles=2, L_cycles=3, L_bp_cycles=[2], **TINY)


def test_hrm_text_counts_plans_and_moves_every_call_of_both_stacks(tmp_path):
    # Per forward under grad: L_module's layers run 1 + 2 times (the trailing L_bp_cycles of each high cycle,
    # padded to [1, 2]), H_module's twice: 2 x 3 + 2 x 2 = 10 layer calls, each saving one input.
    reference = train_fixed(tmp_path / "plain", hrm(), mode="off")
    record, losses, parameters = train_fixed(tmp_path / "on", hrm(), mode="on")
    assert record.layers == 4
    assert record.calls == [3, 3, 2, 2]
    assert record.steps == [(4, 10 * expected_bytes(SEQ, BATCH, layers=1))] * 2
    assert losses == reference[1]
    assert all(torch.equal(p, q) for p, q in zip(parameters, reference[2], strict=True))


def test_hrm_text_partial_level_offloads_the_layers_called_most_once_counted(tmp_path):
    class Fixed:
        def decide(self, observation):
            return 2

    record, _, _ = train_fixed(tmp_path, hrm(), steps=2, policy=Fixed())
    # Step 1 knows no counts yet and offloads the first two in module order (L_module's, 3 calls each); step 2
    # ranks by counted calls, the same two.
    assert record.steps == [(2, 6 * expected_bytes(SEQ, BATCH, layers=1))] * 2


def test_hrm_text_micro_batch_tokens_are_its_input_tokens_once_though_both_stacks_read_them(tmp_path):
    # Both stacks run on the one input_ids: the micro-batch has BATCH x SEQ tokens, not one count per stack.
    from autooffload.history import read_history

    seen = []

    class Spy:
        def decide(self, observation):
            seen.append(observation.tokens)
            return 4

    train_fixed(tmp_path, hrm(), steps=2, policy=Spy())
    assert seen == [BATCH * SEQ] * 2
    records = read_history(tmp_path / "autooffload" / "history.jsonl")
    assert [record["tokens"] for record in records] == [[BATCH * SEQ]] * 2
