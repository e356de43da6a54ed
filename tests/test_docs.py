"""The docs say what the code does: every hook, flag, variable and key is documented, the plugin
examples in docs/plugins.md run, and the README's commands exist."""

import fnmatch
import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_lm_streaming import hookspecs, plugins
from mlx_lm_streaming import option_table
from mlx_lm_streaming.integration import cli
from mlx_lm_streaming.runtime.options import ENV, StreamingOptions

ROOT = Path(__file__).resolve().parents[1]
PLUGINS_MD = (ROOT / "docs" / "plugins.md").read_text()
USAGE_MD = (ROOT / "docs" / "usage.md").read_text()
README = (ROOT / "README.md").read_text()


def hookspec_names():
    marker = hookspecs.hookspec.project_name + "_spec"
    return [
        name
        for name, f in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(f, marker)
    ]


def test_every_hookspec_is_documented():
    names = hookspec_names()
    assert names, "no hookspecs found"
    for name in names:
        assert (
            f"### `{name}`" in PLUGINS_MD
        ), f"docs/plugins.md has no section for {name}"
    # and no section for a hook that does not exist
    documented = re.findall(r"^### `(register_\w+)`", PLUGINS_MD, re.M)
    assert sorted(documented) == sorted(names)


def test_every_flag_variable_and_key_is_documented():
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_streaming_arguments(parser)
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    flags.remove("--help")
    assert flags == list(option_table.FLAGS)
    for flag in flags:
        assert f"`{flag}" in USAGE_MD, f"docs/usage.md does not document {flag}"
    for var in list(ENV.values()) + ["MLX_LM_STREAMING_HOOK", plugins.BLOCK_ENV]:
        assert f"`{var}" in USAGE_MD, f"docs/usage.md does not document {var}"
    public = [f.name for f in fields(StreamingOptions) if not f.metadata.get("internal")]
    for key in public + ["enabled"]:
        assert f"`{key}`" in USAGE_MD, f"docs/usage.md does not document the key {key}"
    for module in option_table.CLI_MODULES:
        assert f"`{module}`" in USAGE_MD, f"docs/usage.md does not list {module}"


def example_modules(tmp_path):
    """The complete plugin examples of docs/plugins.md (blocks opening with ``# name.py``)."""
    blocks = re.findall(r"```python\n# (\w+)\.py\n(.*?)```", PLUGINS_MD, re.S)
    assert {name for name, _ in blocks} == {"pread_store", "dequantized_kernel"}
    for name, code in blocks:
        (tmp_path / f"{name}.py").write_text(code)
    sys.path.insert(0, str(tmp_path))
    try:
        return {name: importlib.import_module(name) for name, _ in blocks}
    finally:
        sys.path.remove(str(tmp_path))


@pytest.fixture
def registered_examples(tmp_path):
    modules = example_modules(tmp_path)
    pm = plugins.load_plugins()
    for name, module in modules.items():
        pm.register(module, name=f"docs-{name}")
    try:
        yield modules
    finally:
        for module in modules.values():
            pm.unregister(module)
        for name in modules:
            sys.modules.pop(name, None)


def test_plugin_examples_run(checkpoint, registered_examples):
    from support import load_stock, load_streaming

    tokens = mx.array([list(range(1, 70))])  # >= 64 indices: the sorted path in stock
    for variant in ("affine4", "mixed"):
        path = checkpoint("qwen3_moe", variant)
        stock, _ = load_stock(path)
        expected = stock(tokens)
        probe, _ = load_streaming(path)
        one_slot = sum(
            b.layer.expert_nbytes for b in probe.expert_streaming.cache.banks
        )
        probe.expert_streaming.close()
        budget = 3 * one_slot / 1e9  # 3 of 8 experts per layer: evictions
        model, _ = load_streaming(path, store="pread", expert_cache_gb=budget)
        assert type(model.expert_streaming.store).__name__ == "PreadStore"
        assert mx.array_equal(model(tokens), expected).item()
        assert model.expert_streaming.stats()["experts_read"] > 0
        model.expert_streaming.close()
        model, _ = load_streaming(path, kernel="dequantized", expert_cache_gb=budget)
        with pytest.warns(UserWarning, match="not bit-identical"):
            got = model(tokens)
        assert mx.allclose(got, expected, atol=1e-3).item()


