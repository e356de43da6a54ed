"""Every failure a user can cause: one line on stderr naming what is at fault, a non-zero exit, no
traceback, through every entry point (an mlx-lm command with the flag, the same command with the
environment variable, our ``mlx_lm_streaming`` subcommands); the Python API raises our exception
types with the same message. docs/reliability.md lists each case with its test.

These run the installed commands (``pip install .``, not editable), like tests/test_integration.py.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import (
    BIN,
    build_dense_checkpoint,
    clean_env,
    load_streaming,
    one_error_line,
    run_cli,
)

import mlx_lm_streaming
from mlx_lm_streaming.errors import CheckpointError, ConfigurationError, one_line
from mlx_lm_streaming.runtime.options import StreamingOptions
from mlx_lm_streaming.runtime.sizes import gb_as_given, gb_at_least
from mlx_lm_streaming.files.packfile import PACK_NAME

GENERATE = [BIN / "mlx_lm.generate", "--prompt", "hi", "--max-tokens", "2", "--model"]
STREAMING = [BIN / "mlx_lm_streaming"]


pytestmark = pytest.mark.usefixtures("require_hook")


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("qwen3_moe")


def generate(model, *flags, env=None, cwd):
    return run_cli([*GENERATE, model, *flags], cwd, env=clean_env(**(env or {})))


def streaming(*args, env=None, cwd):
    return run_cli([*STREAMING, *args], cwd, env=clean_env(**(env or {})))


# -- option values -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, named",
    [
        ({"MLX_LM_STREAMING_CACHE_GB": "abc"}, "MLX_LM_STREAMING_CACHE_GB='abc'"),
        ({"MLX_LM_STREAMING_CACHE_GB": "inf"}, "MLX_LM_STREAMING_CACHE_GB='inf'"),
        ({"MLX_LM_STREAMING_CACHE_GB": "-2"}, "MLX_LM_STREAMING_CACHE_GB='-2'"),
        ({"MLX_LM_STREAMING_EXPERTS": "maybe"}, "MLX_LM_STREAMING_EXPERTS='maybe'"),
        (
            {"MLX_LM_STREAMING_DIRECT_READS": "sometimes"},
            "MLX_LM_STREAMING_DIRECT_READS",
        ),
        ({"MLX_LM_STREAMING_STATS": "loud"}, "MLX_LM_STREAMING_STATS='loud'"),
        ({"MLX_LM_STREAMING_STORE": "nosuch"}, "MLX_LM_STREAMING_STORE"),
        ({"MLX_LM_STREAMING_KERNEL": "nosuch"}, "MLX_LM_STREAMING_KERNEL"),
    ],
)
def test_bad_environment_value_names_the_variable(env, named, ckpt, tmp_path):
    env = {"MLX_LM_STREAMING_EXPERTS": "1", **env}
    one_error_line(
        generate(ckpt, env=env, cwd=tmp_path), "mlx_lm.generate: error:", named
    )


@pytest.mark.parametrize(
    "env, named",
    [
        ({"MLX_LM_STREAMING_CACHE_GB": "abc"}, "MLX_LM_STREAMING_CACHE_GB='abc'"),
        ({"MLX_LM_STREAMING_STORE": "nosuch"}, "MLX_LM_STREAMING_STORE"),
    ],
)
def test_bad_environment_value_beside_the_flag_names_the_variable(
    env, named, ckpt, tmp_path
):
    out = generate(ckpt, "--streaming-experts", env=env, cwd=tmp_path)
    one_error_line(out, "mlx_lm.generate: error:", named)


@pytest.mark.parametrize(
    "env",
    [
        {"MLX_LM_STREAMING_EXPERTS": "maybe"},
        {"MLX_LM_STREAMING_CACHE_GB": "abc"},
        {"MLX_LM_STREAMING_CACHE_GB": "inf"},
        {"MLX_LM_STREAMING_DIRECT_READS": "sometimes"},
        {"MLX_LM_STREAMING_STATS": "loud"},
    ],
)
def test_python_api_raises_the_same_message_for_the_environment(env):
    name = next(iter(env))
    environ = {"MLX_LM_STREAMING_EXPERTS": "1", **env}
    with pytest.raises(ConfigurationError, match=f"^{name}="):
        StreamingOptions.from_env(environ)


@pytest.mark.parametrize("value", ["inf", "nan", "abc"])
def test_budget_flag_must_be_a_positive_finite_number(value, ckpt, tmp_path):
    out = generate(
        ckpt, "--streaming-experts", "--expert-cache-gb", value, cwd=tmp_path
    )
    line = one_error_line(out, "argument --expert-cache-gb", repr(value))
    assert out.returncode == 2, line


def test_infinite_budget_in_plan_and_model_config(ckpt, tmp_path):
    out = streaming("plan", ckpt, "--expert-cache-gb", "inf", cwd=tmp_path)
    one_error_line(
        out, "mlx_lm_streaming plan: error: argument --expert-cache-gb", "finite"
    )
    with pytest.raises(ConfigurationError, match="expert_cache_gb 'inf'.*finite"):
        load_streaming(ckpt, expert_cache_gb="inf")
    with pytest.raises(ConfigurationError, match="finite"):
        load_streaming(ckpt, expert_cache_gb=float("inf"))


def _budget_message_minimum(line: str) -> float:
    # "... to at least 1.43e-05 GB"
    return float(line.rsplit("at least ", 1)[1].split()[0])


@pytest.mark.parametrize("route", ["flag", "env", "plan"])
def test_budget_below_one_expert_per_layer_shows_the_minimum(route, ckpt, tmp_path):
    tiny = "0.0000001"
    if route == "flag":
        out = generate(
            ckpt, "--streaming-experts", "--expert-cache-gb", tiny, cwd=tmp_path
        )
    elif route == "env":
        env = {"MLX_LM_STREAMING_EXPERTS": "1", "MLX_LM_STREAMING_CACHE_GB": tiny}
        out = generate(ckpt, env=env, cwd=tmp_path)
    else:
        out = streaming("plan", ckpt, "--expert-cache-gb", tiny, cwd=tmp_path)
    line = one_error_line(
        out, "below the minimum of one expert per MoE layer", "--expert-cache-gb"
    )
    # one unit, decimal GB, on the line (it mixed KB and GiB-counted "GB" before issue 21)
    assert "0.000 GB" not in line and " GB for 2 layers" in line, line
    assert not re.search(r"\d (B|KB|MB|KiB|MiB|GiB)\b", line), line
    # the minimum it names is enough: plan accepts it
    minimum = _budget_message_minimum(line)
    ok = streaming("plan", ckpt, "--expert-cache-gb", repr(minimum), cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "slots per layer: 1" in ok.stdout
    with pytest.raises(ConfigurationError) as info:
        load_streaming(ckpt, expert_cache_gb=float(tiny))
    assert one_line(info.value) in line


def test_a_budget_just_below_the_minimum_reads_as_a_different_number(ckpt, tmp_path):
    """``--expert-cache-gb 0.00786`` was "below the minimum of ... 0.00786 GB": the budget is named
    as given, the minimum rounded up (issue 37, item 7)."""
    model, _ = load_streaming(ckpt)
    per_slot = sum(b.layer.expert_nbytes for b in model.expert_streaming.cache.banks)
    model.expert_streaming.close()
    given = gb_as_given((per_slot - 1) / 1e9)  # one byte short, with all its digits
    out = streaming("plan", ckpt, "--expert-cache-gb", given, cwd=tmp_path)
    line = one_error_line(out, f"budget of {given} GB is below the minimum")
    minimum = _budget_message_minimum(line)
    assert f"one expert per MoE layer, {gb_at_least(per_slot)} GB for 2 layers" in line, line
    assert float(given) < per_slot / 1e9 <= minimum and gb_at_least(per_slot) != given


def test_the_minimum_plan_prints_is_accepted_back(checkpoint, tmp_path):
    """``plan`` printed ``minimum budget ...: 2.3e-05 GB (--expert-cache-gb 2.31e-05)``, and
    ``--expert-cache-gb 2.3e-05`` was then below the minimum: 3 layers of this model's experts
    are 2.304e-05 GB, which rounds down (issue 45, item 2). And a budget given is said once, not
    ``0.002 GB (given 0.002 GB)`` (item 9)."""
    ckpt = checkpoint("qwen3_moe", num_layers=3)
    out = streaming("plan", ckpt, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("minimum budget")]
    shown, flag = re.fullmatch(
        r"minimum budget, one expert per MoE layer: ([\d.]+) GB \(--expert-cache-gb ([\d.]+)\)",
        line,
    ).groups()
    for value in (shown, flag):
        ok = streaming("plan", ckpt, "--expert-cache-gb", value, cwd=tmp_path)
        assert ok.returncode == 0, ok.stderr
        assert "slots per layer: 1 " in ok.stdout, ok.stdout
        (given,) = [x for x in ok.stdout.splitlines() if x.startswith("expert cache budget")]
        assert given == f"expert cache budget (given): {value} GB", given


# -- checkpoints ---------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncated(ckpt, dst):
    shard = sorted(_copy(ckpt, dst).glob("model-*.safetensors"))[-1]
    os.truncate(shard, shard.stat().st_size // 2)
    return shard


def _garbage_header(ckpt, dst):
    shard = sorted(_copy(ckpt, dst).glob("model-*.safetensors"))[0]
    shard.write_bytes(b"garbage, not a safetensors header")
    return shard


def _missing_shard(ckpt, dst):
    shard = sorted(_copy(ckpt, dst).glob("model-*.safetensors"))[-1]
    shard.unlink()
    return shard.name


def _invalid_config(ckpt, dst):
    config = _copy(ckpt, dst) / "config.json"
    config.write_text("{not json")
    return config


def _missing_config(ckpt, dst):
    config = _copy(ckpt, dst) / "config.json"
    config.unlink()
    return config


def _unknown_model_type(ckpt, dst):
    config = _copy(ckpt, dst) / "config.json"
    data = json.loads(config.read_text())
    data["model_type"] = "no_such_model"
    config.write_text(json.dumps(data))
    return config


DAMAGE = {
    "truncated shard": _truncated,
    "garbage header": _garbage_header,
    "missing shard": _missing_shard,
    "invalid config.json": _invalid_config,
    "missing config.json": _missing_config,
    "unknown model_type": _unknown_model_type,
}
ROUTES = {
    "flag": lambda model, cwd: generate(model, "--streaming-experts", cwd=cwd),
    "env": lambda model, cwd: generate(
        model, env={"MLX_LM_STREAMING_EXPERTS": "1"}, cwd=cwd
    ),
    "plan": lambda model, cwd: streaming("plan", model, cwd=cwd),
    "pack": lambda model, cwd: streaming("pack", model, "--quiet", cwd=cwd),
}


@pytest.fixture(scope="module")
def damaged(ckpt, tmp_path_factory):
    """``damaged(case) -> (model dir, what the error must name)``, built once per case."""
    built = {}

    def get(case):
        if case not in built:
            model = tmp_path_factory.mktemp("damaged") / "model"
            built[case] = (model, DAMAGE[case](ckpt, model))
        return built[case]

    return get


# every case through the flag and our two commands; the environment route shares the flag's code
# once the command line is parsed, so two cases suffice there
CASES = [(case, route) for case in DAMAGE for route in ("flag", "plan", "pack")] + [
    ("truncated shard", "env"),
    ("invalid config.json", "env"),
]


@pytest.mark.parametrize("case, route", CASES)
def test_damaged_checkpoint_names_the_file(case, route, damaged, tmp_path):
    model, named = damaged(case)
    out = ROUTES[route](model, tmp_path)
    line = one_error_line(out, named)
    # the Python API raises our type with the same message
    with pytest.raises(CheckpointError) as info:
        load_streaming(model)
    assert line.endswith(": error: " + one_line(info.value)), line


# config.json that is valid JSON with wrong values (issue 27, item 3): stock mlx-lm raises a
# TypeError, chained tracebacks, or an argpartition error at the first token; plan said nothing
CONFIG_VALUES = {
    "num_experts 'abc'": ({"num_experts": "abc"}, "num_experts is 'abc'"),
    "no num_hidden_layers": ({"num_hidden_layers": None}, "num_hidden_layers is missing"),
    "num_experts 0": ({"num_experts": 0}, "num_experts is 0"),
    "num_experts_per_tok 100": (
        {"num_experts_per_tok": 100},
        "num_experts_per_tok is 100, more than the 8 experts of num_experts",
    ),
}


@pytest.mark.parametrize("route", ["flag", "plan"])
@pytest.mark.parametrize("case", list(CONFIG_VALUES))
def test_a_wrong_config_value_names_the_key_and_the_file(case, route, ckpt, tmp_path):
    change, named = CONFIG_VALUES[case]
    model = _copy(ckpt, tmp_path / "model")
    config = model / "config.json"
    data = json.loads(config.read_text())
    for key, value in change.items():
        data.pop(key) if value is None else data.__setitem__(key, value)
    config.write_text(json.dumps(data))
    out = ROUTES[route](model, tmp_path)
    line = one_error_line(out, config, named)
    assert out.returncode == 1, line
    with pytest.raises(CheckpointError) as info:
        load_streaming(model)
    assert line.endswith(": error: " + one_line(info.value)), line


@pytest.mark.parametrize("route", list(ROUTES))
def test_missing_model_path(route, tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    line = one_error_line(
        ROUTES[route](missing, tmp_path), missing, "no such model directory"
    )
    if route in ("flag", "env"):
        assert "argument --model" in line


@pytest.fixture(scope="module")
def dense(ckpt, tmp_path_factory):
    return build_dense_checkpoint(tmp_path_factory.mktemp("dense"), ckpt)


@pytest.mark.parametrize("command", ["plan", "pack"])
def test_plan_and_pack_refuse_a_dense_model(command, dense, tmp_path):
    out = streaming(
        command, dense, "--quiet" if command == "pack" else "--", cwd=tmp_path
    )
    one_error_line(
        out, f"mlx_lm_streaming {command}: error:", "'llama'", "not a Mixture-of-Experts model"
    )


def test_pack_to_a_missing_directory(ckpt, tmp_path):
    out_file = tmp_path / "missing" / PACK_NAME
    out = streaming("pack", ckpt, "--out", out_file, "--quiet", cwd=tmp_path)
    one_error_line(out, out_file, "no directory")


def test_pack_to_an_unwritable_directory(ckpt, tmp_path):
    if os.geteuid() == 0:
        where = Path("/sys")  # sysfs: not writable, even for root
    else:
        where = tmp_path / "read-only"
        where.mkdir()
        where.chmod(0o555)
    out_file = where / PACK_NAME
    out = streaming("pack", ckpt, "--out", out_file, "--quiet", cwd=tmp_path)
    one_error_line(out, out_file, "writing the pack failed")
    assert not list(where.glob(PACK_NAME + "*"))


def test_packed_store_without_a_pack_says_how_to_make_one(ckpt, tmp_path):
    model = _copy(ckpt, tmp_path / "model")
    (model / PACK_NAME).unlink(missing_ok=True)
    out = generate(
        model, "--streaming-experts", "--expert-store", "packed", cwd=tmp_path
    )
    line = one_error_line(out, model / PACK_NAME, f"`mlx_lm_streaming pack {model}`")
    assert "again" not in line and "--force" not in line


# -- the startup hook ----------------------------------------------------------------------------


def test_hook_off_with_streaming_asked_by_environment_says_so(ckpt, tmp_path):
    env = {"MLX_LM_STREAMING_HOOK": "0", "MLX_LM_STREAMING_EXPERTS": "1"}
    out = generate(ckpt, env=env, cwd=tmp_path)
    # nothing of ours runs in mlx-lm, so it loads stock (every expert): the one line says so first
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for name in (
        "MLX_LM_STREAMING_EXPERTS=1",
        "MLX_LM_STREAMING_HOOK=0",
        "every expert",
        # the documented name (docs/usage.md), which is there to call (issue 45, item 5)
        "call mlx_lm_streaming.integration.install() before loading",
    ):
        assert name in lines[0]
    assert callable(mlx_lm_streaming.integration.install)


def test_hook_off_without_streaming_is_silent(ckpt, tmp_path):
    for env in (
        {"MLX_LM_STREAMING_HOOK": "0"},
        {"MLX_LM_STREAMING_HOOK": "0", "MLX_LM_STREAMING_EXPERTS": "0"},
    ):
        out = run_cli(
            [sys.executable, "-c", "import mlx_lm_streaming"],
            tmp_path,
            clean_env(**env),
        )
        assert out.returncode == 0 and out.stderr == "", out.stderr


def _explained_unknown_flag(out, *names):
    """Stock argparse rejects the flag (usage, then its error); our one line comes first, saying why."""
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "unrecognized arguments: --streaming-experts" in out.stderr
    ours = [l for l in out.stderr.splitlines() if l.startswith("mlx-lm-streaming:")]
    assert len(ours) == 1, out.stderr
    for name in names:
        assert name in ours[0], ours[0]


def test_flag_with_hook_off_says_why_it_is_unknown(ckpt, tmp_path):
    out = generate(
        ckpt, "--streaming-experts", env={"MLX_LM_STREAMING_HOOK": "0"}, cwd=tmp_path
    )
    _explained_unknown_flag(out, "--streaming-experts", "MLX_LM_STREAMING_HOOK=0")


def test_flag_with_deprecated_python_m_form_says_why_it_is_unknown(ckpt, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "mlx_lm.generate",
        "--model",
        ckpt,
        "--streaming-experts",
    ]
    out = run_cli(cmd, tmp_path)
    _explained_unknown_flag(
        out, "python -m mlx_lm.generate", "python -m mlx_lm generate"
    )


# -- plugins -------------------------------------------------------------------------------------


def test_a_misspelt_variable_is_named_once_though_the_run_is_stock(ckpt, tmp_path):
    # MLX_LM_STREAMING_EXPERT=1 (the S missing) ran stock without a word: on a 16 GB Mac, every
    # expert loaded (issue 27, item 2)
    out = generate(ckpt, env={"MLX_LM_STREAMING_EXPERT": "1"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "mlx-lm-streaming" in line]
    assert said == [
        "mlx-lm-streaming: warning: unknown variable MLX_LM_STREAMING_EXPERT (did you mean "
        "MLX_LM_STREAMING_EXPERTS?): ignored, this model loads without streaming experts"
    ], out.stderr
    assert "[streaming]" not in out.stderr


def _blocked_plugin(root: Path) -> Path:
    """An installed distribution (on PYTHONPATH) whose plugin registers the store ``blocked_store``."""
    root.mkdir()
    (root / "blockme_plugin_for_test.py").write_text(
        "from mlx_lm_streaming.hookspecs import hookimpl\n\n\n@hookimpl\n"
        "def register_stores(register):\n"
        "    from mlx_lm_streaming.stores.memory import MemoryStore\n\n"
        "    register('blocked_store', MemoryStore)\n"
    )
    info = root / "blockme_plugin_for_test-0.1.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(
        "Metadata-Version: 2.1\nName: blockme-plugin-for-test\nVersion: 0.1\n"
    )
    info.joinpath("entry_points.txt").write_text(
        "[mlx_lm_streaming]\nblockme = blockme_plugin_for_test\n"
    )
    return root


@pytest.mark.parametrize("route", ["flag", "env"])
def test_blocked_plugin_is_reported_as_blocked(route, ckpt, tmp_path):
    env = {"PYTHONPATH": str(_blocked_plugin(tmp_path / "site"))}
    if route == "flag":
        flags = ["--streaming-experts", "--expert-store", "blocked_store"]
    else:
        flags = []
        env.update(MLX_LM_STREAMING_EXPERTS="1", MLX_LM_STREAMING_STORE="blocked_store")
    if route == "flag":
        # not blocked, the plugin's store loads and runs
        out = generate(ckpt, *flags, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
    env["MLX_LM_STREAMING_BLOCK_PLUGINS"] = "blockme"
    line = one_error_line(
        generate(ckpt, *flags, env=env, cwd=tmp_path),
        "'blocked_store'",
        "blockme",
        "blocked by MLX_LM_STREAMING_BLOCK_PLUGINS='blockme'",
    )
    assert "unknown" not in line


# -- our own command -----------------------------------------------------------------------------


def test_info_into_a_closed_pipe_prints_no_traceback(tmp_path):
    proc = subprocess.Popen(
        [str(BIN / "mlx_lm_streaming"), "info"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().startswith("mlx-lm-streaming ")
    proc.stdout.close()  # like `| head -1`
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_stats_line_before_any_request_has_no_nan(ckpt):
    model, _ = load_streaming(ckpt)
    line = model.expert_streaming.stats_line()
    assert "nan" not in line and "hit rate n/a," in line, line
    model.expert_streaming.close()


def test_load_takes_store_options(ckpt):
    model, _ = mlx_lm_streaming.load(str(ckpt), store_options={"threads": 2})
    assert model.expert_streaming.store.threads == 2
    assert model.expert_streaming.options.store_options == {"threads": 2}
    model.expert_streaming.close()
