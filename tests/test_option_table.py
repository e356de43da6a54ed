"""One table of options drives every entry point (issue 21 item 4, issue 23).

``option_table.OPTIONS`` makes the mlx-lm commands' flags, the environment variables, the
``model_config["streaming_experts"]`` keys and ``mlx_lm_streaming.load``'s keywords. These tests check
that nothing keeps a list of its own (the startup hook, the ``.pth`` line, ``mlx_compat``), and walk
every row through all four entry points on a real model.
"""

import argparse
import ast
import os
import signal
from dataclasses import fields
from pathlib import Path

import mlx_lm
import pytest
from support import held_out_env

import mlx_lm_streaming
from mlx_lm_streaming import _bootstrap, option_table, plugins
from mlx_lm_streaming.errors import ConfigurationError
from mlx_lm_streaming.integration import cli
from mlx_lm_streaming.runtime import mlx_compat
from mlx_lm_streaming.runtime.memory import report
from mlx_lm_streaming.runtime.options import ENV, StreamingOptions, requested

REPO = Path(__file__).resolve().parent.parent
OPTIONS = [o for o in option_table.OPTIONS if o.name != "enabled"]


# -- every list is the table's ---------------------------------------------------------------------


def test_startup_hook_knows_the_tables_flags_variables_and_words():
    assert _bootstrap.STREAMING_FLAGS == option_table.FLAGS
    assert _bootstrap.EXPERTS_ENV == option_table.ENABLED.env
    assert _bootstrap.HOOK_ENV == option_table.HOOK_ENV
    assert mlx_compat.CLI_MODULES is _bootstrap.CLI_MODULES
    assert _bootstrap.PATCHED == {"mlx_lm.utils", *_bootstrap.CLI_MODULES}
    assert plugins.BLOCK_ENV in option_table.OTHER_ENV


def test_the_pth_line_uses_the_tables_off_words_and_names():
    """The ``.pth`` line cannot import anything before it decides to: its literals must be the
    table's."""
    line = [
        raw
        for raw in (REPO / "hooks" / "mlx_lm_streaming.pth").read_text().splitlines()
        if raw.startswith("import ")
    ][0]
    literals = [n.value for n in ast.walk(ast.parse(line)) if isinstance(n, ast.Constant)]
    tuples = [
        tuple(e.value for e in n.elts)
        for n in ast.walk(ast.parse(line))
        if isinstance(n, ast.Tuple) and all(isinstance(e, ast.Constant) for e in n.elts)
    ]
    assert option_table.OFF_WORDS in tuples
    assert option_table.HOOK_ENV in literals and option_table.ENABLED.env in literals
    assert option_table.ENABLED.flag in literals


def test_options_flags_keys_and_keywords_are_the_tables():
    names = [o.name for o in OPTIONS]
    public = [f.name for f in fields(StreamingOptions) if not f.metadata.get("internal")]
    assert sorted(public) == sorted(names)
    assert ENV == {o.name: o.env for o in option_table.OPTIONS}
    parser = argparse.ArgumentParser()
    cli.add_streaming_arguments(parser)
    flags = [s for a in parser._actions for s in a.option_strings if s != "-h" and s != "--help"]
    assert flags == list(option_table.FLAGS)
    for option in option_table.OPTIONS:
        assert option.flag or option.why_no_flag, f"{option.name}: no flag and no reason"
        assert option.env.startswith(option_table.PREFIX)


# -- walking the table through the four entry points -----------------------------------------------


@pytest.fixture(scope="module")
def pack_of_q3(q3_path, tmp_path_factory):
    from mlx_lm_streaming.tools.pack import pack_checkpoint

    return pack_checkpoint(q3_path, tmp_path_factory.mktemp("pack") / "q3.pack", progress=False)


def cases(tmp_path, pack):
    """option name -> (the text a flag or variable gives, what the option reads back as)."""
    return {
        "expert_cache_gb": ("0.0123", 0.0123),
        "expert_cache_fixed": ("1", True),
        # (0: no host tier, the one value the CPU takes; others are refused off mlx-cuda)
        "expert_host_gb": ("0", 0.0),
        "store": ("memory", "memory"),
        "store_options": ("threads=3", {"threads": 3}),
        "kernel": ("gather", "gather"),
        "cache_policy": ("lru", "lru"),
        "direct_reads": ("off", False),
        "layer_major_prefill": ("on", True),
        "stats": ("layers", "layers"),
        "verbose": ("1", True),
        "record_routing": (str(tmp_path / "r.jsonl"), str(tmp_path / "r.jsonl")),
        "trace": (str(tmp_path / "t.json"), str(tmp_path / "t.json")),
        "pack": (str(pack), str(pack)),
        "if_unstreamable": ("whole", "whole"),
    }


def test_the_cases_cover_every_option(tmp_path):
    assert set(cases(tmp_path, "p")) == {o.name for o in OPTIONS}


def _flag_to_environment(option, text, model):
    """What a command does with the flag: parse it, check it, export it as the variable."""
    parser = argparse.ArgumentParser(prog="cmd")
    parser.add_argument("--model")
    cli.add_streaming_arguments(parser)
    argv = ["--model", str(model), "--streaming-experts", option.flag]
    # a flag without a value (``metavar`` None) or whose value may be left out stands for "1"
    bare = option.metavar is None or option.metavar == "?" and text in ("1", True)
    argv += [] if bare else [text]
    namespace = parser.parse_args(argv)
    environ = {}
    said, sigterm = report.cli_streaming, signal.getsignal(signal.SIGTERM)
    try:
        cli.export_streaming_arguments(parser, namespace, environ)
    finally:
        report.cli_streaming = said
        signal.signal(signal.SIGTERM, sigterm)
    return environ


