"""Move mlx_lm_streaming's loose modules into wing folders (issue 31, item 1): one run, from the repo root.

    python dev/wings.py --check    # what would move, what is skipped or unknown; changes nothing
    python dev/wings.py            # git mv every module to its wing, rewrite every import and reference

The run, in order:

1. Checks the tree: a git checkout of the repository root with no uncommitted change to a tracked file;
   every module and subpackage at the package's top is either in ``MAPPING`` (moved) or in ``TOP``
   (stays), else it stops and names it. A module in ``MAPPING`` that is absent is skipped with a note
   (the branches add and remove modules). A tree whose wings already exist is refused: run it once.
2. Rewrites, in every file git tracks (the package, tests/, bench/, synthetic/, docs/, README.md,
   pyproject.toml, hooks/ ...): dotted names (``mlx_lm_streaming.loading`` in imports, strings,
   monkeypatch targets, ``-m`` arguments, prose) and paths (``mlx_lm_streaming/loading.py``); in
   Python files, ``from mlx_lm_streaming import a, b`` split by where each name now lives; in the
   package, relative imports recomputed from each file's new place (``from . import report`` in
   loading.py becomes ``from ..runtime import report``; relative stays relative, as the package writes).
3. ``git mv``s each module (or subpackage) into its wing and writes the wing's ``__init__.py``: a
   docstring only (what it holds, which wings it may import); no import, so a wing costs nothing at
   start-up and the ``.pth`` hook's import of ``_bootstrap`` stays stdlib-only.
4. Copies dev/test_wings.py to tests/test_wings.py (the import-direction test of the moved tree; it
   lives in dev/ until then because it fails on a tree not yet moved, and pytest's testpaths, tests/,
   leave dev/ out),
   writes docs/design.md's "Layout" section from the wings and the modules' docstrings, applies the
   few hand edits in ``FIXUPS``, and stages everything (``git add``). It commits nothing.
5. Checks the result: every Python file compiles, no dotted reference to a moved module's old name
   is left, and it lists what it could not judge (bare ``"x.py"`` strings of moved modules).

Stdlib only. Deterministic: the same tree gives the same result.
"""

import argparse
import ast
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

PKG = "mlx_lm_streaming"

# What stays at the package's top (at most 8 modules; folders do not count), and why:
TOP = {
    "__init__": "the public API: mlx_lm_streaming.load",
    "__main__": "the CLI: python -m mlx_lm_streaming, the mlx_lm_streaming script",
    "_bootstrap": "the .pth / .start startup hook's import target (installed in site-packages)",
    "errors": "the exceptions users catch and plugins raise (docs/usage.md, docs/plugins.md)",
    "hookspecs": "the hooks plugins implement (docs/plugins.md)",
    "plugins": "the plugin manager plugin authors register on (docs/plugins.md)",
    "option_table": "the one option table; the startup hook reads it before any wing",
    "pipeline_generate": "a user command: python -m mlx_lm_streaming.pipeline_generate (docs/distributed.md)",
    # plugin-facing folders: their paths are what plugin authors import and the entry points name
    "architectures": "plugin-facing: ArchitectureAdapter, the architectures entry point",
    "kernels": "plugin-facing: kernels.base.ExpertKernel, the kernels entry point",
    "stores": "plugin-facing: stores.base.ExpertStore, the stores entry point",
}

