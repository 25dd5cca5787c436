"""A tensor a checkpointed layer saved, modified in place before the backward: plain checkpointing raises (autograd
checks a saved tensor's version), and so must autooffload, whose saved-tensor hooks skip that check. Before (issue
37, item 4.4): a mask kept on the device under the hooks was used modified, silently, and a layer input moved to
host memory silently gave the gradient of its value before the change. The check holds a moved tensor weakly (it
must be free to leave the device): one modified in place and let go of before the backward gives the gradient of its
value before the change, where plain checkpointing, which holds it, raises."""

from __future__ import annotations

import pytest
import torch
from test_layers import RemoteModel, remote_model

from autooffload import OffloadController, Settings
from autooffload.apply.host_memory import HostMemory


class Modifying(RemoteModel):
    """The container model of tests/test_layers.py, which modifies in place, after its layers ran, what its first
    layer saved: its input (``what="input"``) or the mask every layer saved (``what="mask"``)."""

    what = "mask"

    def forward(self, input_ids, labels=None, **kwargs):
        batch, seq = input_ids.shape
        hidden = self.embed(input_ids) * 1.0
        first = hidden
        mask = torch.full((seq, seq), -1e4).triu(1).expand(batch, 1, seq, seq).contiguous()
        position_ids = torch.arange(seq).expand(batch, seq).contiguous()
        for layer in self.layers:
            hidden = self.checkpointed(layer, hidden, mask, position_ids)[0]
        with torch.no_grad():
            (mask if self.what == "mask" else first).mul_(0.5)
        self.modified = first  # still held at the backward (one let go of first cannot be checked: module docs)
        return torch.nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), input_ids.flatten())


def modifying(what: str) -> torch.nn.Module:
    net = remote_model()
    net.__class__ = Modifying
    net.what = what
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    return net


@pytest.mark.parametrize("what", ["mask", "input"])
@pytest.mark.parametrize("engine", ["sync", "stream"])
def test_a_saved_tensor_modified_in_place_raises_as_under_plain_checkpointing(what, engine):
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        modifying(what)(ids).backward()  # plain checkpointing
    net = modifying(what)
    host = HostMemory(pin=True, register=lambda t: None, unregister=lambda t: None, drain=lambda d: None)
    controller = OffloadController(Settings(mode="on", engine=engine, host_memory="1GiB"), probe=None, host=host)
    assert controller.attach(net)
    loss = net(ids)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert controller.stats.step_bytes > 0 and not controller.failed  # it offloaded; the error is the step's
