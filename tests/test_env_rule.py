"""One rule for the environment variables (issue 37, item 8).

``MLX_LM_STREAMING_EXPERTS=0 MLX_LM_STREAMING_CACHE_GB=1`` passed silently while the same with
EXPERTS unset was an error; ``MLX_LM_STREAMING_EXPERTS=2`` said "use 1 or 0" though ``yes`` is
taken; ``MLX_LM_STREAMNG_EXPERTS=1`` (a typo inside the prefix) was ignored without a word.
"""

import pytest
from support import clean_env, generate_cmd, one_error_line, run_cli

from mlx_lm_streaming.errors import ConfigurationError
from mlx_lm_streaming.option_table import OFF_WORDS, ON_WORDS
from mlx_lm_streaming.runtime.options import (
    StreamingOptions,
    environment_options,
    streaming_asked_by_environment,
    unknown_variables,
)

pytestmark = pytest.mark.usefixtures("require_hook")


@pytest.mark.parametrize("experts", [None, "", "0", "off", "No"])
def test_an_option_variable_needs_streaming_on_whether_experts_is_unset_or_off(experts):
    environ = {"MLX_LM_STREAMING_CACHE_GB": "1"}
    if experts is not None:
        environ["MLX_LM_STREAMING_EXPERTS"] = experts
    with pytest.raises(ConfigurationError) as e:
        streaming_asked_by_environment(environ)
    assert "MLX_LM_STREAMING_CACHE_GB needs MLX_LM_STREAMING_EXPERTS=1" in str(e.value)
    # and off without options is off, without a word
    assert streaming_asked_by_environment({"MLX_LM_STREAMING_EXPERTS": experts or ""}) is False


def test_experts_off_beside_an_option_is_refused_by_the_command(checkpoint, tmp_path):
    env = clean_env(MLX_LM_STREAMING_EXPERTS="0", MLX_LM_STREAMING_CACHE_GB="1")
    out = run_cli(generate_cmd(checkpoint("qwen3_moe")), tmp_path, env=env)
    line = one_error_line(
        out, "MLX_LM_STREAMING_CACHE_GB needs MLX_LM_STREAMING_EXPERTS=1", "(it is '0')"
    )
    assert out.returncode == 2, line


def _names_every_spelling(message: str, *extra) -> None:
    for word in ON_WORDS + OFF_WORDS + extra:
        assert f" {word}" in message, (word, message)


def test_a_bad_experts_value_lists_every_spelling_it_takes():
    with pytest.raises(ConfigurationError) as e:
        streaming_asked_by_environment({"MLX_LM_STREAMING_EXPERTS": "2"})
    assert str(e.value).startswith("MLX_LM_STREAMING_EXPERTS='2': use ")
    _names_every_spelling(str(e.value))
    for word in ON_WORDS + OFF_WORDS:  # and each of them is taken
        assert streaming_asked_by_environment({"MLX_LM_STREAMING_EXPERTS": word.upper()}) is (
            word in ON_WORDS
        )


@pytest.mark.parametrize(
    "variable, extra",
    [
        ("MLX_LM_STREAMING_STATS", ("layers",)),
        ("MLX_LM_STREAMING_VERBOSE", ()),
        ("MLX_LM_STREAMING_DIRECT_READS", ("auto",)),
        ("MLX_LM_STREAMING_LAYER_MAJOR_PREFILL", ("auto",)),
    ],
)
def test_every_yes_no_variable_lists_every_spelling_it_takes(variable, extra):
    with pytest.raises(ConfigurationError) as e:
        environment_options({"MLX_LM_STREAMING_EXPERTS": "1", variable: "maybe"})
    assert str(e.value).startswith(f"{variable}='maybe': ")
    _names_every_spelling(str(e.value), *extra)
    for word in ON_WORDS + OFF_WORDS + extra:
        environment_options({"MLX_LM_STREAMING_EXPERTS": "1", variable: word})


def test_a_bad_switch_in_python_lists_every_spelling():
    with pytest.raises(ConfigurationError) as e:
        StreamingOptions(verbose="maybe")
    _names_every_spelling(str(e.value))


@pytest.mark.parametrize(
    "name",
    [
        "MLX_LM_STREAMNG_EXPERTS",  # a letter missing inside the prefix
        "MLXLM_STREAMING_EXPERTS",
        "MLX_LM_STREAM_EXPERTS",
        "mlx_lm_streaming_experts",  # the case
    ],
)
def test_a_near_miss_of_the_prefix_is_unknown_like_a_misspelt_option(name):
    assert unknown_variables({name: "1", "MLX_METAL_DEBUG": "1", "MLX_LM_DATA": "x"}) == [name]
    with pytest.raises(ConfigurationError) as e:
        environment_options({"MLX_LM_STREAMING_EXPERTS": "1", name: "1"})
    assert f"unknown variable {name} (did you mean MLX_LM_STREAMING_EXPERTS?)" in str(e.value)


def test_a_near_miss_of_the_prefix_is_named_though_the_run_is_stock(checkpoint, tmp_path):
    env = clean_env(MLX_LM_STREAMNG_EXPERTS="1")
    out = run_cli(generate_cmd(checkpoint("qwen3_moe")), tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "mlx-lm-streaming" in line]
    assert said == [
        "mlx-lm-streaming: warning: unknown variable MLX_LM_STREAMNG_EXPERTS (did you mean "
        "MLX_LM_STREAMING_EXPERTS?): ignored, this model loads without streaming experts"
    ], out.stderr