# Each wing's __init__.py docstring. The "May import:" line is what tests/test_wings.py enforces.
WINGS = {
    "runtime": '''The data path at run time: an expert's bytes from the checkpoint into a slot bank, and the MoE
layer call that computes with them.

- the checkpoint's layout: ``safetensors_header`` (one file's header), ``index`` (where each expert's
  bytes are);
- the cache: ``policy`` (slot tables, eviction), ``bank`` (a layer's slot bank and its writes),
  ``expert_cache`` (the byte budget over all banks), ``prefetch`` and ``lookahead`` (reads ahead),
  ``host_views`` and ``cuda_copy`` (the ways into slot memory), ``counters``;
- the layer call: ``switch`` (the drop-in ``SwitchGLU``), ``schedules``, ``verified_step``,
  ``layer_major`` (the prefill);
- what that path itself reads, so it sits here and not above: ``options`` (what was asked;
  ``expert_cache`` reads its sizes, and it names ``policy``'s policies), ``mlx_compat`` (mlx-lm's
  internals behind the version guard; the schedules and the verified step call its shims),
  ``memory`` and ``devices`` (the machine), ``report`` (what a run says; ``layer_major`` says its
  fallback through it).

The plugin-facing ``stores/`` and ``kernels/`` stay at the package's top (their paths are what plugin
authors import); they import this wing, not the other way round.

May import: errors, option_table
''',
    "files": '''The files a run writes and reads besides the checkpoint, and the rules they follow.

``packfile`` (the expert pack: format, reader, writer), ``routing_trace`` (which experts each layer
picked, ``--record-routing``), ``timeline`` (trace-event JSON, ``--streaming-trace``), ``outputs``
(what every output file obeys: its magic, the lock beside it, replaced whole or not at all).

Below integration/ (loading opens the recorders), stores/ (the pack store reads packs) and tools/;
above runtime/ (a pack names tensors by the checkpoint's index).

May import: errors, runtime
''',
    "integration": '''How the runtime gets into mlx-lm.

``loading`` builds a streaming model inside mlx-lm's own ``load_model`` (the routed ``SwitchGLU``
modules swapped for streaming ones over an expert cache); ``integration`` patches mlx-lm's ``load``
and command-line entry points, through ``runtime.mlx_compat``'s version and shape guard. The
startup hook (``_bootstrap``), the public ``load`` and the distributed ``pipeline_generate`` stay at
the package's top and call in here.

May import: errors, option_table, plugins, runtime, files, kernels
''',
    "tools": '''Commands and analyses around a run, outside its data path.

``budget_table`` and ``replay`` (``mlx_lm_streaming plan``: budgets side by side, a routing trace
replayed through the real slot tables), ``pack`` (``mlx_lm_streaming pack``), ``parity``
(``mlx_lm_streaming verify``: stock and streaming logits compared bit for bit). Nothing in the data
path imports a tool; the CLI (``__main__``) and the tests do.

May import: errors, option_table, runtime, files, integration
''',
}

# module or subpackage at the package's top -> its wing. A name absent from the tree is skipped.
MAPPING = {
    # runtime: the checkpoint's layout
    "safetensors_header": "runtime",
    "index": "runtime",
    # runtime: the cache
    "policy": "runtime",
    "bank": "runtime",  # bank.py, or the bank/ subpackage (branch hotpath)
    "bank_io": "runtime",  # merged into bank/ by branch hotpath
    "expert_cache": "runtime",
    "prefetch": "runtime",
    "lookahead": "runtime",
    "host_views": "runtime",
    "cuda_copy": "runtime",
    "counters": "runtime",
    # runtime: the layer call
    "switch": "runtime",
    "schedules": "runtime",  # schedules.py, or the schedules/ subpackage (branch hotpath)
    "verified_step": "runtime",
    "layer_major": "runtime",
    # runtime: what the path reads
    "options": "runtime",
    "mlx_compat": "runtime",
    "memory": "runtime",  # new on branch house
    "devices": "runtime",
    "report": "runtime",
    # files
    "packfile": "files",
    "routing_trace": "files",
    "timeline": "files",
    "outputs": "files",
    # integration
    "loading": "integration",
    "integration": "integration",
    # tools
    "budget_table": "tools",
    "replay": "tools",
    "pack": "tools",
    "parity": "tools",
    "cooccurrence": "tools",  # removed by branch house
    "synthetic": "tools",  # moved out of the package by branch house
}

# Hand edits the generic rewrite cannot make: (file, old text, new text, why). A fixup whose old text
# is absent is reported, not applied: check that file by hand.
FIXUPS = [
    (
        "tests/test_integration_hook.py",
        "    for name, text in files.items():\n        if text is None:\n",
        "    for name, text in files.items():\n"
        "        (pkg / name).parent.mkdir(parents=True, exist_ok=True)\n"
        "        if text is None:\n",
        "shadow_package writes files into the wings' folders",
    ),
]
# bare file names in tests' shadow packages: "integration.py" -> "integration/integration.py" and
# the wing's __init__.py beside it (only in these files; elsewhere such strings are basenames)
SHADOW_FILES = ["tests/test_integration_hook.py"]

TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".txt", ".sh", ".pth", ".start", ".in", ".ini", ".yml", ".yaml"}
LINE_LENGTH = 110
DOC_WIDTH = 105  # docs/*.md wrap here
LAYOUT_HEADING = "## Layout: the package's wings"