@pytest.mark.parametrize("name", [o.name for o in OPTIONS])
def test_every_option_works_from_all_four_entry_points(q3_path, pack_of_q3, tmp_path, name):
    option = option_table.BY_NAME[name]
    text, want = cases(tmp_path, pack_of_q3)[name]
    got = {}
    with held_out_env():
        # 1. model_config key (text, as the environment would give it, and the value itself)
        config = {"streaming_experts": {name: want}}
        model, _ = mlx_lm.utils.load_model(q3_path, model_config=config)
        got["model_config"] = model.expert_streaming
        # 2. mlx_lm_streaming.load keyword
        model, _ = mlx_lm_streaming.load(str(q3_path), **{name: want})
        got["load"] = model.expert_streaming
        # 3. the environment variable, through mlx_lm.load
        os.environ.update({option_table.ENABLED.env: "1", option.env: text})
        try:
            model, _ = mlx_lm.load(str(q3_path))
        finally:
            del os.environ[option_table.ENABLED.env], os.environ[option.env]
        got["environment"] = model.expert_streaming
        # 4. the flag of the mlx-lm commands: it sets the variable, which the load reads
        if option.flag is None:
            assert option.why_no_flag
            return _check(got, name, want)
        environ = _flag_to_environment(option, text, q3_path)
        assert environ[option.env] in (text, str(want))
        os.environ.update(environ)
        try:
            model, _ = mlx_lm.load(str(q3_path))
        finally:
            for key in environ:
                del os.environ[key]
        got["flag"] = model.expert_streaming
    _check(got, name, want)


def _check(got, name, want):
    for where, state in got.items():
        assert getattr(state.options, name) == want, (where, state.options)
        if name == "store_options":
            assert state.store.name == "safetensors" and state.store.threads == 3, where
        if name == "pack":
            assert state.store.name == "packed" and state.store.pack.path == Path(want), where
        if name == "expert_cache_fixed":
            assert not state.cache.follow_memory, where  # (off: the budget follows free memory)
        if name == "expert_cache_gb":
            assert state.cache.given_bytes == 12_300_000, where  # decimal GB
        state.close()


def test_the_environment_applies_to_mlx_lm_streaming_load_and_a_keyword_wins(q3_path, environ):
    environ[ENV["cache_policy"]] = "lru"
    environ[ENV["kernel"]] = "gather"
    model, _ = mlx_lm_streaming.load(str(q3_path), kernel="per_expert")
    options = model.expert_streaming.options
    assert options.cache_policy == "lru"  # from the variable
    assert options.kernel == "per_expert"  # the keyword wins
    model.expert_streaming.close()
    # a model_config dict too
    assert requested({"streaming_experts": {"kernel": "auto"}}).cache_policy == "lru"
    # but False stays off
    assert requested({"streaming_experts": False}) is None


# -- unknown names are one-line errors, wherever they are given ------------------------------------


def test_unknown_names_are_one_line_errors(q3_path, environ):
    unknown = r"unknown streaming_experts option\(s\) \['cache_gb'\]"
    with pytest.raises(ConfigurationError, match=unknown):
        requested({"streaming_experts": {"cache_gb": 1}})
    with pytest.raises(ConfigurationError, match="unknown keyword 'cache_gb'"):
        mlx_lm_streaming.load(str(q3_path), cache_gb=1)
    environ["MLX_LM_STREAMING_CACHE_GIB"] = "4"
    with pytest.raises(ConfigurationError, match="unknown variable MLX_LM_STREAMING_CACHE_GIB"):
        requested({"streaming_experts": True})
    del environ["MLX_LM_STREAMING_CACHE_GIB"]
    for given in (
        {"store_options": {"thread": 2}},
        {"store_options": "thread=2"},
        {"store": "memory", "store_options": {"threads": 2}},
    ):
        with pytest.raises(ConfigurationError, match="has no option 'thread"):
            mlx_lm_streaming.load(str(q3_path), **given)
    environ[ENV["enabled"]] = "1"
    environ[ENV["store_options"]] = "treads=2"
    with pytest.raises(ConfigurationError, match="safetensors store has no option 'treads'"):
        mlx_lm.load(str(q3_path))


def test_an_unknown_store_option_flag_is_one_line(q3_path, capsys):
    parser = argparse.ArgumentParser(prog="cmd")
    cli.add_streaming_arguments(parser)
    namespace = parser.parse_args(["--streaming-experts", "--expert-store-options", "treads=2"])
    with pytest.raises(SystemExit) as exit:
        cli.export_streaming_arguments(parser, namespace, {})
    assert exit.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("cmd: error: argument --expert-store-options: ") and "'treads'" in line


def test_a_store_declares_its_options():
    from mlx_lm_streaming.stores.memory import MemoryStore
    from mlx_lm_streaming.stores.packed import PackedStore
    from mlx_lm_streaming.stores.safetensors import SafetensorsStore

    assert plugins.store_option_names(SafetensorsStore) == {"threads", "direct"}
    assert plugins.store_option_names(PackedStore) == {"path", "direct", "verify", "threads"}
    assert plugins.store_option_names(MemoryStore) == set()

    class Declared(MemoryStore):
        known_options = ("depth",)

    assert plugins.store_option_names(Declared) == {"depth"}


def test_the_budget_help_gives_the_default_shares_the_code_uses():
    # the help once said half of the free memory where CUDA's default is 80% of the GPU's
    from mlx_lm_streaming.runtime.memory import machine as memory

    option = next(o for o in option_table.OPTIONS if o.name == "expert_cache_gb")
    words = " ".join(option.help.split())
    for share in (memory.DEFAULT_CACHE_SHARE, memory.CUDA_CACHE_SHARE):
        assert f"{share:.0%} of the" in words, (share, words)
    assert "on CUDA" in words