def test_readme_has_the_two_commands_and_the_mac_line():
    block = re.search(r"```\n(bash docs/demo\.sh\nbash tests/run\.sh\n)```", README)
    assert block, "README must show exactly the demo and test commands in one block"
    assert "pip install mlx-lm-streaming" in README
    assert (
        "'mlx-lm-streaming[cpu]'" in README and "'mlx-lm-streaming[cuda13]'" in README
    )
    assert re.search(
        r"mlx_lm\.generate --model mlx-community/\S+ .*--streaming-experts", README
    )
    # until the package is published, the lines that work: from a checkout, with every extra
    # they name declared in pyproject.toml (a name an index does not have fails in pip)
    extras = re.findall(r"^pip install '\.\[(\w+)\]'", README, re.M)
    assert {"cpu", "cuda13"} <= set(extras), extras
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r"\[project\.optional-dependencies\]\n(.*?)\n\[", pyproject, re.S).group(1)
    assert all(re.search(rf"^{e} = ", declared, re.M) for e in extras), extras
    assert "not on PyPI yet" in README
    assert os.access(ROOT / "docs" / "demo.sh", os.X_OK)
    assert "bash tests/run.sh" in (ROOT / ".ci" / "run").read_text()
    demo = (ROOT / "docs" / "demo.sh").read_text()
    assert "MODEL=docs/demo-model" in demo  # the trained model committed to the repo
    assert (ROOT / "docs" / "demo-model" / "config.json").is_file()
    assert "--streaming-experts" in demo and "--streaming-stats" in demo


def test_docs_links_exist():
    for doc in [README, USAGE_MD, PLUGINS_MD]:
        for target in re.findall(r"\]\(((?:docs/)?[\w/]+\.md)\)", doc):
            path = (
                ROOT / target if target.startswith("docs/") else ROOT / "docs" / target
            )
            assert path.is_file(), f"broken link to {target}"


def test_the_tiny_checkpoint_section_runs(tmp_path):
    # docs/plugins.md: build a synthetic checkpoint, then stream it with a store; every architecture
    # and variant the module builds is named there
    from support import held_out_env

    import synthetic

    section = PLUGINS_MD.split("## Trying a plugin on a tiny checkpoint")[1].split("\n## ")[0]
    for name in list(synthetic.ARCHITECTURES) + list(synthetic.VARIANTS):
        assert re.search(rf"\b{name}\b", section), f"docs/plugins.md does not name {name}"
    build, generate = re.search(r"```sh\n(.*?)```", section, re.S).group(1).strip().splitlines()
    assert build.startswith("python -m synthetic ck ")
    assert generate.startswith("mlx_lm.generate --model ck ") and "my_store" in generate
    generate = generate.replace("mlx_lm.generate", "python -m mlx_lm generate")
    generate = generate.replace("my_store", "safetensors")  # a store every install has
    with held_out_env():
        # the builder is not in the wheel: it runs with the checkout on the path
        for line, env in ((build, {"PYTHONPATH": str(ROOT)}), (generate, {})):
            argv = [sys.executable] + shlex.split(line)[1:]
            done = subprocess.run(
                argv, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "ck" / "config.json").is_file()
    stats = re.search(r"^\[streaming\] hit rate .*experts read (\d+)", done.stderr, re.M)
    assert stats and int(stats.group(1)) > 0, done.stderr[-2000:]


# the files that point readers into docs/benchmarks/ by name: each name must be a file there
LINKING = [
    "README.md",
    "docs/plugins.md",
    "docs/routing.md",
    "docs/distributed.md",
    "docs/design.md",
    "docs/history.md",
    "docs/usage.md",
    "bench",
    "mlx_lm_streaming",
]


