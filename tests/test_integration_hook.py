"""The startup hook: installed by the wheel, cheap, invisible until mlx_lm is imported, and harmless
when our package is broken. Also the command-line flag plumbing of ``integration``.
"""

import argparse
import pkgutil
import re
import shutil
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import pytest
from support import BIN, clean_env, generate_cmd, generated_text

from mlx_lm_streaming import _bootstrap
from mlx_lm_streaming.integration import integration
from mlx_lm_streaming.runtime.options import ENV

# the startup hook must be installed (tests/run.sh installs the package non-editable)
pytestmark = pytest.mark.usefixtures("require_hook")

ROOT = Path(__file__).resolve().parents[1]
PURELIB = Path(sysconfig.get_paths()["purelib"])


def py(code, cwd, env=None, check=True):
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


# -- installation --------------------------------------------------------------------------------


def test_wheel_installs_the_hook_files():
    for name in ("mlx_lm_streaming.pth", "mlx_lm_streaming.start"):
        installed = PURELIB / name
        assert installed.is_file(), f"{installed} missing: the wheel did not ship it"
        assert installed.read_text() == (ROOT / "hooks" / name).read_text()


def test_pth_is_one_import_line():
    lines = (ROOT / "hooks" / "mlx_lm_streaming.pth").read_text().splitlines()
    code = [l for l in lines if l.strip() and not l.startswith("#")]
    assert len(code) == 1 and code[0].startswith("import ")


