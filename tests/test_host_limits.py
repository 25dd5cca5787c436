"""The host memory offload may count on is the tightest limit on the process: the machine's free memory, a
container's (cgroup v2 ``memory.max``/``memory.high``, cgroup v1 ``memory.limit_in_bytes``, at the process's cgroup
and above it) and the process's own (``RLIMIT_AS``, ``RLIMIT_DATA``). Read from cgroup file trees the tests write,
and from a real ``ulimit -v`` in a child process (issue 31)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from autooffload import AutoOffloadWarning
from autooffload.apply.host_budget import process_budget
from autooffload.apply.host_memory import HostMemory
from autooffload.observe.host_limits import Limit, read_limits, tightest

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]
PLENTY = (100 * GIB, 200 * GIB)


def cgroup_tree(tmp_path: Path, memberships: str, mounts: list[str], files: dict[str, str]) -> Path:
    """A process folder (``cgroup``, ``mountinfo``, ``status``) and the cgroup files under ``tmp_path``."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(memberships)
    lines = [f"{30 + i} 1 0:{40 + i} {m.format(root=tmp_path)}" for i, m in enumerate(mounts)]
    (proc / "mountinfo").write_text("\n".join(lines) + "\n")
    (proc / "status").write_text("Name:\tpython\nVmSize:\t 5242880 kB\nVmData:\t 1048576 kB\n")
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return proc


def limits(proc: Path, rlimits: dict[str, int] | None = None) -> list[Limit]:
    return read_limits(proc, machine=lambda: PLENTY, rlimits=lambda: rlimits or {})


