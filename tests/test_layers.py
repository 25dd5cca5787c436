"""What counts as a layer: containers that call the checkpoint function for their layers, and models with several
stacks (a VLM's vision blocks and language layers), through the real Trainer.

Each layer's saved input is batch x seq x hidden x dtype-bytes; nothing else a checkpointed call receives (a
causal mask, position ids) may move, and only the stack that consumes the tokens counts.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import InOrderTrainer, dataset, training_args
from transformers import PretrainedConfig, PreTrainedModel, TrainerCallback
from transformers.modeling_outputs import CausalLMOutput

from autooffload import AutoOffloadCallback, AutoOffloadWarning, OffloadController, Settings
from autooffload.observe.targets import find_targets

LAYERS, HIDDEN, VOCAB = 3, 32, 256
LENGTHS = [48, 64]


class Fixed:
    """A policy that always asks for ``level`` layers."""

    def __init__(self, level: int) -> None:
        self.level = level

    def decide(self, observation) -> int:
        return self.level


class Record(TrainerCallback):
    """Per optimizer step: (level applied, bytes moved to the host); and the text stack's layers as controlled."""

    def __init__(self, callback: AutoOffloadCallback) -> None:
        self.controller = callback.controller
        self.steps: list[tuple[int, int]] = []
        self.layers: list = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append((self.controller.level, self.controller.last_step_bytes))
        self.layers = list(self.controller.switch.layers)


def run(tmp_path, net, data, collator=None, **callback_args):
    """Train ``net`` in order over ``data``; returns (per-step (level, bytes), losses, parameters, layers)."""
    callback = AutoOffloadCallback(probe=None, **callback_args)
    record = Record(callback)
    args = training_args(tmp_path, len(data))
    trainer = InOrderTrainer(
        model=net, args=args, train_dataset=data, data_collator=collator, callbacks=[callback, record]
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return record.steps, losses, [p.detach().clone() for p in net.parameters()], record.layers


def assert_same_training(run, reference) -> None:
    assert run[1] == reference[1]
    assert all(torch.equal(p, q) for p, q in zip(run[2], reference[2], strict=True))


def layer_bytes(seq: int, hidden: int = HIDDEN) -> int:
    return seq * hidden * 4


# ---- a real container-style family: Gemma2 (the model calls the function on transformers 4.52) -------------


def gemma2() -> torch.nn.Module:
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        use_cache=False,
        attn_implementation="eager",  # a real 4D causal mask among the checkpointed call's arguments
    )
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config)


@pytest.fixture(scope="module")
def gemma2_plain(tmp_path_factory):
    return run(tmp_path_factory.mktemp("plain"), gemma2(), dataset(LENGTHS), mode="off")


@pytest.mark.parametrize(
    ("engine", "callback_args", "moved_layers"),
    [
        ("sync", {"mode": "on"}, LAYERS),
        ("sync", {"policy": Fixed(2)}, 2),
        ("stream", {"mode": "on"}, LAYERS - 1),  # the last layer's input stays on the device
    ],
)
def test_gemma2_layers_are_its_decoder_layers(tmp_path, gemma2_plain, engine, callback_args, moved_layers):
    net = gemma2()
    net.gradient_checkpointing_enable()
    kinds = {target.kind for target in find_targets(net)[0]}
    expected_kind = "container" if transformers.__version__.startswith("4.") else "layer"
    assert expected_kind in kinds
    result = run(tmp_path, net, dataset(LENGTHS), engine=engine, **callback_args)
    steps, _, _, layers = result
    level = LAYERS if callback_args.get("mode") == "on" else 2
    assert len(layers) == LAYERS
    assert steps == [(level, moved_layers * layer_bytes(seq)) for seq in LENGTHS]
    assert_same_training(result, gemma2_plain)


def test_policies_see_the_containers_layers_and_the_bytes_of_one(tmp_path):
    seen = []

    class Spy:
        def decide(self, observation):
            seen.append(observation)
            return observation.layers - 1  # what a predictive plan offloads at most: never the last layer

    net = gemma2()
    net.gradient_checkpointing_enable()
    net.train()
    controller = OffloadController(Settings(), probe=None, policy=Spy())
    controller.attach(net)
    assert controller.sizes.token_bytes == HIDDEN * 4
    for seq in (64, 32):
        ids = torch.randint(0, VOCAB, (2, seq))
        net(input_ids=ids, labels=ids).loss.backward()
        controller.end_step()
        assert controller.last_step_bytes == (LAYERS - 1) * 2 * layer_bytes(seq)
    assert [(o.layers, o.bytes_per_layer) for o in seen] == [(LAYERS, 2 * layer_bytes(s)) for s in (64, 32)]
    controller.detach()


