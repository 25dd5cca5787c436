"""The layer input's real width: hyper-connection layers take [batch, seq, streams, hidden], so the arithmetic,
the predictive seed and ``autooffload estimate`` count streams x hidden; where the config does not say, the
first layer call does."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import HIDDEN, model

from autooffload import OffloadController, Settings
from autooffload import estimate as est


def test_estimate_counts_every_stream_of_a_hyper_connection_layer(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 1024, "hc_mult": 4}))
    assert est.main([str(config), "--seq", "1024", "--dtype", "fp32", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["saved_bytes"] == 4 * 1024 * 4 * 1024 * 4  # layers x seq x streams x hidden x bytes
    assert result["streams"] == 4


def test_the_seed_counts_every_stream_of_a_hyper_connection_layer():
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "deepseek_v4" not in CONFIG_MAPPING_NAMES:
        pytest.skip("deepseek_v4 is not in this transformers release")
    config = AutoConfig.for_model("deepseek_v4")
    for key, value in dict(num_hidden_layers=2, hidden_size=64, vocab_size=256).items():
        setattr(config, key, value)
    controller = OffloadController(Settings(mode="off"), probe=None)
    net = AutoModelForCausalLM.from_config(config)
    net.gradient_checkpointing_enable()
    controller.attach(net)
    assert controller.sizes.token_bytes == config.hc_mult * 64 * 4


def test_the_first_layer_call_gives_the_width_the_config_does_not():
    net = model()
    net.gradient_checkpointing_enable()
    net.config.hidden_size = HIDDEN // 2  # the config says less than the layers take
    controller = OffloadController(Settings(mode="off"), probe=None)
    controller.attach(net)
    assert controller.sizes.token_bytes == HIDDEN // 2 * 4
    net.train()
    net(input_ids=torch.zeros(2, 16, dtype=torch.long), labels=torch.zeros(2, 16, dtype=torch.long)).loss.backward()
    assert controller.sizes.token_bytes == HIDDEN * 4  # before any offload measured it


def test_the_keep_plan_and_the_history_size_a_layer_as_the_decision_does():
    """Longformer pads its input to a multiple of its attention window: 33 tokens take 48 positions, 48 take 48. The
    first micro-batch's layer calls set the bytes per token (48/33 of a token's); later ones set the stack's width.
    Every prediction (the keep plan's, the history's) must size a layer input as the decision does: 2 x 48 x 64 x 4
    bytes for a micro-batch of 48 tokens, not 48/33 of it."""
    import transformers

    from autooffload import ScriptedProbe

    config = transformers.LongformerConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        attention_window=16,
        max_position_embeddings=130,
    )
    torch.manual_seed(0)
    net = transformers.LongformerForMaskedLM(config)
    net.gradient_checkpointing_enable()
    net.train()
    decided, predicted = [], []

    class Spy:
        def decide(self, observation):
            decided.append(observation.bytes_per_layer)
            predicted.append([])
            return 3 if observation.step == 0 else 0

        def predict(self, tokens, bytes_per_layer=None, observation=None):
            predicted[-1].append(bytes_per_layer)
            return None

    controller = OffloadController(Settings(recompute="auto", engine="sync"), probe=ScriptedProbe([0.3]), policy=Spy())
    controller.attach(net)
    for length in (33, 48, 48, 48):
        ids = torch.randint(3, 256, (2, length), generator=torch.Generator().manual_seed(length))
        net(input_ids=ids, labels=ids).loss.backward()
        controller.end_step()
    real = 2 * 48 * 64 * 4
    assert decided[2:] == [real, real]
    assert predicted[2] and all(per_layer == real for calls in predicted[2:] for per_layer in calls), predicted


@pytest.mark.parametrize("engine", ["stream", "sync"])
def test_bytes_per_layer_stay_what_the_layer_calls_say_when_less_moves(engine):
    """The stream engine does not move the last layer's input (its backward comes first), and a layer's input
    already moved in the forward is not moved again: a step moves less than its layer calls took. That shortfall
    must not feed back into the bytes per token the next calls are measured against, step after step (it did:
    x 3/4 a step with 4 layers, down to 0.0 and the host cap off)."""
    from test_layers import ParallelModel, RemoteConfig

    torch.manual_seed(0)
    net = model() if engine == "stream" else ParallelModel(RemoteConfig())
    net.gradient_checkpointing_enable()
    net.train()
    sizes = []

    class AllLayers:
        def decide(self, observation):
            sizes.append(observation.bytes_per_layer)
            return observation.layers

    controller = OffloadController(Settings(engine=engine), probe=None, policy=AllLayers())
    controller.attach(net)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(6):
        net(input_ids=ids).logits.sum().backward()
        controller.end_step()
    hidden = net.config.hidden_size
    assert 0 < controller.last_step_bytes < len(controller.switch.layers) * 2 * 16 * hidden * 4
    assert sizes[1:] == [2 * 16 * hidden * 4] * 5
    assert controller.sizes.token_bytes == hidden * 4
