"""A model that checkpoints its layers by calling ``torch.utils.checkpoint.checkpoint`` itself, not the function
transformers installs (CLVP's conditioning encoder, on 5.25): autooffload finds it as a container (the flag, a list of
blocks, no checkpointed layer inside) and installs its function, which the model never calls. Nothing can move; the
run must say so once, not report its layers as offloaded in silence (issue 50's testers column: ``clvp`` moved 0 of
165,440 bytes with no warning)."""

from __future__ import annotations

import warnings

import torch
import torch.utils.checkpoint
from conftest import offloading
from test_layers import LAYERS, VOCAB, RemoteConfig, RemoteModel

from autooffload import AutoOffloadWarning


class DirectModel(RemoteModel):
    def checkpointed(self, layer, hidden, mask, position_ids):
        return torch.utils.checkpoint.checkpoint(layer.__call__, hidden, mask, position_ids, use_reentrant=False)


def step(net: torch.nn.Module) -> list[torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    net.zero_grad()
    net(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.clone() for p in net.parameters() if p.grad is not None]


def direct_model() -> DirectModel:
    torch.manual_seed(0)
    net = DirectModel(RemoteConfig()).train()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return net


def test_a_container_that_calls_torch_checkpoint_itself_warns_once_and_trains_as_plain():
    reference = step(direct_model())
    net = direct_model()
    controller = offloading(net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = [step(net) for _ in range(2)]
        controller.end_step()
    said = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert controller.last_step_bytes == 0
    assert len(said) == 1 and "container-silent" in said[0] and f"its {LAYERS} layer(s)" in said[0], said
    assert all(torch.equal(a, b) for g in grads for a, b in zip(g, reference, strict=True))