# ---- a remote-code-style model: its forward calls the checkpoint function for each layer -----------------


class RemoteConfig(PretrainedConfig):
    model_type = "autooffload-remote-test"

    def __init__(self, vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        super().__init__(**kwargs)


class RemoteLayer(torch.nn.Module):
    """Attention-like mixing under a causal mask, with a position embedding; no checkpointing of its own."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(hidden, hidden)
        self.position = torch.nn.Embedding(256, hidden)

    def forward(self, hidden, mask, position_ids):
        x = hidden + self.position(position_ids)
        scores = x @ x.transpose(-1, -2) / x.shape[-1] ** 0.5 + mask[:, 0]
        return (hidden + torch.tanh(self.mix(scores.softmax(-1) @ x)),)


class RemoteModel(PreTrainedModel):
    config_class = RemoteConfig
    supports_gradient_checkpointing = True

    def __init__(self, config: RemoteConfig) -> None:
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(RemoteLayer(config.hidden_size) for _ in range(config.num_hidden_layers))
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, labels=None, **kwargs):
        batch, seq = input_ids.shape
        hidden = self.embed(input_ids)
        mask = torch.full((seq, seq), -1e4).triu(1).expand(batch, 1, seq, seq).contiguous()
        position_ids = torch.arange(seq).expand(batch, seq).contiguous()
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                hidden = self.checkpointed(layer, hidden, mask, position_ids)[0]
            else:
                hidden = layer(hidden, mask, position_ids)[0]
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return CausalLMOutput(loss=loss, logits=logits)

    def checkpointed(self, layer, hidden, mask, position_ids):
        return self._gradient_checkpointing_func(layer.__call__, hidden, mask, position_ids)


def remote_model() -> RemoteModel:
    torch.manual_seed(0)
    return RemoteModel(RemoteConfig())


@pytest.fixture(scope="module")
def remote_plain(tmp_path_factory):
    return run(tmp_path_factory.mktemp("plain"), remote_model(), dataset(LENGTHS), mode="off")


@pytest.mark.parametrize(
    ("engine", "callback_args", "moved_layers"),
    [("sync", {"mode": "on"}, LAYERS), ("sync", {"policy": Fixed(1)}, 1), ("stream", {"mode": "on"}, LAYERS - 1)],
)
def test_a_remote_code_model_offloads_its_layer_inputs_not_its_mask(
    tmp_path, remote_plain, engine, callback_args, moved_layers
):
    net = remote_model()
    net.gradient_checkpointing_enable()
    (target,), _ = find_targets(net)
    assert (target.kind, target.stack, target.size) == ("container", "layers", LAYERS)
    result = run(tmp_path, net, dataset(LENGTHS), engine=engine, **callback_args)
    steps, _, _, layers = result
    level = LAYERS if callback_args.get("mode") == "on" else 1
    assert len(layers) == LAYERS
    assert [entry[0] for entry in steps] == [level] * len(LENGTHS)
    assert [entry[1] for entry in steps] == [moved_layers * layer_bytes(seq) for seq in LENGTHS]
    assert_same_training(result, remote_plain)


class RemoteMoELayer(RemoteLayer):
    """Another class of layer, with experts of its own (Jamba's MoE layers among its Mamba and attention layers)."""

    def __init__(self, hidden: int, experts: int = 2) -> None:
        super().__init__(hidden)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, hidden, mask, position_ids):
        (hidden,) = super().forward(hidden, mask, position_ids)
        return (hidden + sum(expert(hidden) for expert in self.experts) / len(self.experts),)


def test_a_container_of_mixed_layers_plans_its_layers_not_the_experts_inside_one():
    """A hybrid container on transformers 4.52 (Jamba: attention and Mamba layers, every other one with experts) holds
    no list of one class but its layers, and a list of one class deeper (a layer's experts): the layers are its
    calls, all of them offload."""
    torch.manual_seed(0)
    net = RemoteModel(RemoteConfig(num_hidden_layers=4))
    net.layers = torch.nn.ModuleList(
        (RemoteMoELayer if index % 2 else RemoteLayer)(HIDDEN) for index in range(4)
    )  # fmt: skip
    net.gradient_checkpointing_enable()
    net.train()
    (target,), _ = find_targets(net)
    assert (target.kind, target.stack, target.size) == ("container", "layers", 4)
    controller = OffloadController(Settings(mode="on"), probe=None)
    controller.attach(net)
    ids = torch.randint(0, VOCAB, (1, 32))
    net(input_ids=ids).logits.sum().backward()
    assert controller.stats.step_bytes == 4 * layer_bytes(32)


def test_more_calls_than_layers_run_plain_with_one_warning():
    net = remote_model()
    net.gradient_checkpointing_enable()
    net.train()
    controller = OffloadController(Settings(mode="on"), probe=None)
    controller.attach(net)
    ids = torch.randint(0, VOCAB, (1, 32))
    net.layers.append(RemoteLayer(HIDDEN))  # the structure said 3 layers; the forward calls 4
    net(input_ids=ids).logits.sum().backward()
    assert controller.stats.step_bytes == LAYERS * layer_bytes(32)
    with pytest.warns(UserWarning, match="called its checkpoint function 4 times in one forward"):
        net(input_ids=ids)
    controller.detach()


class ParallelModel(RemoteModel):
    """Every layer reads the same hidden states (parallel branches, summed): one tensor, moved once."""

    def forward(self, input_ids, labels=None, **kwargs):
        batch, seq = input_ids.shape
        hidden = self.embed(input_ids)
        mask = torch.zeros(batch, 1, seq, seq)
        position_ids = torch.arange(seq).expand(batch, seq).contiguous()
        branches = [
            self._gradient_checkpointing_func(layer.__call__, hidden, mask, position_ids)[0] for layer in self.layers
        ]
        return CausalLMOutput(logits=self.head(sum(branches)))


def test_an_input_already_moved_in_this_forward_is_not_moved_again():
    torch.manual_seed(0)
    net = ParallelModel(RemoteConfig())
    net.gradient_checkpointing_enable()
    net.train()
    controller = OffloadController(Settings(mode="on"), probe=None)
    controller.attach(net)
    ids = torch.randint(0, VOCAB, (2, 32))
    for _ in range(2):
        net(input_ids=ids).logits.sum().backward()
        controller.end_step()
        assert controller.last_step_bytes == 2 * layer_bytes(32)
    controller.detach()


def test_per_layer_checkpointing_moves_only_the_layer_input_of_a_call_that_also_gets_the_mask():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net = remote_model()
    for index, layer in enumerate(net.layers):
        net.layers[index] = checkpoint_wrapper(layer, preserve_rng_state=False)  # layer(hidden, mask, position_ids)
    net.train()
    targets, _ = find_targets(net)
    assert [target.kind for target in targets] == ["layer"] * LAYERS
    controller = OffloadController(Settings(mode="on"), probe=None)
    controller.attach(net)
    ids = torch.randint(0, VOCAB, (2, 32))
    net(input_ids=ids, labels=ids).loss.backward()
    controller.end_step()
    assert controller.last_step_bytes == LAYERS * 2 * layer_bytes(32)
    controller.detach()


# ---- several stacks: a tiny Qwen2.5-VL on a text-only and on an image-and-text batch ---------------------

IMAGE, VIDEO, START, END = 250, 251, 252, 253
GRID = (1, 4, 4)  # 16 patches of 2x2 pixels, merged 2x2 into 4 image tokens


def qwen2_5_vl() -> torch.nn.Module:
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
            use_cache=False,
            bos_token_id=0,
            eos_token_id=1,
        ),
        vision_config=dict(
            depth=4,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=HIDDEN,
            spatial_merge_size=2,
            patch_size=2,
            temporal_patch_size=1,
            in_chans=3,
            fullatt_block_indexes=[1],
            window_size=8,
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        vocab_size=VOCAB,  # read from the top level by 4.52's loss
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


class Batches(torch.utils.data.Dataset):
    """Text-only batches and batches with one tiny image (4 image tokens among the text)."""

    def __init__(self, kinds: list[tuple[str, int]]) -> None:
        self.kinds = kinds

    def __len__(self) -> int:
        return len(self.kinds)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        kind, seq = self.kinds[index]
        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(2, 240, (seq,), generator=generator)
        item = {"input_ids": ids, "labels": ids}
        if kind == "image":
            tokens = GRID[0] * GRID[1] * GRID[2] // 4
            ids[2 : 4 + tokens] = torch.tensor([START] + [IMAGE] * tokens + [END])
            item["pixel_values"] = torch.randn(GRID[0] * GRID[1] * GRID[2], 3 * 2 * 2, generator=generator)
            item["image_grid_thw"] = torch.tensor([GRID])
        return item


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = {key: torch.stack([item[key] for item in items]) for key in ("input_ids", "labels")}
    if "pixel_values" in items[0]:
        batch["pixel_values"] = torch.cat([item["pixel_values"] for item in items])
        batch["image_grid_thw"] = torch.cat([item["image_grid_thw"] for item in items])
    return batch


VLM_BATCHES = [("text", 24), ("image", 32)]


@pytest.fixture(scope="module")
def vlm_plain(tmp_path_factory):
    return run(tmp_path_factory.mktemp("plain"), qwen2_5_vl(), Batches(VLM_BATCHES), collate, mode="off")


VISION_BLOCKS, PATCHES, VISION_HIDDEN = 4, 16, 16


@pytest.mark.parametrize(
    ("callback_args", "level"), [({"mode": "on"}, VISION_BLOCKS + LAYERS), ({"policy": Fixed(2)}, 2)]
)
def test_a_vlm_plans_its_vision_blocks_and_its_language_layers(tmp_path, vlm_plain, callback_args, level):
    # The vision blocks run only on the image batch, on its 16 patches (hidden 16), sized from pixel_values; the
    # partial level offloads language layers first: on the first image batch the blocks' bytes are not known yet.
    net = qwen2_5_vl()
    assert getattr(net.config, "hidden_size", None) is None  # the text config has it
    result = run(tmp_path, net, Batches(VLM_BATCHES), collate, **callback_args)
    steps, _, _, layers = result
    assert [slot.target.stack.rpartition(".")[2] for slot in layers] == ["blocks"] * VISION_BLOCKS + ["layers"] * LAYERS
    vision = VISION_BLOCKS * PATCHES * VISION_HIDDEN * 4 if level > LAYERS else 0
    expected = [
        (level, min(level, LAYERS) * layer_bytes(seq) + (vision if kind == "image" else 0)) for kind, seq in VLM_BATCHES
    ]
    assert steps == expected
    assert_same_training(result, vlm_plain)


def test_a_vlm_first_guess_of_bytes_per_layer_uses_the_text_config():
    net = qwen2_5_vl()
    net.gradient_checkpointing_enable()
    net.train()
    controller = OffloadController(Settings(), probe=None)
    controller.attach(net)
    assert controller.sizes.token_bytes == HIDDEN * 4
    assert len(controller.switch.layers) == VISION_BLOCKS + LAYERS
    controller.detach()


class Outer(torch.nn.Module):
    """The attached model; some code calls its inner model directly (TRL's Liger-loss paths call ``model.model``
    for the last hidden states), so the attached model's pre-forward hook does not run for that forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = remote_model()

    def forward(self, input_ids):
        return self.inner(input_ids=input_ids)


def test_a_container_called_without_the_attached_model_still_counts_its_calls_from_layer_zero():
    outer = Outer()
    outer.inner.gradient_checkpointing_enable()
    outer.train()
    controller = OffloadController(Settings(mode="on"), probe=None)
    controller.attach(outer)
    ids = torch.randint(0, VOCAB, (1, 32))
    for _ in range(2):
        outer.inner(input_ids=ids).logits.sum().backward()
        controller.end_step()
        assert controller.last_step_bytes == LAYERS * layer_bytes(32)
    controller.detach()


def qwen3() -> torch.nn.Module:
    from autooffload.demo import tiny_qwen3

    return tiny_qwen3(LAYERS, HIDDEN, VOCAB, seed=0)


def grads_with_a_side_forward(net: torch.nn.Module, side: str, controller_args: dict | None) -> tuple[list, tuple]:
    """A training forward, then a no-grad or an eval forward of another length, then the first one's backward:
    (the gradients, (the bytes the step moved, the bytes per token measured); None without a controller)."""
    net.gradient_checkpointing_enable()
    net.train()
    controller = OffloadController(probe=None, **controller_args) if controller_args is not None else None
    if controller is not None:
        controller.attach(net)
    ids, other = torch.randint(0, VOCAB, (2, 32)), torch.randint(0, VOCAB, (2, 48))
    loss = net(input_ids=ids, labels=ids).loss
    if side == "no_grad":
        with torch.no_grad():
            net(input_ids=other, labels=other)
    else:
        net.eval()
        net(input_ids=other, labels=other)
        net.train()
    loss.backward()
    if controller is None:
        return [p.grad for p in net.parameters()], None
    controller.end_step()
    controller.detach()
    return [p.grad for p in net.parameters()], (controller.last_step_bytes, controller.sizes.token_bytes)


@pytest.mark.parametrize("build", [remote_model, qwen3])
@pytest.mark.parametrize("side", ["no_grad", "eval"])
@pytest.mark.parametrize(("controller_args", "level"), [({"mode": "on"}, LAYERS), ({"policy": Fixed(2)}, 2)])
def test_a_forward_between_a_training_forward_and_its_backward_changes_neither_bytes_nor_gradients(
    build, side, controller_args, level
):
    # The side forward restarts the container's call counter and the moved inputs, as any forward does; the
    # training forward's saved inputs, their bytes and the gradients stay those of plain checkpointing.
    torch.manual_seed(0)
    reference, _ = grads_with_a_side_forward(build(), side, None)
    torch.manual_seed(0)
    grads, measured = grads_with_a_side_forward(build(), side, controller_args)
    assert measured == (level * 2 * layer_bytes(32), HIDDEN * 4)
    assert all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))


class KeywordModel(RemoteModel):
    """Calls the checkpoint function with the layer input as a keyword: torch's checkpoint does not save it."""

    def checkpointed(self, layer, hidden, mask, position_ids):
        return self._gradient_checkpointing_func(layer.__call__, hidden=hidden, mask=mask, position_ids=position_ids)


def test_a_layer_input_passed_as_a_keyword_is_counted_as_freeing_nothing_with_one_warning():
    torch.manual_seed(0)
    net = KeywordModel(RemoteConfig())
    net.gradient_checkpointing_enable({"use_reentrant": False})  # reentrant checkpointing refuses keywords
    net.train()
    controller = OffloadController(Settings(mode="on"), probe=None)
    controller.attach(net)
    ids = torch.randint(0, VOCAB, (1, 32))
    with pytest.warns(AutoOffloadWarning, match="passes no tensor positionally") as caught:
        for _ in range(2):
            net(input_ids=ids).logits.sum().backward()
            assert controller.planned_bytes() == controller.stats.step_bytes == 0
            controller.end_step()
    assert len([w for w in caught if "positionally" in str(w.message)]) == 1
    assert controller.sizes.bytes_per_layer == 0  # the second decision knew
    assert controller.sizes.token_bytes and controller.sizes.token_bytes > 0
    controller.detach()


def test_trl_sft_on_a_vlm_with_image_batches_moves_its_vision_blocks_and_language_layers(tmp_path):
    # TRL's SFTTrainer fine-tuning the tiny Qwen2.5-VL on rows that carry an image (pre-tokenized, as a VLM
    # processor would make them): both stacks move in mode on, the vision blocks from the first image batch on.
    import datasets
    import trl
    from test_trainers import tokenizer

    rows = [Batches([("image", 32)])[0], Batches([("image", 32)])[0]]
    data = datasets.Dataset.from_dict({key: [row[key].tolist() for row in rows] for key in rows[0]})

    def collator(items):
        batch = collate([{key: torch.tensor(value) for key, value in item.items()} for item in items])
        return {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}

    net = qwen2_5_vl()
    callback = AutoOffloadCallback(probe=None, mode="on")
    record = Record(callback)
    args = training_args(
        tmp_path, 2, arguments=trl.SFTConfig, dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False, report_to=[], bf16=False,
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=net, args=args, train_dataset=data, data_collator=collator, processing_class=tokenizer(),
        callbacks=[callback, record],
    )  # fmt: skip
    trainer.train()
    vision = VISION_BLOCKS * PATCHES * VISION_HIDDEN * 4
    assert record.steps == [(VISION_BLOCKS + LAYERS, LAYERS * layer_bytes(32) + vision)] * 2
