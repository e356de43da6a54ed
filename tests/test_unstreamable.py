"""What cannot stream, said plainly (issue 38 item 3).

A dense model asked to stream loads as stock with one line; a Mixture-of-Experts model whose
experts cannot stream (``integration/unstreamable.py``: dbrx's experts are a list of modules, not
a ``switch_layers`` one; a family without an adapter) is refused in one line where the flag or
``model_config`` asks, before anything is loaded, and loads whole with one line where
``--if-unstreamable whole`` or only ``MLX_LM_STREAMING_EXPERTS`` asks. The commands run installed,
as users run them.
"""

import json
import shutil

import mlx_lm
import pytest
from mlx_lm.models import dbrx, qwen3_moe
from support import (
    BIN,
    PROMPT,
    build_dbrx_checkpoint,
    build_dense_checkpoint,
    clean_env,
    generated_text,
    one_error_line,
    run_cli,
)

import mlx_lm_streaming
from mlx_lm_streaming import plugins
from mlx_lm_streaming.errors import UnstreamableModelError
from mlx_lm_streaming.integration import unstreamable
from mlx_lm_streaming.runtime.options import ENV

pytestmark = pytest.mark.usefixtures("require_hook")

WHOLE = "cannot stream: " + unstreamable.REFUSED["dbrx"] + ": loaded whole, as stock mlx-lm would"


@pytest.fixture(scope="module")
def models(checkpoint, tmp_path_factory):
    tokenizer = checkpoint("qwen3_moe")
    root = tmp_path_factory.mktemp("unstreamable")
    return {
        "dense": build_dense_checkpoint(root / "dense", tokenizer),
        "dbrx": build_dbrx_checkpoint(root / "dbrx", tokenizer),
    }


def generate(model, *flags, env=None, cwd):
    cmd = [BIN / "mlx_lm.generate", "--model", model, "--prompt", PROMPT]
    cmd += ["--max-tokens", "8", "--temp", "0", *flags]
    return run_cli(cmd, cwd, clean_env(**(env or {})))


