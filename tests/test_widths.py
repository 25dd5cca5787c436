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
    assert controller.layer_token_bytes == config.hc_mult * 64 * 4


def test_the_first_layer_call_gives_the_width_the_config_does_not():
    net = model()
    net.gradient_checkpointing_enable()
    net.config.hidden_size = HIDDEN // 2  # the config says less than the layers take
    controller = OffloadController(Settings(mode="off"), probe=None)
    controller.attach(net)
    assert controller.layer_token_bytes == HIDDEN // 2 * 4
    net.train()
    net(input_ids=torch.zeros(2, 16, dtype=torch.long), labels=torch.zeros(2, 16, dtype=torch.long)).loss.backward()
    assert controller.layer_token_bytes == HIDDEN * 4  # before any offload measured it
