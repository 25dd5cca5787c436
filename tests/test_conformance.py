"""A representative subset of the conformance sweep (``benchmarks/conformance/``), in the suite.

One tiny random model per type, one training step with plain checkpointing, with autooffload ``mode="on"``
and at a partial level; the sweep's own hooks on torch's checkpoint measure what should move. Each type must
be ``correct``: bytes moved equal to the inputs of every checkpointed call of the stacks that consume the
tokens and to autooffload's arithmetic, loss and gradients bit-identical, no warning. The subset covers each
failure issue 18 named and each layer family: dense, MoE, hybrid/state-space, container-style on the oldest
transformers (its ``gpt2``, ``gemma2``, ``qwen2_moe`` loop over their layers in the model's forward), a VLM
with a text-only batch, hyper-connection layers, per-layer configs, and the encoder-decoder mappings.
A type the installed transformers lacks, or whose tiny model cannot take a plain checkpointed step there,
is skipped with the reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.conformance.calls import CheckpointCalls
from benchmarks.conformance.models import build, make_batch
from benchmarks.conformance.rows import check_type
from benchmarks.conformance.sweep import model_types

SUBSET = [
    # dense
    ("llama", "causal"),
    ("qwen3", "causal"),
    ("gpt2", "causal"),
    ("gemma2", "causal"),
    # MoE
    ("mixtral", "causal"),
    ("qwen2_moe", "causal"),
    ("qwen3_moe", "causal"),
    # hybrid / state-space
    ("mamba", "causal"),
    ("mamba2", "causal"),
    ("bamba", "causal"),
    # per-layer configs (issue 18: attach raised on config.head_dim)
    ("gemma4_text", "causal"),
    ("gemma4", "causal"),
    # hyper-connection layers (issue 18: the arithmetic counted hidden alone, 4x low)
    ("deepseek_v4", "causal"),
    ("qwen4_exp_text", "causal"),
    # a VLM, text-only batch
    ("llava", "image-text"),
    # the text stack is the one the embedding feeds (issue 18: phi4's audio blocks were taken for it)
    ("phi4_multimodal", "causal"),
    # stacks that run several cycles per forward (issue 18: 9 of 15 calls stayed plain)
    ("hrm_text", "causal"),
    # encoder-decoder: both stacks, each with its own length (issue 22)
    ("t5", "seq2seq"),
    ("bart", "seq2seq"),
    ("whisper", "speech"),
    # the layer input is not tokens x hidden: a source padded to the attention window (LED), n-gram decoder
    # streams (ProphetNet), features laid out [batch, frames, features] (Speech2Text), an encoder-decoder held
    # inside a VLM whose get_decoder() holds the encoder too (Florence-2), a layer called twice per forward (Dory)
    ("led", "seq2seq"),
    ("prophetnet", "seq2seq"),
    ("speech_to_text", "speech"),
    ("florence2", "image-text"),
    ("dory", "causal"),
    # encoders on raw audio samples (issue 28: nothing, or the decoder alone, moved): sized from input_values
    ("speecht5", "speech"),
    ("moonshine", "speech"),
    ("speech-encoder-decoder", "speech"),
    # a second activation of a layer's own moves with its input (issue 28): ZAYA's router states, Pegasus-X's
    # global tokens
    ("zaya", "causal"),
    ("pegasus_x", "seq2seq"),
]
SECOND_ACTIVATIONS = {"zaya", "pegasus_x"}
# fine-tuned with images or audio, their vision or audio tower checkpointed (issue 28): swept with such a batch
# what the sweep's generic tiny config or batch cannot build (issue 28): each runs with what
# benchmarks/conformance/quirks gives it, and covers what running it found: stacks beside the text stack on what the
# model computes from its tokens (BLT's patches, byte decoder and patcher; Diffusion-Gemma's decoder on its canvas), a
# layer that checkpoints a layer inside it (Zamba2's hybrid layers), a tensor every layer re-reads passed under a name
# of its own (Zamba2's original input, Inkling-2's block states), a model that needs its image (BLIP-2), Marian's own
# decoder vocabulary, Canary's features laid out by its extractor
QUIRKS_SUBSET = [
    ("blt", "causal"),
    ("diffusion_gemma", "image-text"),
    ("zamba2", "causal"),
    ("inkling2_text", "causal"),
    ("blip-2", "image-text"),
    ("marian", "seq2seq"),
    ("canary", "speech"),
    ("granite4_vision", "image-text"),  # one-layer Q-Formers, each with cross-attention states of its own
    ("evolla", "image-text"),  # built from its mapping's class, a protein beside the text
]
MEDIA_SUBSET = [("qwen2_vl", "image-text", "image"), ("gemma3", "image-text", "image"), ("voxtral", "seq2seq", "audio")]


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_sweep_sees_every_checkpointed_call_of_the_installed_torch(reentrant):
    """The sweep's count is its own, through torch's private entry points (which moved in torch 2.14): each call
    of either path is recorded once, with its layer input's bytes."""
    import torch
    from torch.utils.checkpoint import checkpoint

    recorder = CheckpointCalls()
    layer = torch.nn.Linear(4, 4)
    with recorder.watching():
        for rows in (3, 5):
            checkpoint(layer, torch.randn(rows, 4, requires_grad=True), use_reentrant=reentrant).sum().backward()
    assert [nbytes for _, nbytes in recorder.calls] == [3 * 4 * 4, 5 * 4 * 4]