@pytest.fixture(scope="module")
def stock_text(models, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("stock")
    out = {}
    for name, path in models.items():
        run = generate(path, cwd=cwd)
        assert run.returncode == 0 and not run.stderr, run.stderr
        out[name] = generated_text(run.stdout)
    return out


def test_a_dense_model_with_the_flag_loads_as_stock_with_one_line(models, stock_text, tmp_path):
    run = generate(models["dense"], "--streaming-experts", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == [
        f"mlx-lm-streaming: {models['dense']}: model_type 'llama' is not a Mixture-of-Experts "
        "model: loaded as stock mlx-lm would"
    ]
    assert generated_text(run.stdout) == stock_text["dense"]


@pytest.mark.parametrize(
    "flags, env",
    [
        (["--streaming-experts"], {}),
        (["--streaming-experts", "--if-unstreamable", "refuse"], {}),
        ([], {ENV["enabled"]: "1", ENV["if_unstreamable"]: "refuse"}),
        # the flag's refusal wins over a standing wish in the environment
        (["--streaming-experts"], {ENV["enabled"]: "1"}),
    ],
)
def test_an_moe_that_cannot_stream_is_refused_in_one_line(models, tmp_path, flags, env):
    run = generate(models["dbrx"], *flags, env=env, cwd=tmp_path)
    line = one_error_line(
        run, "mlx_lm.generate: error:", "model_type 'dbrx' cannot stream", "switch_layers",
        "--if-unstreamable whole",
    )
    assert run.returncode == 1 and "==========" not in run.stdout, line


@pytest.mark.parametrize(
    "flags, env",
    [
        (["--streaming-experts", "--if-unstreamable", "whole"], {}),
        (["--streaming-experts"], {ENV["if_unstreamable"]: "whole"}),
        # a standing wish for every load: loads whole
        ([], {ENV["enabled"]: "1"}),
    ],
)
def test_an_moe_that_cannot_stream_loads_whole_when_asked(models, stock_text, tmp_path, flags,
                                                          env):
    run = generate(models["dbrx"], *flags, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == [f"mlx-lm-streaming: {models['dbrx']}: model_type 'dbrx' "
                                       + WHOLE]
    assert generated_text(run.stdout) == stock_text["dbrx"]


def test_the_server_refuses_a_listed_model_before_it_starts(models, tmp_path):
    # the server loads its model on a thread, where a refusal would be a traceback in its log and
    # a server that cannot answer: a model type the list refuses is refused at parse time
    cmd = [BIN / "mlx_lm.server", "--model", models["dbrx"], "--streaming-experts", "--port", "1"]
    run = run_cli(cmd, tmp_path, timeout=60)
    one_error_line(run, "mlx_lm.server: error:", "model_type 'dbrx' cannot stream")
    assert run.returncode == 1


def test_a_bad_if_unstreamable_value_is_one_line(models, tmp_path):
    flags = ["--streaming-experts", "--if-unstreamable", "wholly"]
    run = generate(models["dbrx"], *flags, cwd=tmp_path)
    one_error_line(run, "argument --if-unstreamable", "refuse or whole", "'wholly'")
    assert run.returncode == 2


@pytest.mark.parametrize("command", ["plan", "pack", "verify"])
@pytest.mark.parametrize("model", ["dense", "dbrx"])
def test_our_commands_refuse_what_cannot_stream_in_one_line(models, tmp_path, command, model):
    """``verify`` on a dense model printed a traceback after its line (``plan`` and ``pack`` did
    not), and on dbrx suggested ``--if-unstreamable whole``, which none of them takes (issue 45,
    items 1 and 3)."""
    run = run_cli([BIN / "mlx_lm_streaming", command, models[model]], tmp_path, timeout=60)
    why = "is not a Mixture-of-Experts model" if model == "dense" else "cannot stream"
    line = one_error_line(run, f"mlx_lm_streaming {command}: error:", why)
    assert run.returncode == 1 and "--if-unstreamable" not in line, line


# -- the Python API ------------------------------------------------------------------------------


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Fails the test where stock ``load_weights`` runs for dbrx or qwen3_moe."""
    loaded = []

    def load_weights(self, *args, **kwargs):
        loaded.append(type(self).__module__)
        raise AssertionError(f"{type(self).__module__}: weights loaded")

    for module in (dbrx, qwen3_moe):
        monkeypatch.setattr(module.Model, "load_weights", load_weights)
    return loaded


def test_the_api_refuses_before_anything_loads(models, environ, nothing_loaded):
    with pytest.raises(UnstreamableModelError, match=r"'dbrx' cannot stream: its experts are a li"):
        mlx_lm_streaming.load(str(models["dbrx"]))
    with pytest.raises(UnstreamableModelError, match="if_unstreamable='whole'"):
        mlx_lm.load(str(models["dbrx"]), model_config={"streaming_experts": True})
    assert nothing_loaded == []


def test_the_api_loads_whole_when_asked(models, environ, capfd):
    model, tokenizer = mlx_lm_streaming.load(str(models["dbrx"]), if_unstreamable="whole")
    assert not hasattr(model, "expert_streaming")
    (line,) = capfd.readouterr().err.splitlines()
    assert line == f"mlx-lm-streaming: {models['dbrx']}: model_type 'dbrx' " + WHOLE
    stock, _ = mlx_lm.load(str(models["dbrx"]))
    assert mlx_lm.generate(model, tokenizer, "hi", max_tokens=4) == mlx_lm.generate(
        stock, tokenizer, "hi", max_tokens=4
    )


def test_a_family_without_an_adapter_is_refused_before_its_experts_load(
    checkpoint, environ, monkeypatch, nothing_loaded
):
    """An MoE whose experts are a ``SwitchGLU`` but whose family has no adapter (here qwen3_moe,
    its adapter taken away): refused, naming the module, before stock loads a weight."""
    adapters = {k: v for k, v in plugins.architectures().items() if k != "qwen3_moe"}
    monkeypatch.setattr(plugins, "architectures", lambda: adapters)
    with pytest.raises(UnstreamableModelError, match="mlx_lm.models.qwen3_moe has no streaming"):
        mlx_lm_streaming.load(str(checkpoint("qwen3_moe")))
    assert nothing_loaded == []


def test_muse_spark_is_refused_for_running_only_on_metal(models, environ, tmp_path):
    """Stock mlx-lm routes muse_spark's experts with a Metal kernel: refused by name and reason
    before the model is built (only its config is read)."""
    path = tmp_path / "muse_spark"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "muse_spark"}))
    for f in models["dense"].glob("model*.safetensors*"):
        shutil.copy(f, path / f.name)
    with pytest.raises(UnstreamableModelError, match="'muse_spark' cannot stream: stock mlx-lm "
                       "runs it only on Metal"):
        mlx_lm_streaming.load(str(path))


def test_an_adapter_takes_a_type_off_the_refused_list(models, environ, monkeypatch, capfd):
    # a plugin's adapter for a refused type wins over the list (docs/plugins.md); dbrx's experts
    # are still no switch_layers module, so it then loads as a model without experts
    from mlx_lm_streaming.architectures import ArchitectureAdapter

    adapters = {**plugins.architectures(), "dbrx": ArchitectureAdapter(("dbrx",))}
    monkeypatch.setattr(plugins, "architectures", lambda: adapters)
    model, _ = mlx_lm_streaming.load(str(models["dbrx"]))
    assert not hasattr(model, "expert_streaming")
    assert "is not a Mixture-of-Experts model" in capfd.readouterr().err