def test_start_file_names_the_install_entry_point():
    entries = [
        line.strip()
        for line in (ROOT / "hooks" / "mlx_lm_streaming.start").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert entries == ["mlx_lm_streaming._bootstrap:install"]
    assert pkgutil.resolve_name(entries[0]) is _bootstrap.install


def test_startup_imports_nothing_but_the_hook(tmp_path):
    code = "import sys; print(' '.join(sorted(sys.modules)))"
    on = set(py(code, tmp_path).stdout.split())
    off = set(
        py(code, tmp_path, env=clean_env(MLX_LM_STREAMING_HOOK="0")).stdout.split()
    )
    # the hook and the option table it takes its flags and variables from (stdlib only)
    assert on - off == {
        "mlx_lm_streaming",
        "mlx_lm_streaming._bootstrap",
        "mlx_lm_streaming.option_table",
    }
    assert not [m for m in on if m.split(".")[0] in ("mlx", "mlx_lm")]


def test_startup_bench_runs(tmp_path):
    # the 5 ms limit is bench/startup.py --check's (timings do not belong in the suite: a busy
    # machine made this flaky); here only what it finds: the installed hook, nothing of mlx imported
    out = subprocess.run(
        [sys.executable, ROOT / "bench" / "startup.py", "--runs", "2"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    hook = re.search(r"^hook: (.*)$", out.stdout, re.M).group(1)
    assert Path(hook) == PURELIB / "mlx_lm_streaming.pth"
    assert "mlx modules imported at start-up: none\n" in out.stdout
    assert re.search(r"^startup overhead: [\d.]+ ms", out.stdout, re.M)


# -- patching ------------------------------------------------------------------------------------

PATCHED = """
import importlib, inspect, sys
import mlx_lm, mlx_lm.utils, mlx_lm.generate, mlx_lm.server

u, gen = mlx_lm.utils, sys.modules["mlx_lm.generate"]  # mlx_lm.generate is the function
assert type(u.__loader__).__name__ == "SourceFileLoader", u.__loader__
assert u.__spec__.loader is u.__loader__
assert "def load_model" in inspect.getsource(u)
assert mlx_lm.load is u.load is gen.load is mlx_lm.server.load
print(getattr(u.load_model, "mlx_lm_streaming", False))
print(getattr(gen.main, "mlx_lm_streaming", False))
print(getattr(mlx_lm.server.main, "mlx_lm_streaming", False))
importlib.reload(u)
print(getattr(u.load_model, "mlx_lm_streaming", False))
print("mlx_lm_streaming.integration.loading" in sys.modules)
"""


def test_mlx_lm_modules_are_patched_on_import(tmp_path):
    out = py(PATCHED, tmp_path).stdout.split()
    # patched, again after a reload, and nothing heavy imported while not streaming
    assert out == ["True", "True", "True", "True", "False"]


def test_hook_off_leaves_mlx_lm_stock(tmp_path):
    out = py(PATCHED, tmp_path, env=clean_env(MLX_LM_STREAMING_HOOK="0")).stdout.split()
    assert out == ["False"] * 4 + ["False"]


def test_hook_installed_late_patches_what_is_imported(tmp_path):
    code = (
        "import mlx_lm.utils as u\n"
        "from mlx_lm_streaming import _bootstrap\n"
        "_bootstrap.install()\n"
        "print(getattr(u.load_model, 'mlx_lm_streaming', False))"
    )
    # MLX_LM_STREAMING_HOOK=0 keeps the .pth line from installing the hook, and install() too
    out = py(code, tmp_path, env=clean_env(MLX_LM_STREAMING_HOOK="0"))
    assert out.stdout.split() == ["False"]
    late = code.replace("import mlx_lm.utils as u\n", "import mlx_lm.utils as u, os\n")
    late = late.replace(
        "_bootstrap.install()",
        "os.environ.pop('MLX_LM_STREAMING_HOOK'); _bootstrap.install()",
    )
    out = py(late, tmp_path, env=clean_env(MLX_LM_STREAMING_HOOK="0"))
    assert out.stdout.split() == ["True"]


# -- a broken install ----------------------------------------------------------------------------


def shadow_package(root: Path, files: dict) -> Path:
    """A copy of ``mlx_lm_streaming`` under ``root``, to put first on PYTHONPATH."""
    pkg = root / "mlx_lm_streaming"
    pkg.mkdir(parents=True)
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            shutil.copy(ROOT / "mlx_lm_streaming" / name, pkg / name)
        else:
            (pkg / name).write_text(text)
    return root


BROKEN = {
    "package fails to import": {
        "__init__.py": "raise RuntimeError('broken on purpose')\n"
    },
    "integration fails to import": {
        "__init__.py": None,
        "_bootstrap.py": None,
        "option_table.py": None,
        "integration/__init__.py": None,
        "integration/integration.py": "raise ImportError('broken on purpose')\n",
    },
    "patch raises": {
        "__init__.py": None,
        "_bootstrap.py": None,
        "option_table.py": None,
        "integration/__init__.py": None,
        "integration/integration.py": "def patch_module(module):\n    raise ValueError('broken on purpose')\n",
    },
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_install_leaves_stock_mlx_lm(case, checkpoint, stock_text, tmp_path):
    shadow = shadow_package(tmp_path / "shadow", BROKEN[case])
    env = clean_env(PYTHONPATH=str(shadow))
    out = py("import mlx_lm; print('ok')", tmp_path, env=env)
    assert out.stdout == "ok\n"
    warning = out.stderr.splitlines()
    assert len(warning) == 1 and "mlx-lm-streaming" in warning[0], out.stderr
    assert "broken on purpose" in warning[0]
    gen = subprocess.run(
        [str(c) for c in generate_cmd(checkpoint("qwen3_moe"))],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gen.returncode == 0, gen.stderr
    assert generated_text(gen.stdout) == stock_text("qwen3_moe")
    assert len([l for l in gen.stderr.splitlines() if "mlx-lm-streaming" in l]) == 1
    # the stock parser: our flags are unknown again
    flag = subprocess.run(
        [str(BIN / "mlx_lm.generate"), "--streaming-experts"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        flag.returncode == 2
        and "unrecognized arguments: --streaming-experts" in flag.stderr
    )


# -- flag plumbing (in process) ------------------------------------------------------------------


def fake_cli(parse=True, error=None):
    """A module whose ``main`` builds a parser inline, like ``mlx_lm.server``."""
    module = types.ModuleType("fake_cli")

    def main(argv):
        if error:
            raise error
        parser = argparse.ArgumentParser(prog="fake")
        parser.add_argument("--model")
        return parser.parse_args(argv) if parse else parser

    module.main = main
    integration.wrap_cli_main(module)
    return module


def test_flags_become_environment_variables(environ):
    stock = argparse.ArgumentParser.parse_known_args
    args = fake_cli().main(
        ["--model", "m", "--streaming-experts", "--expert-cache-gb", "2.5"]
        + ["--expert-store", "memory", "--expert-kernel", "gather"]
    )
    assert vars(args) == {"model": "m"}
    assert environ[ENV["enabled"]] == "1"
    assert environ[ENV["expert_cache_gb"]] == "2.5"
    assert environ[ENV["store"]] == "memory"
    assert environ[ENV["kernel"]] == "gather"
    assert ENV["stats"] not in environ
    assert argparse.ArgumentParser.parse_known_args is stock


def test_no_flags_no_environment(environ):
    assert vars(fake_cli().main(["--model", "m"])) == {"model": "m"}
    assert not [k for k in environ if k.startswith("MLX_LM_STREAMING_")]


def test_only_the_first_parser_is_extended(environ):
    module = fake_cli()
    module.main(["--model", "m"])
    other = argparse.ArgumentParser()
    with pytest.raises(SystemExit):
        other.parse_args(["--streaming-experts"])


def test_argparse_restored_when_main_fails_before_parsing(environ):
    stock = argparse.ArgumentParser.parse_known_args
    with pytest.raises(KeyError):
        fake_cli(error=KeyError("x")).main([])
    assert argparse.ArgumentParser.parse_known_args is stock


def test_options_need_streaming_experts_unless_the_environment_has_it(environ, capsys):
    with pytest.raises(SystemExit):
        fake_cli().main(["--expert-cache-gb", "1", "--streaming-stats"])
    assert "--expert-cache-gb, --streaming-stats need --streaming-experts" in (
        capsys.readouterr().err
    )
    environ[ENV["enabled"]] = "1"
    fake_cli().main(["--expert-cache-gb", "1"])
    assert environ[ENV["expert_cache_gb"]] == "1.0"


def test_wrapping_is_idempotent():
    module = fake_cli()
    main = module.main
    integration.wrap_cli_main(module)
    assert module.main is main and main.stock.__name__ == "main"