def die(message: str) -> None:
    sys.exit(f"dev/wings.py: {message}")


def git(*args: str, root: Path) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


# -- the tree ------------------------------------------------------------------------------------


def top_entries(pkg: Path) -> dict:
    """name -> "module" or "package", for every module and subpackage at the package's top."""
    found = {}
    for p in sorted(pkg.iterdir()):
        if p.suffix == ".py":
            found[p.stem] = "module"
        elif p.is_dir() and (p / "__init__.py").exists():
            found[p.name] = "package"
    return found


def module_name(relpath: str) -> str:
    """mlx_lm_streaming/bank/reads.py -> mlx_lm_streaming.bank.reads; .../__init__.py -> the package."""
    parts = list(Path(relpath).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def preflight(root: Path):
    pkg = root / PKG
    if not (pkg / "__init__.py").exists() or not (root / "pyproject.toml").exists():
        die(f"run from the repository root (no {PKG}/__init__.py or pyproject.toml here)")
    entries = top_entries(pkg)
    wings_there = [w for w in WINGS if w in entries and (pkg / w / "__init__.py").exists()]
    moved_there = [m for m in MAPPING if m in entries and m not in WINGS]
    if wings_there and not moved_there:
        die(f"already applied: the wings {', '.join(wings_there)} exist and no mapped module is loose; nothing to do")
    if any(w in entries and entries[w] == "package" for w in WINGS if w not in MAPPING):
        die(f"a wing folder exists already ({', '.join(wings_there)}) while mapped modules are loose: "
            "a half-applied run? restore the tree (git checkout/reset) and run again")
    unknown = sorted(set(entries) - set(MAPPING) - set(TOP))
    if unknown:
        die("in the package but in neither MAPPING nor TOP (add each to one, then run again): "
            + ", ".join(f"{n} ({entries[n]})" for n in unknown))
    dirty = [l for l in git("status", "--porcelain", "--untracked-files=no", root=root).splitlines() if l]
    if dirty:
        die("uncommitted changes to tracked files; commit or stash them first:\n  " + "\n  ".join(dirty[:20]))
    moves = {n: MAPPING[n] for n in MAPPING if n in entries}
    skipped = [n for n in MAPPING if n not in entries]
    loose = sorted(n for n in TOP if entries.get(n) == "module")
    return entries, moves, skipped, loose


# -- rewriting -----------------------------------------------------------------------------------


def new_name(dotted: str, moves: dict) -> str:
    """The module's dotted name after the move (unchanged when it does not move)."""
    parts = dotted.split(".")
    if len(parts) >= 2 and parts[0] == PKG and parts[1] in moves:
        return ".".join([PKG, moves[parts[1]]] + parts[1:])
    return dotted


def dotted_pattern(moves: dict):
    names = "|".join(sorted(moves, key=len, reverse=True))
    # mlx_lm_streaming.loading (not mlx_lm_streaming.loading_x, not other.mlx_lm_streaming.loading)
    dotted = re.compile(rf"(?<![\w.]){PKG}\.({names})(?![\w])")
    # mlx_lm_streaming/loading.py, mlx_lm_streaming/bank/ ...
    # (not COMMIT:mlx_lm_streaming/x.py, a path in a past commit)
    path = re.compile(rf"(?<![\w:]){PKG}/({names})(?=\.py\b|/)")
    return dotted, path


def rewrite_text(text: str, moves: dict, patterns) -> str:
    dotted, path = patterns
    text = dotted.sub(lambda m: f"{PKG}.{moves[m.group(1)]}.{m.group(1)}", text)
    return path.sub(lambda m: f"{PKG}/{moves[m.group(1)]}/{m.group(1)}", text)


FROM_PKG = re.compile(rf"from {PKG} import (\w+(?: as \w+)?(?:, *\w+(?: as \w+)?)*)")


def rewrite_string_imports(text: str, moves: dict) -> str:
    """``from mlx_lm_streaming import a, b`` that no parser sees: in a script a test writes out, a
    ``python -c`` string, a docs snippet. Split by where each name lives: on lines of their own at a
    line's start, joined by "; " inside a line. (Real statements were rewritten before: what is left
    names no moved module.)"""

    def split(m):
        names = [n.strip() for n in m.group(1).split(",")]
        groups = {}
        for n in names:
            base = n.split(" as ")[0]
            groups.setdefault(f"{PKG}.{moves[base]}" if base in moves else PKG, []).append(n)
        if list(groups) == [PKG]:
            return m.group(0)
        line_start = text.rfind("\n", 0, m.start()) + 1
        lead = text[line_start : m.start()]
        joiner = "\n" + lead if not lead.strip() else "; "
        return joiner.join(f"from {mod} import {', '.join(ns)}" for mod, ns in sorted(groups.items()))

    return FROM_PKG.sub(split, text)


def relative(target: str, importer_pkg: str) -> str:
    """``from <this> import ...`` for absolute module ``target``, seen from package ``importer_pkg``."""
    t, p = target.split("."), importer_pkg.split(".")
    common = 0
    while common < min(len(t), len(p)) and t[common] == p[common]:
        common += 1
    return "." * (len(p) - common + 1) + ".".join(t[common:])


def format_import(indent: str, module: str, names: list, exploded: bool) -> str:
    """``from module import names``, black's way: one line if it fits and was not exploded before."""
    body = ", ".join(f"{n} as {a}" if a else n for n, a in names)
    line = f"{indent}from {module} import {body}"
    if len(line) <= LINE_LENGTH and not exploded:
        return line
    inner = "".join(f"{indent}    {n} as {a},\n" if a else f"{indent}    {n},\n" for n, a in names)
    return f"{indent}from {module} import (\n{inner}{indent})"


def sort_key(module: str):
    """isort's order within our imports: farthest relative first, then by name."""
    dots = len(module) - len(module.lstrip("."))
    return (-dots, module[dots:].lower())


def statement_lists(tree):
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                yield body
        for handler in getattr(node, "handlers", []) or []:
            yield handler.body


def rewrite_imports(text: str, path: str, old_of: dict, new_of: dict, modules_old: set, moves: dict, notes: list):
    """Rewrite ``from X import ...`` statements whose names or module move.

    ``old_of``/``new_of``: this file's module name before and after (None outside the package).
    Relative imports are resolved from the old place and written relative to the new one; absolute
    ``from mlx_lm_streaming import a, b`` is split by where each name lives. A run of adjacent
    package imports holding a changed one is put back in isort's order."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        notes.append(f"{path}: not parsed ({e}); its imports were not rewritten")
        return text
    lines = text.splitlines(keepends=True)
    in_pkg = old_of is not None
    if in_pkg:
        is_init = path.endswith("__init__.py")
        old_pkg = old_of if is_init else old_of.rpartition(".")[0]
        new_pkg = new_of if is_init else new_of.rpartition(".")[0]

    def ours(node) -> bool:
        return isinstance(node, ast.ImportFrom) and ((node.level and in_pkg) or node.module == PKG)

    def spell(node):
        """[(module as written, names)] after the move, and whether that differs from now."""
        if node.level:
            base = old_pkg.split(".")
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:  # from mlx_lm_streaming import ... (from mlx_lm_streaming.x import: the dotted rewrite did those)
            source = node.module
        groups = {}
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            if sub in modules_old:  # the name is a module: it comes from the module's new package
                target = new_name(sub, moves).rpartition(".")[0]
            else:  # an attribute of ``source``
                target = new_name(source, moves)
            groups.setdefault(target, []).append((alias.name, alias.asname))
        if node.level:
            spelled = {relative(t, new_pkg): ns for t, ns in groups.items()}
            now = ("." * node.level) + (node.module or "")
        else:
            spelled, now = dict(groups), node.module
        return sorted(spelled.items()), list(spelled) != [now]

    edits = []
    for body in statement_lists(tree):
        i = 0
        while i < len(body):
            if not ours(body[i]):
                i += 1
                continue
            j = i  # the run of adjacent package imports body[i..j]
            while j + 1 < len(body) and ours(body[j + 1]) and body[j + 1].lineno == body[j].end_lineno + 1:
                j += 1
            run = body[i : j + 1]
            i = j + 1
            spelled = [spell(n) for n in run]
            if not any(changed for _, changed in spelled):
                continue
            first, last = run[0].lineno - 1, run[-1].end_lineno - 1
            indent = lines[first][: run[0].col_offset]
            if indent.strip() or any(lines[n.lineno - 1][: n.col_offset] != indent for n in run):
                notes.append(f"{path}:{run[0].lineno}: an import shares its line with other code; fix it by hand")
                continue
            tails = [lines[n.end_lineno - 1][n.end_col_offset :].strip() for n in run]
            if any(t and not t.startswith("#") for t in tails):
                notes.append(f"{path}:{run[0].lineno}: an import shares its line with other code; fix it by hand")
                continue
            statements = []
            for n, (groups, changed), tail in zip(run, spelled, tails):
                original = "".join(lines[n.lineno - 1 : n.end_lineno]).rstrip("\n")[len(indent) :]
                inside = lines[n.lineno - 1 : n.end_lineno - 1]
                if changed and any("#" in l for l in inside):
                    notes.append(f"{path}:{n.lineno}: a comment inside a multi-line import was dropped")
                exploded = n.end_lineno > n.lineno
                if not changed:
                    module = ("." * n.level) + (n.module or "")
                    statements.append((sort_key(module), indent + original))
                    continue
                for k, (module, names) in enumerate(groups):
                    text_ = format_import(indent, module, names, exploded)
                    if tail and k == 0:
                        text_ += "  " + tail
                    statements.append((sort_key(module), text_))
            statements.sort(key=lambda s: s[0])
            edits.append((first, last, "\n".join(t for _, t in statements) + "\n"))
    for first, last, new in sorted(edits, reverse=True):
        lines[first : last + 1] = [new]
    return "".join(lines)


# -- the run -------------------------------------------------------------------------------------


def first_sentence(path: Path) -> str:
    """The docstring's first sentence (two when the first is a bare label like "Exceptions.")."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    except SyntaxError:
        return ""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    ends = [m.start() for m in re.finditer(r"(?<=[.!?])\s", para)] + [len(para)]
    cut = ends[0] if ends[0] >= 30 or len(ends) == 1 else ends[1]
    return para[:cut]


def wrap(text: str, first: str = "", rest: str = "") -> list:
    return textwrap.wrap(text, width=DOC_WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


def layout_section(root: Path) -> str:
    pkg = root / PKG
    out = [LAYOUT_HEADING, ""]
    out += wrap(
        "The package keeps the runtime, its way into mlx-lm and the tools around it apart, a folder per wing; "
        "each wing's `__init__.py` says what it holds and which wings it may import, and "
        "`tests/test_wings.py` checks that imports run that one way, with no circle among modules. "
        "From the bottom up:"
    )
    out.append("")
    out.append("```")
    out.append("errors hookspecs option_table      at the top; import nothing of the package")
    out.append("runtime/                           the data path: every file of the diagram below but stores/, kernels/")
    out.append("files/                             the files a run writes and reads besides the checkpoint")
    out.append("plugins architectures/ kernels/    the plugin manager and the plugin-facing folders, one per")
    out.append("stores/                            extension point (their paths are what plugin authors import)")
    out.append("integration/                       into mlx-lm: loading, the patches")
    out.append("tools/                             plan, pack, verify")
    out.append("__init__ __main__ _bootstrap       what users import and run, at the top")
    out.append("pipeline_generate")
    out.append("```")
    out.append("")
    out.append("At the package's top, what users and plugin authors import or run (the paths stay as they were):")
    out.append("")
    entries = top_entries(pkg)
    for name in sorted(n for n, kind in entries.items() if kind == "module" and n in TOP):
        out += wrap(f"`{name}.py`: {first_sentence(pkg / (name + '.py'))}", "- ", "  ")
    for name in sorted(n for n, kind in entries.items() if kind == "package" and n in TOP):
        out += wrap(f"`{name}/`: {first_sentence(pkg / name / '__init__.py')}", "- ", "  ")
    for wing in WINGS:
        if not (pkg / wing).is_dir():
            continue
        out.append("")
        allowed = [l for l in WINGS[wing].splitlines() if l.startswith("May import:")][0]
        out += wrap(f"`{wing}/`: {first_sentence(pkg / wing / '__init__.py')} {allowed}.")
        out.append("")
        for p in sorted((pkg / wing).iterdir()):
            if p.name == "__init__.py" or p.name == "__pycache__":
                continue
            if p.suffix == ".py":
                out += wrap(f"`{p.name}`: {first_sentence(p)}", "- ", "  ")
            elif (p / "__init__.py").exists():
                subs = ", ".join(q.name for q in sorted(p.glob("*.py")) if q.name != "__init__.py")
                out += wrap(f"`{p.name}/` ({subs}): {first_sentence(p / '__init__.py')}", "- ", "  ")
    out.append("")
    return "\n".join(out)


def update_design(root: Path, notes: list) -> None:
    design = root / "docs" / "design.md"
    if not design.exists():
        notes.append("docs/design.md absent: no layout section written")
        return
    text = design.read_text()
    section = layout_section(root)
    if LAYOUT_HEADING in text:  # replace the old one (up to the next "## ")
        start = text.index(LAYOUT_HEADING)
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + (text[end + 1 :] if end != -1 else "")
    elif "\n## The data path" in text:
        at = text.index("\n## The data path") + 1
        text = text[:at] + section + "\n" + text[at:]
    else:
        notes.append("docs/design.md: no '## The data path' heading; the layout section went to the end")
        text = text.rstrip("\n") + "\n\n" + section
    # the old one-idea-a-file list around the path: now the layout section above
    m = re.search(r"\nAround the path, one idea a file:\n\n(?:- .*\n(?:  .*\n)*)+", text)
    if m:
        around = (
            "Around the path, one idea a file, each in its wing (Layout, above): `integration/loading.py` "
            "builds the path into an mlx-lm model with what `runtime/options.py` reads from the four ways "
            "to ask for it; `runtime/mlx_compat.py` is every touch of mlx-lm internals, behind the version "
            "and shape guard, which `integration/integration.py` (flags, the `load_model` wrapper) and "
            "`_bootstrap.py` (the startup hook) go through."
        )
        text = text[: m.start()] + "\n" + "\n".join(wrap(around)) + "\n" + text[m.end() :]
    else:
        notes.append("docs/design.md: the 'Around the path, one idea a file:' list was not found; check the section by hand")
    design.write_text(text)


def drop_stale_exceptions(root: Path, notes: list) -> None:
    """Take out of tests/test_wings.py's EXCEPTIONS each entry (and the comment above it) whose import
    the moved tree no longer has, using the test's own reading of the imports."""
    path = root / "tests" / "test_wings.py"
    if not path.exists():
        return
    spec = importlib.util.spec_from_file_location("_wings_test", path)
    test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test)
    _, edges = test.graph()
    found = {(m, t) for m, ts in edges.items() for t, _ in ts}
    lines = path.read_text().splitlines(keepends=True)
    for m, t in test.EXCEPTIONS:
        if (m, t) in found and test.unit(t) not in test.ALLOWED[test.unit(m)]:
            continue
        at = next(i for i, l in enumerate(lines) if l.lstrip().startswith(f'("{m}", "{t}")'))
        first = at
        while first > 0 and lines[first - 1].lstrip().startswith("#") and not lines[first - 1].startswith("#"):
            first -= 1
        del lines[first : at + 1]
        notes.append(f"tests/test_wings.py: EXCEPTIONS entry {m} -> {t} dropped (no import needs it)")
    path.write_text("".join(lines).replace("EXCEPTIONS = {\n}\n", "EXCEPTIONS = {}\n"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="say what would move and stop")
    args = ap.parse_args()
    root = Path.cwd()
    entries, moves, skipped, loose = preflight(root)
    print(f"moving {len(moves)} into {len(WINGS)} wings; staying at the top: {', '.join(sorted(n for n in entries if n in TOP))}")
    for n in skipped:
        print(f"  note: {n} is in MAPPING but not in the package: skipped")
    if len(loose) > 8:
        die(f"{len(loose)} modules would stay loose at the top (at most 8): {', '.join(loose)}")
    if args.check:
        for n, w in moves.items():
            print(f"  {PKG}/{n}{'/' if entries[n] == 'package' else '.py'} -> {PKG}/{w}/")
        return

    notes = []
    tracked = [p for p in git("ls-files", root=root).splitlines() if p]
    pkg_files = [p for p in tracked if p.startswith(PKG + "/") and p.endswith(".py")]
    modules_old = {module_name(p) for p in pkg_files}
    new_path = {}
    for p in pkg_files:
        parts = p.split("/")
        new_path[p] = "/".join([PKG, moves[parts[1].removesuffix(".py")]] + parts[1:]) if parts[1].removesuffix(".py") in moves else p
    patterns = dotted_pattern(moves)
    changed = []
    for rel in tracked:
        f = root / rel
        if f.suffix not in TEXT_SUFFIXES or not f.is_file():
            continue
        if rel.startswith("docs/benchmarks/"):  # records of past runs: they name what was, leave them
            continue
        if rel.startswith("dev/"):  # this codemod and the test it installs: written for the moved tree
            continue
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite_text(text, moves, patterns)
        if f.suffix == ".py":
            old_of = module_name(rel) if rel in new_path else None
            new_of = module_name(new_path[rel]) if rel in new_path else None
            new = rewrite_imports(new, rel, old_of, new_of, modules_old, moves, notes)
        new = rewrite_string_imports(new, moves)
        if rel in SHADOW_FILES:
            for n in sorted(moves):
                if entries[n] == "module" and f'"{n}.py"' in new:
                    w = moves[n]
                    new = new.replace(f'"{n}.py": ', f'"{w}/__init__.py": None,\n        "{w}/{n}.py": ')
        if new != text:
            f.write_text(new)
            changed.append(rel)
    # the moves
    pkg = root / PKG
    for wing, doc in WINGS.items():
        if wing not in moves.values():
            continue
        (pkg / wing).mkdir(exist_ok=True)
    for n, w in moves.items():
        src = f"{PKG}/{n}" + (".py" if entries[n] == "module" else "")
        git("mv", src, f"{PKG}/{w}/", root=root)
    for wing, doc in WINGS.items():
        if wing in moves.values():
            (pkg / wing / "__init__.py").write_text(f'"""{doc}"""\n')
            git("add", f"{PKG}/{wing}/__init__.py", root=root)
    # the test, the docs, the hand edits
    template = root / "dev" / "test_wings.py"
    if template.exists():
        (root / "tests" / "test_wings.py").write_text(template.read_text())
    else:
        notes.append("dev/test_wings.py absent: tests/test_wings.py not written")
    drop_stale_exceptions(root, notes)
    update_design(root, notes)
    for rel, old, new, why in FIXUPS:
        f = root / rel
        if f.exists() and old in f.read_text() and new not in f.read_text():
            f.write_text(f.read_text().replace(old, new))
        elif f.exists() and new not in f.read_text():
            notes.append(f"fixup not applied ({why}): {rel}: check by hand")
    if (root / "tests" / "test_wings.py").exists():
        git("add", "tests/test_wings.py", root=root)
    git("add", "-u", root=root)  # every rewritten tracked file; nothing untracked

    # checks
    dotted, path = patterns
    for rel in git("ls-files", root=root).splitlines():
        f = root / rel
        if f.suffix not in TEXT_SUFFIXES or not f.is_file() or rel.startswith(("docs/benchmarks/", "dev/")):
            continue
        text = f.read_text(errors="replace")
        if f.suffix == ".py":
            try:
                compile(text, rel, "exec")
            except SyntaxError as e:
                notes.append(f"{rel}: does not compile after the rewrite: {e}")
        for n, w in moves.items():
            # a name that is also a wing (integration) may stand before one of the wing's modules
            inside = "|".join(sorted(k for k, v in moves.items() if v == n))
            # (there only mlx_lm_streaming.integration.NAME is stale, NAME not one of the wing's modules)
            follow = rf"\.(?!({inside})\b)\w" if n in WINGS else r"(?![\w])"
            for m in re.finditer(rf"(?<![\w.]){PKG}\.{n}{follow}", text):
                notes.append(f"{rel}: still names {PKG}.{n} (line {text.count(chr(10), 0, m.start()) + 1})")
        for m in FROM_PKG.finditer(text):
            left = [n.strip() for n in m.group(1).split(",") if n.strip().split(" as ")[0] in moves]
            if left:
                notes.append(f"{rel}: still imports {', '.join(left)} from {PKG} (line {text.count(chr(10), 0, m.start()) + 1})")
        for n, w in moves.items():
            if f.suffix == ".py" and rel.startswith(("tests/", "bench/")) and rel not in SHADOW_FILES:
                if entries[n] == "module" and re.search(rf"[\"']{n}\.py[\"']", text):
                    notes.append(f"{rel}: the string \"{n}.py\": a basename, or a path into the package? check by hand")
    print(f"rewrote {len(changed)} files; moved {len(moves)}; wings: {', '.join(w for w in WINGS if w in moves.values())}")
    for n in notes:
        print("  note:", n)
    print("staged, not committed. Next: git diff --cached --stat; python -m pytest -q tests/test_wings.py")


if __name__ == "__main__":
    main()