def test_benchmark_pages_hold_only_indexed_runs_and_their_links_resolve():
    bench_readme = ROOT / "docs" / "benchmarks" / "README.md"
    text = bench_readme.read_text()
    # a benchmark page linked from the README or from a page of docs/ indexes its own runs
    linking = (text + "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))).replace(
        "benchmarks/", ""
    )
    pages = {"README.md"}
    for page in bench_readme.parent.glob("*.md"):
        if page.name != "README.md" and f"({page.name})" in linking:
            pages.add(page.name)
            text += page.read_text()
    for f in bench_readme.parent.iterdir():
        assert f.name in pages or f"`{f.name}`" in text or f"({f.name})" in text, (
            f"docs/benchmarks/{f.name} is no run the README names: remove it or index it"
        )
    for page in (bench_readme, ROOT / "bench" / "README.md"):
        for target in re.findall(r"\]\(([^)#\s]+)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page}: broken link to {target}"
    for name in LINKING:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
        for f in files:
            for target in re.findall(r"docs/benchmarks/([\w.-]+\.\w+)", f.read_text()):
                assert (ROOT / "docs" / "benchmarks" / target).is_file(), f"{f}: {target}"


def test_every_page_counts_the_same_ways_to_ask_for_streaming():
    """Flags, environment variables, ``model_config`` keys and ``mlx_lm_streaming.load`` keywords:
    every page that counts the ways says four, and usage.md's table has a row for each."""
    design = (ROOT / "docs" / "design.md").read_text()
    for name, text in (("README.md", README), ("usage.md", USAGE_MD), ("design.md", design)):
        counts = set(re.findall(r"\b(one|two|three|four|five|six) ways\b", text, re.I))
        assert {c.lower() for c in counts} == {"four"}, (name, counts)
    table = USAGE_MD.split("| where | how |", 1)[1].split("\n\n", 1)[0]
    assert len(re.findall(r"^\| ", table, re.M)) == 4, table


def test_benchmark_expert_sizes_are_decimal():
    """The benchmark page's shapes table gives one expert's and all experts' sizes in decimal MB and
    GB, as computed from the shape (affine 4-bit, group 64, float32 scales and biases)."""
    page = (ROOT / "docs" / "benchmarks" / "README.md").read_text()
    lines = re.findall(r"^\| [\w.-]+ \| hidden .*$", page, re.M)
    assert len(lines) == 5, lines
    for line in lines:
        cells = line.split("|")
        shape = re.search(r"hidden (\d+), \w+ (\d+), (\d+)", cells[2])
        hidden, inter, experts = map(int, shape.groups())
        layers = int(re.match(r"\s*(\d+)", cells[3]).group(1))
        expert = 3 * (hidden * inter // 2 + 2 * 4 * hidden * inter // 64)
        assert f"{expert / 1e6:.3g} MB" in cells[4], (line, expert)
        assert f"{layers * experts * expert / 1e9:.3g} GB" in cells[5], (line, expert)


def test_the_startup_cost_usage_states_is_what_the_bench_checks():
    # usage.md gives the hook's cost as bench/startup.py measures it, and its --check limit as the
    # script's (it once said "well under a millisecond" where the script measured +2.6 ms)
    hook = USAGE_MD[USAGE_MD.index("## The startup hook") :]
    hook = hook[: hook.index("\n## ", 1)]
    assert "well under" not in hook
    limit = re.search(r"LIMIT_MS = ([\d.]+)", (ROOT / "bench" / "startup.py").read_text()).group(1)
    stated = f"`python bench/startup.py --check` fails at {float(limit):g} ms"
    assert stated in " ".join(hook.split())
    assert "-X importtime" in hook and "python -c pass" in hook


def _defined_names():
    """``(modules, classes)``: per module of the package (by its name, a package's by its folder's)
    the names it defines or imports at its top; per class, its methods and attributes."""
    import ast

    modules, classes = {}, {}
    for path in (ROOT / "mlx_lm_streaming").rglob("*.py"):
        tree = ast.parse(path.read_text())
        stem = path.parent.name if path.stem == "__init__" else path.stem
        names = modules.setdefault(stem, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            attrs = classes.setdefault(node.name, set())
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    attrs.add(sub.name)
                elif isinstance(sub, ast.Attribute) and getattr(sub.value, "id", "") == "self":
                    attrs.add(sub.attr)
                elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                    attrs.add(sub.target.id)
                elif isinstance(sub, ast.Assign):
                    attrs.update(n.id for t in sub.targets for n in ast.walk(t)
                                 if isinstance(n, ast.Name))  # fmt: skip
    return modules, classes


def test_the_packages_docstrings_name_what_exists():
    # ``module.name`` and ``Class.name`` in the package's docstrings and comments name something
    # that module or class defines (``name_*``: a family, at least two), and ``module.py`` a
    # module: such references went stale when code moved (``mlx_compat.switch_glu_*``,
    # ``ExpertCache.lookahead_min_precision``, ``loading.check_budget``)
    modules, classes = _defined_names()
    stale = []
    for path in sorted((ROOT / "mlx_lm_streaming").rglob("*.py")):
        text = path.read_text()
        for m in re.finditer(r"``(\w+)\.(\w+\*?)``", text):
            owner, name = m.groups()
            if owner == "mlx_lm_streaming":  # the hook files, mlx_lm_streaming.pth / .start
                continue
            if name == "py":
                ok = owner in modules
            elif owner in modules or owner in classes:
                pool = modules.get(owner, set()) | classes.get(owner, set())
                if owner == "bank":  # a LayerBank, by the name the code gives one
                    pool |= classes["LayerBank"]
                if name.endswith("*"):
                    ok = sum(n.startswith(name[:-1]) for n in pool) >= 2
                else:
                    ok = name in pool or name in modules
            else:
                continue
            if not ok:
                line = text[: m.start()].count("\n") + 1
                stale.append(f"{path.relative_to(ROOT)}:{line}: ``{owner}.{name}``")
    assert not stale, "references to names that do not exist there:\n" + "\n".join(stale)


def test_the_benchmark_index_names_only_files_that_are_there():
    # docs/benchmarks/README.md's table of runs: every file it names (a glob for several) is there,
    # and every file there is named (above); retired runs leave the folder and the table together
    page = (ROOT / "docs" / "benchmarks" / "README.md").read_text()
    table = page.split("| file | run |", 1)[1].split("\n\n", 1)[0]
    there = {p.name for p in (ROOT / "docs" / "benchmarks").iterdir()}
    rows = re.findall(r"^\| (.*?) \|", table, re.M)
    named = [n for row in rows for n in re.findall(r"`([^`]+)`", row)]
    assert named
    missing = [n for n in named if not fnmatch.filter(there, n)]
    assert not missing, f"docs/benchmarks/README.md indexes runs that are not there: {missing}"


def test_the_files_pyproject_names_are_there():
    # pyproject.toml's comments said why each extra is needed by naming the files that need it;
    # one named bench/experts.py long after it was retired (issue 45, item 14)
    text = (ROOT / "pyproject.toml").read_text()
    named = re.findall(r"\b((?:bench|tests|docs|mlx_lm_streaming|hooks)/[\w/.-]+\.\w+)", text)
    assert named
    missing = [n for n in named if not (ROOT / n).exists()]
    assert not missing, f"pyproject.toml names files that are not there: {missing}"


def _fields(line: str) -> str:
    # a stats line's words without its figures or the parts only some runs print (the split of
    # background reads, the tiers, a host cache)
    line = re.sub(r" \([^()]*(?:in the background|tiers|host cache)[^()]*\)", "", line)
    return re.sub(r"\d[\d.]*%?", "N", line)


def test_the_readme_shows_the_stats_line_the_demo_prints(tmp_path):
    """README's sample stats line lacked fields printed then (issue 45, item 14); after the demo,
    neither it nor the README said how to run the commands it names (item 11)."""
    sample = re.search(r"^\[streaming\] hit rate .*$", README, re.M).group(0)
    demo = (ROOT / "docs" / "demo.sh").read_text()
    budget = re.search(r"^BUDGET=(\S+)", demo, re.M).group(1)
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "mlx_lm.generate"), "--model", str(ROOT / "docs" / "demo-model")]
    cmd += ["--prompt", "The", "--max-tokens", "64", "--temp", "0", "--streaming-experts"]
    cmd += ["--expert-cache-gb", budget, "--streaming-stats"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_LM_STREAMING_")}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("[streaming] hit rate")]
    assert _fields(sample) == _fields(line), (sample, line)
    assert "source .venv/bin/activate" in demo and "source .venv/bin/activate" in README
