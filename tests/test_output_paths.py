"""Two outputs of one run on one path, and a routing trace of another model (issue 37, items 2-3).

``--record-routing X --streaming-trace X`` exited 0 and the timeline was lost ("another process
wrote it since this run began"): refused at start, naming both options, whichever way each was
given. A trace recorded from one model was replaced by a run of another model on the same
``--record-routing`` path: refused, as ``pack`` refuses to replace another model's pack.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from support import clean_env, generate_cmd, load_streaming, one_error_line, run_cli

from mlx_lm_streaming.errors import ConfigurationError

pytestmark = pytest.mark.usefixtures("require_hook")


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("qwen3_moe")


@pytest.mark.parametrize(
    "flags, env, named",
    [
        (
            ["--record-routing", "same.x", "--streaming-trace", "same.x"],
            {},
            ["--record-routing and --streaming-trace", "same.x"],
        ),
        (  # spelt differently, one by flag and one by variable
            ["--record-routing", "./same.x"],
            {"MLX_LM_STREAMING_TRACE": "same.x"},
            ["--record-routing and MLX_LM_STREAMING_TRACE", "same.x"],
        ),
        (
            [],
            {"MLX_LM_STREAMING_RECORD_ROUTING": "same.x", "MLX_LM_STREAMING_TRACE": "same.x"},
            ["MLX_LM_STREAMING_RECORD_ROUTING and MLX_LM_STREAMING_TRACE", "same.x"],
        ),
    ],
)
def test_two_outputs_on_one_path_are_refused_at_start(ckpt, tmp_path, flags, env, named):
    cmd = generate_cmd(ckpt, "--streaming-experts", *flags)
    out = run_cli(cmd, tmp_path, env=clean_env(**env))
    line = one_error_line(out, *named, "two files of one run cannot share a path")
    assert out.returncode == 2, line
    assert not (tmp_path / "same.x").exists(), "nothing written"


def test_an_output_on_the_commands_own_prompt_cache_file_is_refused(ckpt, tmp_path):
    """``mlx_lm.cache_prompt`` writes ``--prompt-cache-file`` at its end: a trace there would be
    written over (or write over it)."""
    from support import BIN

    cmd = [BIN / "mlx_lm.cache_prompt", "--model", ckpt, "--prompt", "hi", "--streaming-experts"]
    cmd += ["--prompt-cache-file", "c.safetensors", "--streaming-trace", "./c.safetensors"]
    out = run_cli(cmd, tmp_path)
    line = one_error_line(out, "--streaming-trace and --prompt-cache-file name one file")
    assert out.returncode == 2, line
    assert not (tmp_path / "c.safetensors").exists()


def test_two_outputs_on_one_path_are_refused_in_python(ckpt, tmp_path):
    same = tmp_path / "same.x"
    with pytest.raises(ConfigurationError, match="record_routing and trace name one file"):
        load_streaming(ckpt, record_routing=str(same), trace=str(tmp_path / "." / "same.x"))
    assert not same.exists()


def _record(model_path, trace: Path) -> bytes:
    model, _ = load_streaming(model_path, record_routing=str(trace))
    model(mx.array([[1, 2, 3, 4]]))
    model.expert_streaming.close()
    return trace.read_bytes()


def test_a_trace_of_another_model_is_not_replaced(checkpoint, ckpt, tmp_path):
    trace = tmp_path / "routing.jsonl"
    before = _record(ckpt, trace)
    header = json.loads(before.splitlines()[0])
    assert header["model_path"] == str(ckpt.resolve())
    other = checkpoint("mixtral")
    with pytest.raises(ConfigurationError, match="another model") as e:
        load_streaming(other, record_routing=str(trace))
    assert str(trace) in str(e.value) and str(ckpt.resolve()) in str(e.value)
    assert trace.read_bytes() == before
    # the same model records over its own trace, as before
    assert _record(ckpt, trace).splitlines()[0] == before.splitlines()[0]


def test_a_trace_of_another_model_is_refused_by_the_command(checkpoint, ckpt, tmp_path):
    trace = tmp_path / "routing.jsonl"
    before = _record(ckpt, trace)
    twin = Path(shutil.copytree(ckpt, tmp_path / "twin"))  # another directory: another model
    cmd = generate_cmd(twin, "--streaming-experts", "--record-routing", trace)
    out = run_cli(cmd, tmp_path)
    line = one_error_line(out, trace, "another model", str(ckpt.resolve()), "remove the file")
    assert out.returncode == 2, line
    assert trace.read_bytes() == before
    trace.unlink()  # the documented way to record over it
    done = run_cli(cmd, tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(trace.read_text().splitlines()[0])["model_path"] == str(twin.resolve())