def test_cgroup_v2_limits_of_the_process_cgroup_and_the_ones_above_it(tmp_path):
    proc = cgroup_tree(
        tmp_path,
        "0::/job/rank0\n",
        ["/ {root}/cg rw,nosuid - cgroup2 cgroup2 rw"],
        {
            "cg/job/memory.max": f"{8 * GIB}\n",
            "cg/job/memory.high": "max\n",
            "cg/job/memory.current": f"{2 * GIB}\n",
            "cg/job/memory.stat": f"anon 1024\ninactive_file {GIB}\n",
            "cg/job/rank0/memory.max": "max\n",
            "cg/job/rank0/memory.high": f"{6 * GIB}\n",
            "cg/job/rank0/memory.current": f"{3 * GIB // 2}\n",
        },
    )
    found = limits(proc)
    names = [limit.name for limit in found]
    assert names == [
        "host memory",
        f"cgroup v2 memory.high ({tmp_path}/cg/job/rank0)",
        f"cgroup v2 memory.max ({tmp_path}/cg/job)",
    ]
    assert found[1].available == 6 * GIB - 3 * GIB // 2
    assert found[2].available == 8 * GIB - (2 * GIB - GIB)  # its page cache is reclaimable
    binding = tightest(found)
    assert binding.available == 9 * GIB // 2 and binding.total == 6 * GIB and "rank0" in binding.name
    # auto: half of what the tightest limit leaves, over the node's ranks; a fraction: of its size
    assert process_budget("auto", found, 2) == (9 * GIB // 8, binding.name)
    assert process_budget("0.5", found, 1)[0] == 3 * GIB
    assert process_budget("1GiB", found, 2) == (GIB // 2, "AUTOOFFLOAD_HOST_MEMORY")


def test_cgroup_v1_inside_a_container_whose_mount_root_is_its_own_cgroup(tmp_path):
    proc = cgroup_tree(
        tmp_path,
        "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n",
        [
            "/docker/abc {root}/memory rw,nosuid - cgroup cgroup rw,memory",
            "/ {root}/unified rw - cgroup2 cgroup2 rw",
        ],
        {
            "memory/memory.limit_in_bytes": f"{4 * GIB}\n",
            "memory/memory.usage_in_bytes": f"{3 * GIB}\n",
            "memory/memory.stat": f"cache 5\ntotal_inactive_file {GIB // 2}\n",
            "unified/cgroup.procs": "",  # cgroup v2 mounted too (the hybrid layout), without a memory limit
        },
    )
    found = limits(proc)
    assert [limit.available for limit in found] == [PLENTY[0], 4 * GIB - (3 * GIB - GIB // 2)]
    assert tightest(found).total == 4 * GIB and "memory.limit_in_bytes" in tightest(found).name


def test_cgroup_v1_a_limit_above_the_container_only_memory_stat_names_is_read(tmp_path):
    """Issue 37, item 4.4: a Kubernetes pod on cgroup v1 limits the pod's cgroup, above the container's, which is
    all the container mounts: its own ``memory.limit_in_bytes`` says no limit, and only ``memory.stat``'s
    ``hierarchical_memory_limit`` (the tightest limit of the hierarchy) names the pod's. It was not read: the
    machine's memory was taken for what the process may use."""
    proc = cgroup_tree(
        tmp_path,
        "4:memory:/kubepods/pod1/ctr\n",
        ["/kubepods/pod1/ctr {root}/memory rw,nosuid - cgroup cgroup rw,memory"],
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": f"{3 * GIB}\n",
            "memory/memory.stat": f"hierarchical_memory_limit {8 * GIB}\ntotal_inactive_file {GIB}\n",
        },
    )
    found = limits(proc)
    assert found[1:] == [Limit(f"cgroup v1 hierarchical_memory_limit ({tmp_path}/memory)", 6 * GIB, 8 * GIB)]
    assert tightest(found).total == 8 * GIB


def test_no_limit_is_no_limit_and_an_unreadable_tree_is_the_machine(tmp_path):
    proc = cgroup_tree(
        tmp_path,
        "4:memory:/\n",
        ["/ {root}/memory rw - cgroup cgroup rw,memory"],
        {"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": f"{GIB}\n"},
    )
    assert limits(proc) == [Limit("host memory", *PLENTY)]
    assert limits(tmp_path / "missing") == [Limit("host memory", *PLENTY)]


def test_a_process_limit_is_the_process_own_not_divided_among_the_ranks(tmp_path):
    proc = cgroup_tree(tmp_path, "0::/\n", [], {})
    found = limits(proc, {"RLIMIT_AS": 6 * GIB, "RLIMIT_DATA": 64 * GIB})
    address_space = next(limit for limit in found if limit.name.startswith("RLIMIT_AS"))
    assert address_space.available == GIB and not address_space.shared  # 6 GiB less the 5 GiB mapped (VmSize)
    assert next(limit for limit in found if limit.name.startswith("RLIMIT_DATA")).available == 63 * GIB
    assert process_budget("auto", found, 8) == (GIB // 2, "RLIMIT_AS (ulimit -v)")  # not GiB / 16
    assert process_budget("auto", found[:1], 8)[0] == PLENTY[0] // 16


def test_a_new_buffer_keeps_a_tenth_of_the_tightest_limit_free(tmp_path):
    proc = cgroup_tree(tmp_path, "0::/\n", [], {})
    found = limits(proc, {"RLIMIT_AS": 6 * GIB})
    binding = tightest(found)
    host = HostMemory(
        pin=True,
        register=lambda t: None,
        unregister=lambda t: None,
        allocate=lambda n: torch.empty(n, dtype=torch.uint8),  # untouched pages: nothing is really used
        memory=lambda: (binding.available, binding.total),
        limits=lambda: found,
    )
    host.set_budget("2GiB")
    assert host.take(GIB // 4, torch.device("cpu")) is not None
    with pytest.warns(AutoOffloadWarning, match="host memory is short"):
        assert host.take(GIB // 2, torch.device("cpu")) is None  # 1 GiB left: 0.5 more would leave under 0.6


CHILD = textwrap.dedent(
    """
    import json, resource, sys, warnings
    sys.path.insert(0, {root!r})
    import torch
    from autooffload import OffloadController, Settings
    from autooffload.apply.host_memory import HostMemory
    from autooffload.demo import tiny_qwen3
    from autooffload.observe.host_limits import read_limits, tightest

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = tiny_qwen3(4, 64, 256, 0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
    # Pinning stands in (a CPU cannot pin): buffers are real anonymous mappings, counted by RLIMIT_AS.
    host = HostMemory(pin=True, register=lambda t: None, unregister=lambda t: None)
    controller = OffloadController(Settings(mode="on"), probe=None, host=host)
    before = tightest(read_limits()).available  # attach reads the limits between this reading and the next
    controller.attach(model)
    binding = tightest(read_limits())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for seq in (256, 128, 256):
        ids = torch.randint(0, 256, (1, seq))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.end_step()
    moved = controller.stats.total_bytes
    # A buffer of nearly all the limit leaves is what the process cannot afford: refused, not taken.
    left = tightest(read_limits()).available
    refused = host.take(int(0.95 * left), torch.device("cpu")) is None
    room = torch.empty(int(0.3 * left), dtype=torch.uint8)  # the process's own allocations still fit
    print(json.dumps(dict(
        limit=resource.getrlimit(resource.RLIMIT_AS)[0], binding=binding.name, available=binding.available,
        before=before, budget=host.budget_bytes, source=host.budget_source, peak=host.peak_held_bytes, moved=moved,
        refused=refused, room=room.numel(),
    )))
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="ulimit -v and /proc are Linux's")
def test_under_a_real_ulimit_v_the_budget_and_every_buffer_stay_within_it(tmp_path):
    """A child process under ``ulimit -v`` (RLIMIT_AS) of what it maps after its imports plus 768 MiB trains with
    every layer offloaded into real mappings: the budget is half of what the limit leaves (the machine's free
    memory set it before: gigabytes the process could not map), and a buffer the process cannot afford is
    refused while the process's own allocation still fits."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(ROOT)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith("AUTOOFFLOAD_")}
    probe = (  # what the child maps before it trains: its imports and its model (torchvision, where installed, too)
        "from autooffload.demo import tiny_qwen3; tiny_qwen3(4, 64, 256, 0); "
        "print(open('/proc/self/status').read().split('VmSize:')[1].split()[0])"
    )
    mapped_kib = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env).stdout)
    limit_kib = mapped_kib + 768 * 1024
    command = f"ulimit -v {limit_kib} && exec {sys.executable} {script}"
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["limit"] == limit_kib * 1024 and result["binding"] == "RLIMIT_AS (ulimit -v)"
    assert result["available"] < 768 * 2**20
    # half of what the limit left when attach read it (the process maps a little more as it goes)
    assert result["source"] == "RLIMIT_AS (ulimit -v)"
    assert result["available"] // 2 <= result["budget"] <= result["before"] // 2
    assert 0 < result["peak"] <= result["budget"] and result["moved"] > 0
    assert result["refused"] and result["room"] > 0
