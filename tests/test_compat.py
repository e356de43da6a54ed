"""The mlx-lm version guard: inside the supported range we patch; outside it, nothing changes and
streaming refuses in one line. Run under the oldest supported mlx-lm too (.ci/run)."""

import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest

from mlx_lm_streaming.errors import IncompatibleMlxLmError
from mlx_lm_streaming.runtime import mlx_compat

from support import BIN, clean_env, generate_cmd, generated_text, run

pytestmark = [pytest.mark.core, pytest.mark.usefixtures("require_hook")]

# an mlx-lm release we have not tested: the guard must refuse it
UNTESTED = "0.99.0"
# runs `mlx_lm.generate` with the guard told that mlx-lm is UNTESTED (the startup hook patches on
# import, after this monkeypatch)
AS_IF_UNTESTED = f"""
import sys
import mlx_lm_streaming.runtime.mlx_compat as compat
compat.mlx_lm_version = lambda: {UNTESTED!r}
import mlx_lm.utils, mlx_lm.generate
assert not getattr(mlx_lm.utils.load_model, "mlx_lm_streaming", False), "load_model was patched"
sys.argv = ["mlx_lm.generate"] + sys.argv[1:]
sys.modules["mlx_lm.generate"].main()
"""


@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.30.0", True),
        ("0.31.3", True),
        ("0.32.2", True),
        ("0.32.10.dev1", True),
        ("0.29.1", False),
        ("0.33.0", False),
        ("1.0", False),
        ("unknown", False),
    ],
)
def test_supported_range(version, ok):
    problem = mlx_compat.version_problem(version)
    assert (problem is None) == ok
    if not ok:
        assert version in problem
        assert mlx_compat.SUPPORTED_TEXT in problem or "could not be told" in problem


def test_installed_mlx_lm_is_supported():
    # the suite runs only against releases in the declared range
    assert mlx_compat.version_problem(mlx_lm.__version__) is None
    assert mlx_compat.problem() is None


def test_load_model_shape_is_checked():
    def old(model_path, lazy=False):
        pass

    assert "model_config" in mlx_compat.load_model_problem(old)
    assert mlx_compat.load_model_problem(mlx_lm.utils.load_model) is None

    def no_default(model_path, lazy=False, strict=True, model_config=None, get_model_classes=None):
        pass

    assert "get_model_classes" in mlx_compat.load_model_problem(no_default)


def test_mlx_lm_internals_are_reached_through_checks(monkeypatch):
    # what loading and the commands take from mlx-lm beyond its public API, each checked: None (or
    # nothing changed) where the check fails
    get = mlx_compat.model_classes()
    assert callable(get)
    model_class, args_class = get(config={"model_type": "qwen3_moe"})
    assert model_class.__module__ == "mlx_lm.models.qwen3_moe"
    assert mlx_compat.model_classes(lambda model_path: None) is None
    monkeypatch.delattr(mlx_lm.utils, "_download")
    assert mlx_compat.download("some/repo") is None

    class Inner:
        def pipeline(self, group, split=None):
            return ("stock", group)

    class Model:
        model = Inner()

    model = Model()
    assert mlx_compat.wrap_pipeline(model, lambda stock, group: ("ours", stock(group)))
    assert model.model.pipeline("g") == ("ours", ("stock", "g"))
    bare = type("Bare", (), {"model": object()})()
    assert not mlx_compat.wrap_pipeline(bare, lambda stock, group: None)


def test_switch_glu_body_is_checked():
    # schedules/direct.py runs SwitchGLU's call body a projection at a time (mlx_compat.switch_glu_*) and
    # tells decode from prefill by its sort threshold: a SwitchGLU that no longer does what we
    # repeat must be refused at patch time, not silently give other bits
    from mlx_lm.models.switch_layers import SwitchGLU

    assert mlx_compat.switch_glu_problem(SwitchGLU) is None

    class Resorted(SwitchGLU):
        def __call__(self, x, indices):
            x = mx.expand_dims(x, (-2, -3))
            do_sort = indices.size >= 32
            return x if do_sort else x

    assert "indices.size>=64" in mlx_compat.switch_glu_problem(Resorted)

    class Fused(SwitchGLU):
        def __call__(self, x, indices):
            return self.fused(x, indices)

    assert "expand_dims" in mlx_compat.switch_glu_problem(Fused)