@pytest.mark.parametrize(("model_type", "mapping", "kind"), MEDIA_SUBSET)
def test_a_model_fine_tuned_on_images_or_audio_conforms_with_such_a_batch(model_type, mapping, kind):
    row = judged(model_type, mapping)
    if row.get("batch") != kind and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"no {kind} batch builds on transformers {transformers.__version__}: {row.get('batch')}")
    assert row["verdict"] == "correct", row
    assert row["batch"] == kind
    assert row["moved"] == row["measured"] == round(row["arithmetic"]) > 0
    assert row["calls"] > row["layers"] / 2  # the tower's layers ran and moved too


@pytest.mark.parametrize(("model_type", "mapping"), QUIRKS_SUBSET)
def test_a_type_the_generic_tiny_model_does_not_suit_conforms_with_its_quirks(model_type, mapping):
    if (model_type, mapping) not in model_types([mapping]):
        pytest.skip(f"{model_type} is not in this transformers' {mapping} mapping")
    row = check_type(model_type, mapping)
    release = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if row["verdict"] == "skipped" and release < (5, 25):
        pytest.skip(f"benchmarks/conformance/quirks is written for transformers 5.25: {row['reason']}")
    assert row["verdict"] == "correct", row
    assert row["moved"] == row["measured"] == round(row["arithmetic"]) > 0


def judged(model_type: str, mapping: str) -> dict:
    """The sweep's row for this type; the test is skipped where this transformers lacks the type or its tiny
    model cannot take a plain checkpointed step."""
    if (model_type, mapping) not in model_types([mapping]):
        pytest.skip(f"{model_type} is not in this transformers' {mapping} mapping")
    row = check_type(model_type, mapping)
    if row["verdict"] == "skipped":
        pytest.skip(row["reason"])
    return row


@pytest.mark.parametrize(("model_type", "mapping"), SUBSET)
def test_autooffload_conforms(model_type, mapping):
    row = judged(model_type, mapping)
    assert row["verdict"] == "correct", row
    assert row["moved"] == row["measured"] == round(row["arithmetic"]) > 0
    assert (row["extras"] > 0) == (model_type in SECOND_ACTIVATIONS)


@pytest.mark.parametrize(("model_type", "mapping"), [("qwen3", "causal"), ("t5", "seq2seq")])
def test_transformers_own_checkpointing_test_passes_with_autooffload_on(model_type, mapping):
    """transformers' ``check_training_gradient_checkpointing``, read from the installed release's sdist (fetched once
    with pip where it is not cached), in its three scenarios, with autooffload attached in mode ``on``: on 5.x it wraps
    the first layer's checkpoint function in a ``MagicMock`` that must count the layer's forwards."""
    from benchmarks.conformance import upstream

    if (model_type, mapping) not in model_types([mapping]):
        pytest.skip(f"{model_type} is not in this transformers' {mapping} mapping")
    model, config = build(model_type, mapping, True)
    batch = make_batch(model, config, mapping)
    found = upstream.run_upstream(type(model), model.config, batch)
    if found["verdict"] == "unavailable":
        pytest.skip(found["reason"])
    assert found["verdict"] == "pass", found
    assert set(found["scenarios"].values()) == {"pass"}
