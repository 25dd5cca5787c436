"""The memory signal: which reading is used when. There is no GPU here, so the hardware (``torch.cuda``'s
memory functions and ``pynvml``) is stood in for by the small fakes below, injected into the real probe; the
controller, the policies and Trainer that consume the reading are real."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import InOrderTrainer, dataset, model, training_args

from autooffload import AutoOffloadCallback, NvmlProbe, OffloadController, ProbeUnavailable, Settings
from autooffload.callback import PEAKED_DELTA

GiB = 2**30
UUID = "5a3e1c2b-0000-4000-8000-0123456789ab"  # torch's form: no GPU-/MIG- prefix


class FakeCuda:
    """torch.cuda's memory functions for ``devices`` devices of ``total`` bytes each."""

    def __init__(self, devices: int = 1, total: int = 80 * GiB, context: int = GiB) -> None:
        self.total = total
        self.allocated = [0] * devices
        self.peak = [0] * devices
        self.reserved = [0] * devices
        self.retries = [0] * devices
        self.context = context  # what the device holds outside the caching allocator
        self.resets = 0

    def step(self, device: int, peak: int, end: int = 0, retries: int = 0) -> None:
        """A step whose live tensors peaked at ``peak`` bytes and ended at ``end``."""
        self.peak[device] = max(self.peak[device], peak)
        self.reserved[device] = max(self.reserved[device], peak)
        self.allocated[device] = end
        self.retries[device] += retries

    def used(self, device: int) -> int:
        return self.reserved[device] + self.context

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, index: int) -> SimpleNamespace:
        return SimpleNamespace(uuid=f"{UUID[:-1]}{index}")

    def memory_allocated(self, index: int | None = None) -> int:
        return self.allocated[index or 0]

    def max_memory_allocated(self, index: int | None = None) -> int:
        return self.peak[index or 0]

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        self.peak[index or 0] = self.allocated[index or 0]
        self.resets += 1

    def memory_reserved(self, index: int | None = None) -> int:
        return self.reserved[index or 0]

    def memory_stats(self, index: int | None = None) -> dict[str, int]:
        return {"num_alloc_retries": self.retries[index or 0]}

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        return self.total - self.used(index or 0), self.total


