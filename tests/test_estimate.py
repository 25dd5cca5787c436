"""``autooffload estimate``: the arithmetic, the recommendation, the JSON and the errors of the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autooffload import estimate as est
from autooffload.estimate import machine

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fixed_machine(monkeypatch):
    """No NVML and a known amount of host memory, so results do not depend on the machine running the tests."""
    monkeypatch.setattr(machine, "nvml_total_bytes", lambda: None)
    monkeypatch.setattr(machine, "host_available_bytes", lambda: 64 * GIB)


def write_config(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return path


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = est.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def qwen3_8b(tmp_path: Path) -> Path:
    return write_config(
        tmp_path,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        num_hidden_layers=36,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        torch_dtype="bfloat16",
    )


def test_qwen3_8b_at_128k_tokens_keeps_36_gib_of_layer_inputs(tmp_path, capsys):
    code, out, err = run([str(qwen3_8b(tmp_path)), "--seq", "131072", "--device-memory", "80", "--json"], capsys)
    assert (code, err) == (0, "")
    result = json.loads(out)
    assert (result["layers"], result["hidden"], result["dtype"], result["batch"]) == (36, 4096, "bf16", 1)
    assert result["saved_bytes"] == 36 * GIB
    assert result["freed_bytes"] == 36 * GIB
    assert result["pinned_bytes"] == 36 * GIB  # 1 GiB per layer is already a power of two
    assert result["copy_bytes"] == 72 * GIB
    assert result["copy_seconds"] == pytest.approx(72 * GIB / 25e9)
    assert result["device_memory_bytes"] == 80 * GIB
    assert result["host_fits"] is True
    assert result["verdict"] == "auto"  # 131072 >= the default seq_high


def test_table_names_the_figures_and_the_recommendation(tmp_path, capsys):
    code, out, _ = run([str(qwen3_8b(tmp_path)), "--seq", "131072", "--device-memory", "80"], capsys)
    assert code == 0
    assert "saved layer inputs on device    36.00 GiB" in out
    assert "copy volume per step            72.00 GiB" in out
    assert "recommendation: auto: offload will switch on" in out


@pytest.mark.parametrize(("dtype", "bytes_per_value"), [("fp32", 4), ("fp16", 2), ("bf16", 2), ("fp8", 1)])
def test_dtype_sets_the_bytes_per_value(dtype, bytes_per_value):
    result = est.estimate(layers=2, hidden=8, seq=16, batch=3, dtype=dtype)
    assert result.saved_bytes == 2 * 3 * 16 * 8 * bytes_per_value


def test_pinned_memory_is_one_page_rounded_buffer_per_layer_not_a_power_of_two():
    result = est.estimate(layers=3, hidden=3, seq=5, dtype="fp32")  # 60 bytes per layer
    assert result.saved_bytes == 180
    assert result.pinned_bytes == 3 * 4096
    result = est.estimate(layers=2, hidden=3000, seq=1000, dtype="fp32")  # 12,000,000 bytes per layer
    assert result.pinned_bytes == 2 * 12_001_280  # torch's pinned allocator: 2 x 16 MiB


def test_ranks_per_node_check_the_node_and_the_budget_caps_the_layers(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(machine, "pinnable_limit", lambda: (2 * GIB, "memlock limit, ulimit -l"))
    monkeypatch.setenv("AUTOOFFLOAD_HOST_MEMORY", "96GiB")
    argv = [str(qwen3_8b(tmp_path)), "--seq", "131072", "--device-memory", "80", "--json"]
    one = json.loads(run(argv, capsys)[1])
    assert (one["node_pinned_bytes"], one["host_fits"], one["budget_layers"]) == (36 * GIB, True, 36)
    code, out, _ = run([*argv, "--ranks-per-node", "8"], capsys)
    eight = json.loads(out)
    assert code == 0 and eight["node_pinned_bytes"] == 8 * 36 * GIB and eight["host_fits"] is False
    assert eight["verdict"] == "host-too-small" and eight["budget_layers"] == 12  # 96 GiB / 8 ranks / 1 GiB
    assert "caps offload at 12 of 36 layers" in eight["recommendation"]
    assert eight["pinnable_bytes"] == 2 * GIB and "pinning stops at 2.00 GiB" in eight["recommendation"]
    table = run([*argv[:-1], "--ranks-per-node", "8"], capsys)[1]
    assert "pinned host memory, node       288.00 GiB  8 rank(s)" in table
    assert "fits 12 of 36 layers per rank" in table and "pinnable per process" in table


def test_multimodal_config_reads_the_text_model(tmp_path):
    path = write_config(tmp_path, hidden_size=1152, text_config={"num_hidden_layers": 28, "hidden_size": 3584})
    assert est.read_config(path) == (28, 3584)


def test_a_vlm_without_a_top_level_hidden_size_reads_its_language_model(tmp_path):
    path = write_config(tmp_path, hidden_size=None, llm_config={"num_hidden_layers": 24, "hidden_size": 896})
    assert est.read_config(path) == (24, 896)


def test_other_key_names_and_a_model_folder(tmp_path):
    write_config(tmp_path, n_layer=12, n_embd=768)
    assert est.read_config(tmp_path) == (12, 768)


def test_flags_override_the_config(tmp_path, capsys):
    path = write_config(tmp_path, num_hidden_layers=36, hidden_size=4096)
    code, out, _ = run([str(path), "--layers", "2", "--seq", "10", "--dtype", "fp32", "--json"], capsys)
    assert code == 0
    assert json.loads(out)["saved_bytes"] == 2 * 10 * 4096 * 4


def test_device_memory_defaults_to_unknown_without_nvml(capsys):
    code, out, _ = run(["--layers", "2", "--hidden", "8", "--seq", "16", "--json"], capsys)
    result = json.loads(out)
    assert code == 0
    assert (result["device_memory_bytes"], result["device_memory_source"]) == (None, "unknown")
    assert result["verdict"] == "not-needed"


def test_device_memory_defaults_to_nvml_when_readable(monkeypatch, capsys):
    monkeypatch.setattr(machine, "nvml_total_bytes", lambda: 141 * GIB)
    _, out, _ = run(["--layers", "2", "--hidden", "8", "--seq", "16", "--json"], capsys)
    result = json.loads(out)
    assert (result["device_memory_bytes"], result["device_memory_source"]) == (141 * GIB, "nvml")


def test_recommendations():
    def verdict(**kwargs) -> str:
        return est.estimate(layers=10, hidden=1024, seq=8192, seq_high=32768, **kwargs).verdict

    saved = 10 * 8192 * 1024 * 2
    assert verdict(device_memory_bytes=100 * saved) == "not-needed"
    assert verdict(device_memory_bytes=saved) == "required"
    assert verdict(device_memory_bytes=saved, host_available_bytes=saved - 1) == "host-too-small"
    assert verdict(device_memory_bytes=saved * 3 // 2) == "auto"  # saved inputs take two thirds of the device
    assert est.estimate(layers=10, hidden=1024, seq=32768, seq_high=32768).verdict == "auto"
    # A host that cannot pin the copies does not matter while offload stays off.
    assert verdict(device_memory_bytes=100 * saved, host_available_bytes=0) == "not-needed"


def test_seq_high_follows_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("AUTOOFFLOAD_SEQ_HIGH", "1000")
    monkeypatch.setenv("AUTOOFFLOAD_SEQ_LOW", "500")
    _, out, _ = run(["--layers", "2", "--hidden", "8", "--seq", "1000", "--json"], capsys)
    assert (json.loads(out)["seq_high"], json.loads(out)["verdict"]) == (1000, "auto")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{missing}", "--seq", "8"], "config file not found"),
        (["{bad_json}", "--seq", "8"], "is not valid JSON"),
        (["{list_json}", "--seq", "8"], "not a config object"),
        (["{no_layers}", "--seq", "8"], "no layer count"),
        (["{no_hidden}", "--seq", "8"], "no hidden size"),
        (["--layers", "2", "--hidden", "8", "--seq", "0"], "--seq: '0' must be positive"),
        (["--layers", "-2", "--hidden", "8", "--seq", "8"], "--layers: '-2' must be positive"),
        (["--layers", "2", "--hidden", "8", "--seq", "8", "--batch", "-1"], "--batch: '-1' must be positive"),
        (["--layers", "2", "--hidden", "8", "--seq", "8", "--device-memory", "-80"], "must be positive"),
        (["--layers", "2", "--hidden", "8", "--seq", "8", "--host-bandwidth", "0"], "must be positive"),
        (["--layers", "2", "--hidden", "8", "--seq", "8", "--dtype", "int4"], "unknown dtype 'int4'"),
        (["--layers", "2", "--seq", "8"], "give a config.json or both --layers and --hidden"),
        (["--layers", "2", "--hidden", "8"], "--seq"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, argv, message):
    files = {
        "missing": tmp_path / "absent.json",
        "bad_json": tmp_path / "bad.json",
        "list_json": tmp_path / "list.json",
        "no_layers": tmp_path / "no_layers.json",
        "no_hidden": tmp_path / "no_hidden.json",
    }
    files["bad_json"].write_text("{not json")
    files["list_json"].write_text("[1, 2]")
    files["no_layers"].write_text(json.dumps({"hidden_size": 64}))
    files["no_hidden"].write_text(json.dumps({"num_hidden_layers": 4}))
    argv = [a.format(**files) for a in argv]
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("autooffload estimate: error: ")
    assert message in lines[0]


def test_bad_environment_variable_is_an_input_error(monkeypatch, capsys):
    monkeypatch.setenv("AUTOOFFLOAD_SEQ_HIGH", "many")
    code, _, err = run(["--layers", "2", "--hidden", "8", "--seq", "8"], capsys)
    assert code == 2
    assert "AUTOOFFLOAD_SEQ_HIGH" in err and len(err.strip().splitlines()) == 1


def test_python_dash_m_runs_the_command(tmp_path):
    path = write_config(tmp_path, num_hidden_layers=4, hidden_size=64)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOOFFLOAD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "autooffload", "estimate", str(path), "--seq", "1024", "--dtype", "fp32", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["saved_bytes"] == 4 * 1024 * 64 * 4


def test_keep_figures_one_layers_activations_and_how_many_layers_could_keep(tmp_path, capsys):
    from autooffload.decide.activations import LayerShape

    argv = [str(qwen3_8b(tmp_path)), "--seq", "8192", "--device-memory", "80", "--other-memory", "20", "--json"]
    code, out, _ = run(argv, capsys)
    result = json.loads(out)
    layer = LayerShape(4096, 12288, 32, 8, 128, 2)  # head_dim from hidden / heads: the config has none
    kept = round(layer.bytes(8192, 8192))
    assert code == 0
    assert result["kept_layer_bytes"] == kept
    assert result["layer_activation_bytes"] == kept + 8192 * 4096 * 2
    room = (0.9 - 0.05) * 80 * GIB - 20 * GIB - result["saved_bytes"]  # keep leaves keep_margin free
    assert result["keepable_layers"] == int(room // kept) < 36
    code, out, _ = run([str(qwen3_8b(tmp_path)), "--seq", "8192", "--device-memory", "80"], capsys)
    assert "34 of 36  under memory_high 0.9 less keep_margin 0.05 of the device, after the saved inputs (upper" in out
    assert "one layer's full activations" in out


def test_the_layers_that_could_keep_leave_the_keep_margin_free(tmp_path, capsys, monkeypatch):
    """The controller keeps under memory_high less keep_margin (AUTOOFFLOAD_KEEP_MARGIN); the estimate counts the
    layers that could keep the same way, so a wider margin set for the run shows fewer."""
    argv = [str(qwen3_8b(tmp_path)), "--seq", "8192", "--device-memory", "80", "--other-memory", "20", "--json"]
    counts = {}
    for margin in ("0", "0.3"):
        monkeypatch.setenv("AUTOOFFLOAD_KEEP_MARGIN", margin)
        code, out, _ = run(argv, capsys)
        result = json.loads(out)
        room = (0.9 - float(margin)) * 80 * GIB - 20 * GIB - result["saved_bytes"]
        assert code == 0 and result["keepable_layers"] == int(room // result["kept_layer_bytes"])
        counts[margin] = result["keepable_layers"]
    assert counts["0.3"] < counts["0"]


def test_keep_figures_without_device_memory_are_unknown(capsys):
    code, out, _ = run(["--layers", "2", "--hidden", "8", "--seq", "16", "--json"], capsys)
    assert code == 0 and json.loads(out)["keepable_layers"] is None
    code, _, err = run(["--layers", "2", "--hidden", "8", "--seq", "16", "--other-memory", "-1"], capsys)
    assert code == 2 and "--other-memory: '-1' must be zero or positive" in err


def test_an_encoder_decoder_config_counts_both_stacks_at_their_own_lengths(tmp_path, capsys):
    config = write_config(
        tmp_path, model_type="bart", is_encoder_decoder=True, d_model=1024, encoder_layers=12, decoder_layers=6
    )
    code, out, err = run([str(config), "--seq", "4096", "--target-seq", "512", "--json"], capsys)
    assert (code, err) == (0, "")
    result = json.loads(out)
    assert (result["layers"], result["decoder_layers"], result["target_seq"]) == (12, 6, 512)
    assert result["saved_bytes"] == (12 * 4096 + 6 * 512) * 1024 * 2
    assert result["keepable_layers"] in (None, 0)


def test_target_seq_is_required_for_an_encoder_decoder_config_and_refused_otherwise(tmp_path, capsys):
    t5 = write_config(tmp_path, model_type="t5", is_encoder_decoder=True, d_model=512, num_layers=6)
    code, _, err = run([str(t5), "--seq", "1024"], capsys)
    assert code == 2 and "encoder-decoder config: pass --target-seq" in err
    (tmp_path / "q").mkdir()
    code, _, err = run([str(qwen3_8b(tmp_path / "q")), "--seq", "1024", "--target-seq", "64"], capsys)
    assert code == 2 and "--target-seq is for encoder-decoder configs" in err


def test_a_step_whose_other_memory_alone_exceeds_the_device_cannot_fit(capsys):
    """Issue 54: ``--device-memory 24 --other-memory 30`` answered "offload not needed". Offload moves only the saved
    layer inputs; what the rest of the step takes stays on the device, so the job cannot fit at all."""
    argv = ["--layers", "36", "--hidden", "4096", "--seq", "8192", "--device-memory", "24", "--other-memory", "30"]
    code, out, _ = run([*argv, "--json"], capsys)
    result = json.loads(out)
    assert (code, result["verdict"]) == (0, "cannot-fit")
    assert "cannot fit" in result["recommendation"] and "30.00 GiB" in result["recommendation"]
    _, out, _ = run(argv, capsys)
    assert "recommendation: the job cannot fit" in out and "not needed" not in out
    # The saved inputs and the rest together over the device: offload is required, not "not needed".
    half = est.estimate(36, 4096, 8192, device_memory_bytes=24 * GIB, other_memory_bytes=23 * GIB)
    assert half.verdict == "required" and "23.00 GiB" in half.recommendation


def test_a_hub_id_is_read_from_the_local_cache_or_named_as_not_local(tmp_path, capsys, monkeypatch):
    """Issue 54: ``estimate Qwen/Qwen3-8B`` said "config file not found". The estimate reads no network: a Hub id is
    read from the local Hugging Face cache where it is there, and otherwise the error says only a local config is
    read."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, err = run(["Qwen/Qwen3-8B", "--seq", "8192"], capsys)
    assert (code, out, len(err.strip().splitlines())) == (2, "", 1)
    assert "Qwen/Qwen3-8B" in err and "local" in err and "not found" not in err
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-8B"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    qwen3_8b(snapshot)
    code, out, err = run(["Qwen/Qwen3-8B", "--seq", "8192", "--json"], capsys)
    assert (code, err) == (0, "")
    assert (json.loads(out)["layers"], json.loads(out)["hidden"]) == (36, 4096)