def test_install_refuses_an_unsupported_mlx_lm(monkeypatch):
    import types

    utils = types.SimpleNamespace(load_model=lambda model_path, lazy=False: None)
    stock = utils.load_model
    monkeypatch.setattr(mlx_compat, "_checked", True)
    monkeypatch.setattr(mlx_compat, "_problem", mlx_compat.version_problem(UNTESTED))
    from mlx_lm_streaming.integration.integration import install

    with pytest.raises(IncompatibleMlxLmError, match=UNTESTED):
        install(utils)
    assert utils.load_model is stock


def test_stock_generate_unchanged_by_the_installed_package(checkpoint, tmp_path):
    # the same command with the startup hook off (as if we were not installed) and on
    ckpt = checkpoint("qwen3_moe")
    off = run(generate_cmd(ckpt), tmp_path, env=clean_env(MLX_LM_STREAMING_HOOK="0"))
    on = run(generate_cmd(ckpt), tmp_path)
    assert generated_text(on.stdout) == generated_text(off.stdout)
    assert on.stderr == off.stderr == ""


def untested_generate(args, tmp_path, **env):
    return subprocess.run(
        [sys.executable, "-c", AS_IF_UNTESTED, *map(str, args)],
        cwd=tmp_path,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_untested_mlx_lm_runs_stock_and_refuses_streaming(checkpoint, tmp_path):
    ckpt = checkpoint("qwen3_moe")
    stock = run(generate_cmd(ckpt), tmp_path, env=clean_env(MLX_LM_STREAMING_HOOK="0"))
    plain = untested_generate(generate_cmd(ckpt)[1:], tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert generated_text(plain.stdout) == generated_text(stock.stdout)
    assert plain.stderr == ""
    for args, env in (
        (generate_cmd(ckpt, "--streaming-experts")[1:], {}),
        (generate_cmd(ckpt, "--expert-cache-gb=1")[1:], {}),
        (generate_cmd(ckpt)[1:], {"MLX_LM_STREAMING_EXPERTS": "1"}),
    ):
        out = untested_generate(args, tmp_path, **env)
        assert out.returncode == 2, out
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert f"mlx-lm {UNTESTED} is installed" in lines[0]
        assert mlx_compat.SUPPORTED_TEXT in lines[0]
        assert out.stdout == ""


def test_untested_mlx_lm_env_route_warns_in_scripts(checkpoint, tmp_path):
    code = (
        "import mlx_lm_streaming.runtime.mlx_compat as c\n"
        f"c.mlx_lm_version = lambda: {UNTESTED!r}\n"
        "import mlx_lm\n"
        "print(hasattr(mlx_lm.utils.load_model, 'mlx_lm_streaming'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=clean_env(MLX_LM_STREAMING_EXPERTS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    assert out.stderr.count("\n") == 1 and UNTESTED in out.stderr


def test_cli_entry_points_exist():
    # the commands the wrapper patches are console scripts of this mlx-lm
    assert (BIN / "mlx_lm.generate").exists()


def test_a_generate_step_left_stock_says_why_with_the_stats(monkeypatch, capsys):
    # a generate_step that is not as layer-major prefill expects stays stock; the stats printed
    # at exit say so, once, before the stats lines
    import types

    from mlx_lm_streaming.integration import integration
    from mlx_lm_streaming.runtime.memory import report

    def generate_step(prompt, model):  # (none of the parameters the prefill reads)
        yield from ()

    fake = types.SimpleNamespace(generate_step=generate_step)
    monkeypatch.setattr(report, "_NOTES", [])
    integration.wrap_generate_step(fake)
    integration.wrap_generate_step(fake)
    assert fake.generate_step is generate_step
    options = types.SimpleNamespace(stats=True)
    state = types.SimpleNamespace(stats=lambda: {"hits": 1, "misses": 0}, closed=False, options=options)
    monkeypatch.setattr(report, "_REPORTING", [state])
    monkeypatch.setattr(report, "stats_line", lambda state, label: "[streaming] stats")
    report._report_stats()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1] == "[streaming] stats", lines
    assert lines[0].startswith("[streaming] layer-major prefill does not apply (")
    assert lines[0].endswith("): long prompts prefill chunk by chunk")