class FakeNvml:
    """pynvml over ``cuda``'s devices. ``mig``: device 0 is a MIG instance of ``parent_total``, found by UUID only
    as ``MIG-<uuid>`` when ``mig_uuid`` (older drivers name no instance); by index NVML reads the parent."""

    class NVMLError(Exception):
        pass

    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, cuda: FakeCuda, mig: bool = False, mig_uuid: bool = True, parent_total: int = 80 * GiB):
        self.cuda, self.mig, self.mig_uuid, self.parent_total = cuda, mig, mig_uuid, parent_total

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid: str):
        for index in range(len(self.cuda.peak)):
            name = self.cuda.get_device_properties(index).uuid
            if not self.mig and uuid == f"GPU-{name}":
                return ("device", index)
            if self.mig and self.mig_uuid and uuid == f"MIG-{name}":
                return ("device", index)
        raise self.NVMLError("Not Found")

    def nvmlDeviceGetHandleByIndex(self, index: int):
        return ("parent", index) if self.mig else ("device", index)

    def nvmlDeviceGetMigMode(self, handle):
        return (1, 1) if self.mig else (0, 0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        kind, index = handle
        if kind == "parent":  # the whole GPU: every instance's use, against the GPU's total
            return SimpleNamespace(used=self.parent_total // 2, total=self.parent_total)
        return SimpleNamespace(used=self.cuda.used(index), total=self.cuda.total)


def test_nvml_by_uuid_reads_the_step_peak_plus_what_lies_outside_the_allocator():
    cuda = FakeCuda()
    probe = NvmlProbe("cuda:0", cuda=cuda, nvml=FakeNvml(cuda))
    cuda.step(0, peak=40 * GiB, end=GiB)
    reading = probe.read()
    assert (reading.used_bytes, reading.total_bytes, reading.alloc_retries) == (41 * GiB, 80 * GiB, 0)
    assert probe.sources == {0: "nvml"}
    cuda.step(0, peak=8 * GiB)  # shorter batches: the reading falls although the reservation stays at 40 GiB
    assert probe.read().used_bytes == 9 * GiB


def test_a_peek_reads_the_step_so_far_and_leaves_its_peak_counting():
    cuda = FakeCuda()
    probe = NvmlProbe("cuda:0", cuda=cuda, nvml=FakeNvml(cuda))
    probe.reset()
    cuda.step(0, peak=30 * GiB, end=2 * GiB)  # the backward, before the optimizer's first step
    assert probe.peek().used_bytes == 31 * GiB
    cuda.step(0, peak=20 * GiB, end=3 * GiB)  # the optimizer step: lower, so the step's peak stays the backward's
    assert probe.read().used_bytes == 31 * GiB


def test_allocator_retries_in_a_step_read_as_a_full_device_and_switch_offload_on():
    cuda = FakeCuda()
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    controller = OffloadController(
        Settings(policy="hysteresis", min_steps=1), probe=NvmlProbe(0, cuda=cuda, nvml=FakeNvml(cuda))
    )
    assert controller.attach(net)
    levels = []
    # 60% allocated, but the allocator freed its cache and retried: fragmentation, the device is full.
    for peak, retries in [(48 * GiB, 0), (48 * GiB, 3), (30 * GiB, 0), (30 * GiB, 0)]:
        levels.append(controller.before_forward(64, 64))
        cuda.step(0, peak=peak, retries=retries)
        controller.end_step()
        levels.append(controller.memory_fraction)
    layers = len(controller.switch.layers)
    assert levels[:4] == [0, 49 / 80, 0, 1.0]
    assert levels[4] == layers  # the step after the retries offloads
    assert levels[5] == 31 / 80 and levels[6] == 0  # retries stopped growing: the reading is the peak again


def test_mig_instance_found_by_its_mig_uuid():
    cuda = FakeCuda(total=20 * GiB)
    probe = NvmlProbe(0, cuda=cuda, nvml=FakeNvml(cuda, mig=True, mig_uuid=True))
    cuda.step(0, peak=10 * GiB)
    reading = probe.read()
    assert probe.sources == {0: "nvml"} and (reading.used_bytes, reading.total_bytes) == (11 * GiB, 20 * GiB)


def test_mig_instance_nvml_cannot_name_reads_mem_get_info_not_the_parent_gpu():
    cuda = FakeCuda(total=20 * GiB)
    probe = NvmlProbe(0, cuda=cuda, nvml=FakeNvml(cuda, mig=True, mig_uuid=False))
    cuda.step(0, peak=10 * GiB)
    reading = probe.read()
    assert probe.sources == {0: "mem_get_info"}
    assert (reading.used_bytes, reading.total_bytes) == (11 * GiB, 20 * GiB)  # not 50% of an 80 GiB parent


def test_without_pynvml_mem_get_info_reads_the_device():
    cuda = FakeCuda()
    probe = NvmlProbe(0, cuda=cuda, nvml=None)
    cuda.step(0, peak=20 * GiB)
    assert probe.sources == {0: "mem_get_info"} and probe.read().used_bytes == 21 * GiB


def test_several_devices_read_every_one_and_report_the_fullest():
    cuda = FakeCuda(devices=3)
    probe = NvmlProbe(["cuda:0", "cuda:2", "cpu", "cuda:0"], cuda=cuda, nvml=FakeNvml(cuda))
    assert probe.devices == [0, 2]
    cuda.step(0, peak=60 * GiB)
    cuda.step(1, peak=79 * GiB)  # a device the model is not on
    cuda.step(2, peak=20 * GiB)
    assert probe.read().used_bytes == 61 * GiB
    cuda.step(0, peak=10 * GiB)
    cuda.step(2, peak=70 * GiB, retries=1)
    assert probe.read().fraction == 1.0
    with pytest.raises(ProbeUnavailable, match="CUDA"):
        NvmlProbe(["cpu"], cuda=cuda, nvml=None)


def test_the_probe_keeps_the_run_peak_that_its_resets_hide_from_torch():
    cuda = FakeCuda()
    cuda.step(0, peak=2 * GiB, end=GiB)  # the model moved to the device before the first step
    probe = NvmlProbe(0, cuda=cuda, nvml=FakeNvml(cuda))
    for peak in (5 * GiB, 9 * GiB, 3 * GiB):
        cuda.step(0, peak=peak, end=GiB)
        probe.read()
    assert cuda.max_memory_allocated() == GiB  # what torch's counter says after the probe's resets
    assert probe.peak_allocated() == 9 * GiB
    cuda.step(0, peak=12 * GiB, end=GiB)  # after the last reading (a save, an evaluation)
    assert probe.peak_allocated() == 12 * GiB
    probe.reset()  # the next step's start
    cuda.step(0, peak=4 * GiB, end=GiB)
    assert probe.read().used_bytes == 5 * GiB and probe.peak_allocated() == 12 * GiB


class StepPeaks:
    """On every step, the fake device's live tensors peak at the next of ``peaks``."""

    def __init__(self, cuda: FakeCuda, peaks: list[int]) -> None:
        self.cuda, self.peaks = cuda, list(peaks)

    def __call__(self, module, args, kwargs) -> None:
        if module.training and self.peaks:
            self.cuda.step(0, peak=self.peaks.pop(0), end=GiB)


def test_marks_split_a_step_into_segments_and_the_reading_is_still_the_steps_peak():
    """The keep model's marks on a GPU: each reads the peak of live tensors since the last one and resets torch's
    counter, so the step's reading must be the largest of the segments, not what the counter says at its end."""
    cuda = FakeCuda(total=100 * GiB, context=0)
    probe = NvmlProbe("cuda:0", cuda=cuda, nvml=None)
    probe.reset()
    cuda.step(0, 10 * GiB, end=5 * GiB)
    probe.mark("forward")
    cuda.step(0, 30 * GiB, end=20 * GiB)  # the peak of the step: in the marked segment
    probe.mark("layer")
    cuda.step(0, 22 * GiB, end=4 * GiB)
    reading = probe.read()
    assert reading.used_bytes == 30 * GiB
    assert probe.segments() == [(None, 10 * GiB), ("forward", 30 * GiB), ("layer", 22 * GiB)]
    probe.reset()
    cuda.step(0, 8 * GiB, end=4 * GiB)
    assert probe.read().used_bytes == 8 * GiB and probe.segments() is None  # a step without marks: none
    assert probe.peak_allocated() == 30 * GiB


def test_trainer_peaked_delta_is_the_run_peak_although_the_probe_resets_every_step(tmp_path):
    cuda = FakeCuda()
    callback = AutoOffloadCallback(probe=NvmlProbe(0, cuda=cuda, nvml=FakeNvml(cuda)), policy="hysteresis")
    net = model()
    net.register_forward_pre_hook(StepPeaks(cuda, [5 * GiB, 9 * GiB, 3 * GiB]), with_kwargs=True)
    args = training_args(tmp_path, 3, skip_memory_metrics=False)
    trainer = InOrderTrainer(model=net, args=args, train_dataset=dataset([64, 64, 64]), callbacks=[callback])
    trainer.train()
    # What Trainer's memory tracker computes at the end of train() on a GPU: torch's peak counter minus what
    # is allocated, then passed to trainer.log (the tracker reports no GPU keys on this CPU, so the test
    # passes the value the tracker would pass).
    tracked = max(0, cuda.max_memory_allocated() - cuda.memory_allocated())
    assert tracked == 0
    trainer.log({PEAKED_DELTA: tracked})
    assert trainer.state.log_history[-1][PEAKED_DELTA] == 8 * GiB


class NoUuidCuda(FakeCuda):
    def get_device_properties(self, index: int) -> SimpleNamespace:
        return SimpleNamespace(uuid="")  # a torch or driver that names no UUID: only the index is left


@pytest.mark.parametrize("visible, source", [(None, "nvml"), ("0,1", "nvml"), ("1,0", "mem_get_info")])
def test_without_a_uuid_nvml_is_read_by_index_only_where_the_numbering_is_nvmls(monkeypatch, visible, source):
    # CUDA_VISIBLE_DEVICES=1,0: torch's cuda:0 is NVML's device 1; by index NVML would read another GPU.
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cuda = NoUuidCuda(devices=2)
    probe = NvmlProbe("cuda:0", cuda=cuda, nvml=FakeNvml(cuda))
    assert probe.sources == {0: source}


class Garbage:
    """A probe that reads well, then, from its second reading on, returns ``reading`` (or raises it)."""

    def __init__(self, reading) -> None:
        self.reading, self.reads = reading, 0

    def read(self):
        from autooffload import MemoryReading

        self.reads += 1
        if self.reads == 1:
            return MemoryReading(40 * GiB, 80 * GiB)
        if isinstance(self.reading, BaseException):
            raise self.reading
        return self.reading


def _nvml_error():
    import pynvml

    return pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)


@pytest.mark.parametrize(
    "reading",
    ["nan", "above", "negative", "zero total", "nvml"],
)
def test_a_probe_that_reads_garbage_is_dropped_with_one_warning(tmp_path, reading):
    """NaN, a fraction above 1, a negative use, a total of 0: no reading, so the probe is dropped (one
    probe-failed warning) and the sequence trigger decides, as after an NVML error. Before: NaN and a fraction
    above 1 reached the policy as a memory fraction."""
    import warnings

    from autooffload import AutoOffloadWarning, MemoryReading

    readings = {
        "nan": MemoryReading(float("nan"), 80 * GiB),
        "above": MemoryReading(90 * GiB, 80 * GiB),
        "negative": MemoryReading(-1, 80 * GiB),
        "zero total": MemoryReading(0, 0),
        "nvml": _nvml_error(),
    }
    probe = Garbage(readings[reading])
    callback = AutoOffloadCallback(probe=probe, policy="hysteresis")
    net = model()
    trainer = InOrderTrainer(
        model=net, args=training_args(tmp_path, 3), train_dataset=dataset([64, 64, 64]), callbacks=[callback]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        trainer.train()
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours) == 1 and "memory reading failed" in ours[0], ours
    assert trainer.state.global_step == 3 and probe.reads == 2  # dropped at its first bad reading
    assert callback.controller.memory.peak_fraction == 0.5  # the good reading stands; the bad one never counted
    assert not callback.controller.failed


def test_a_device_error_at_the_memory_reading_surfaces_at_once(tmp_path):
    """A device-side error of the user's own kernel can first surface where the probe reads the device (the
    driver's error is sticky). Before: taken for a probe failure, one probe-failed warning, the memory signal
    dropped, and the real error a step later. Now it is the step's error and stops the run where it surfaced."""
    import torch

    error = torch.AcceleratorError("CUDA error: device-side assert triggered")
    probe = Garbage(error)
    callback = AutoOffloadCallback(probe=probe, policy="hysteresis")
    trainer = InOrderTrainer(
        model=model(), args=training_args(tmp_path, 3), train_dataset=dataset([64, 64, 64]), callbacks=[callback]
    )
    with pytest.raises(torch.AcceleratorError, match="device-side assert triggered"):
        trainer.train()
    assert trainer.state.global_step == 2  # the reading at step 2's end raised: no third step ran
    assert probe.reads == 2


def test_a_dropped_probe_lets_go_of_the_model():
    """A probe that watches the model (a simulated device's forward hooks) and then fails is dropped, and what it
    put on the model goes with it. Before: its hooks stayed on the model for good (the fault matrix found it)."""
    import warnings

    import torch

    from autooffload import SimulatedDevice

    class FailingDevice(SimulatedDevice):
        def read(self):
            raise RuntimeError("NVML: GPU is lost")

    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    controller = OffloadController(Settings(), probe=FailingDevice("64MiB"))
    controller.attach(net)
    hooked = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in net.modules())
    ids = torch.randint(0, 256, (1, 32))
    net(input_ids=ids, labels=ids).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        controller.end_step()
    assert controller.memory.probe is None
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in net.modules()) == hooked - 2
