"""The package's wings (issue 31): imports run one way between them, no circle among modules, at most 8
modules loose at the package's top; no module over 450 lines, bench/ at most 2,900.

Reads the imports with ``ast``; imports nothing from the package. A *unit* is a wing (``runtime/``,
``files/``, ``integration/``, ``tools/``), a plugin-facing folder (``architectures/``, ``kernels/``,
``stores/``) or one loose module at the top.

- Direction counts every import, at module level or inside a function: a late import is still a
  dependency (it is how a wrong-way one hides), so the units form a DAG whatever is imported late.
- No circle among modules, counting late imports too (issue 40): a circle of module-level imports
  makes the import order matter, and one closed by a function-level import still ties two modules
  so that neither can be read, tested or replaced without the other (``switch`` and ``layer_pass``,
  ``layer_major`` and ``report`` were such pairs; data now flows one way: a pass found by its
  banks, notes pushed to the report). ``if TYPE_CHECKING:`` blocks are skipped; the implicit import of a
  module's parent package is not an edge (each wing's ``__init__`` imports nothing).
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mlx_lm_streaming"
NAME = "mlx_lm_streaming"

# unit -> the units it may import besides itself, bottom to top. The wings' docstrings say the same
# in their "May import:" line (checked below).
ALLOWED = {
    "errors": set(),
    "hookspecs": set(),
    "option_table": set(),
    "runtime": {"errors", "option_table"},
    "files": {"errors", "runtime"},
    "plugins": {"errors", "hookspecs", "option_table"},
    "architectures": {"errors", "hookspecs"},
    "kernels": {"errors", "hookspecs", "plugins", "runtime"},
    "stores": {"errors", "hookspecs", "runtime", "files"},
    "integration": {"errors", "option_table", "plugins", "runtime", "files", "kernels"},
    "tools": {"errors", "option_table", "runtime", "files", "integration"},
    "_bootstrap": {"option_table", "integration"},
    "pipeline_generate": {"errors", "integration"},
    "__init__": {"errors", "runtime", "integration"},
    "__main__": {
        "__init__", "errors", "option_table", "plugins", "runtime", "files", "integration", "tools",
    },
}
WINGS = ("runtime", "files", "integration", "tools")
MAX_LOOSE = 8
# bench/ scripts outside its line cap: they made committed test data (the trace
# tests/data/routing/trained-qwen3moe-16x64.jsonl names them as its source) and stay so that it can
# be made again. They answer no open question and do not grow with the benchmarks the cap is for
MAKE_TEST_DATA = {"train_routing_model.py", "routing_model_figures.py"}

# (importer, imported) module pairs allowed against ALLOWED, each with its reason. Keep it short: an
# entry no import needs any more fails below (dev/wings.py drops those it finds stale when it installs
# this test).
EXCEPTIONS = {}


def modules() -> dict:
    """dotted name -> (path, is_package) for every module of the package."""
    found = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if "__pycache__" in parts:
            continue
        is_pkg = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def imports(module: str, path: Path, is_pkg: bool, known: dict):
    """(imported module, at module level?) for each import of a package module in ``module``."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def target(source: str, names):
        for alias in names:
            sub = f"{source}.{alias.name}"
            yield sub if sub in known else source

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == NAME or alias.name.startswith(NAME + "."):
                        found.append((alias.name, top))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if is_pkg else module.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module or ""
                if source == NAME or source.startswith(NAME + "."):
                    found.extend((t, top) for t in target(source, child.names))
            visit(child, inner)

    visit(tree, True)
    return [(t, top) for t, top in found if t in known and t != module]


def graph():
    known = modules()
    edges = {m: imports(m, p, is_pkg, known) for m, (p, is_pkg) in known.items()}
    return known, edges


def test_every_module_is_in_a_known_unit():
    known, _ = graph()
    strays = sorted({unit(m) for m in known} - set(ALLOWED))
    assert not strays, (
        f"{strays}: not a wing nor an allowed top-level module of tests/test_wings.py; move it into "
        "a wing (runtime/, files/, integration/, tools/) or, if users import it there, add it to ALLOWED"
    )


def test_at_most_8_modules_loose_at_the_top():
    # every .py at the top counts, __init__ and __main__ too; folders do not
    loose = sorted(p.name for p in PKG.glob("*.py"))
    assert len(loose) <= MAX_LOOSE, f"{len(loose)} modules loose at the top (at most {MAX_LOOSE}): {loose}"


def test_the_allowed_table_runs_one_way():
    # the table itself has no circle: a topological order exists
    left, order = dict(ALLOWED), []
    while left:
        ready = [u for u, deps in left.items() if deps <= set(order)]
        assert ready, f"ALLOWED has a circle among {sorted(left)}"
        order += sorted(ready)
        for u in ready:
            del left[u]


def test_wing_docstrings_match_the_table():
    for wing in WINGS:
        init = PKG / wing / "__init__.py"
        assert init.is_file(), f"{wing}/__init__.py missing"
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree) or ""
        line = re.search(r"^May import: (.*)$", doc, re.M)
        assert line, f"{wing}/__init__.py: its docstring does not say which wings it may import"
        said = {w.strip() for w in line.group(1).split(",") if w.strip() and w.strip() != "nothing"}
        assert said == ALLOWED[wing], f"{wing}/__init__.py says {sorted(said)}, the test {sorted(ALLOWED[wing])}"
        # a wing's __init__ is its docstring (and at most a lazy ``__getattr__`` for names that
        # lived there before the wings): it imports nothing, so a wing costs nothing to enter
        assert all(
            isinstance(n, ast.Expr) or (isinstance(n, ast.FunctionDef) and n.name == "__getattr__")
            for n in tree.body
        ), f"{wing}/__init__.py does more than say"


def test_imports_run_one_way_between_units():
    _, edges = graph()
    wrong = []
    for m, targets in edges.items():
        for t, top in targets:
            a, b = unit(m), unit(t)
            if a != b and b not in ALLOWED.get(a, set()) and (m, t) not in EXCEPTIONS:
                wrong.append(f"{m} -> {t} ({a} may not import {b}{'' if top else '; inside a function'})")
    assert not wrong, "imports against the wings' direction:\n" + "\n".join(sorted(set(wrong)))


@pytest.mark.parametrize("late", [False, True], ids=["module_level", "late_imports_too"])
def test_no_circle_among_modules(late):
    _, edges = graph()
    adjacency = {m: sorted({t for t, top in ts if top or late}) for m, ts in edges.items()}
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in adjacency.get(m, ()):
            if state.get(t) == "open":
                circles.append(" -> ".join(stack[stack.index(t) :] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(adjacency):
        if m not in state:
            visit(m)
    where = "counting late imports" if late else "at module level"
    assert not circles, f"import circles {where}:\n" + "\n".join(circles)


def test_every_exception_is_still_needed():
    _, edges = graph()
    found = {(m, t) for m, ts in edges.items() for t, _ in ts}
    stale = [f"{m} -> {t}" for m, t in EXCEPTIONS if (m, t) not in found or unit(t) in ALLOWED[unit(m)]]
    assert not stale, "EXCEPTIONS no import needs any more (delete them):\n" + "\n".join(stale)


def test_sizes_the_house_keeps():
    """No module of the package over 450 lines, and bench/ (its scripts and shell files, less those
    of MAKE_TEST_DATA) at most 2,900: the limits issue 31 set, so that neither grows back unseen."""
    big = [f"{p.relative_to(ROOT)}: {n}" for p in PKG.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 450]  # fmt: skip
    assert not big, "modules over 450 lines (split them by what they do):\n" + "\n".join(big)
    bench = sorted(
        p for p in (ROOT / "bench").iterdir()
        if p.suffix in (".py", ".sh") and p.name not in MAKE_TEST_DATA
    )  # fmt: skip
    lines = sum(len(p.read_text().splitlines()) for p in bench)
    assert lines <= 2900, f"bench/ holds {lines} lines (at most 2,900): retire answered scripts"


# ROOMS of runtime/ (written by rooms.py): room -> the rooms it may import, bottom to top
ROOMS = {
    "reads": {"runtime"},
    "bank": {"runtime", "reads"},
    "decode": {"runtime", "reads", "bank"},
    "memory": {"runtime", "reads", "bank", "decode"},
    "prefill": {"runtime", "reads", "bank", "decode", "memory"},
}
# end of ROOMS
# runtime/'s alias modules: an old public path that is the moved module (``sys.modules``)
ALIASES = ["index", "safetensors_header"]
MAX_LOOSE_IN_RUNTIME = 10


def room(module: str) -> str:
    """runtime/'s room of a module of the runtime wing: its folder, or "runtime" for the plumbing."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in ROOMS) else "runtime"


def test_runtime_rooms_each_say_what_they_hold_and_may_import():
    folders = {p.parent.name for p in (PKG / "runtime").glob("*/__init__.py")}
    assert folders == set(ROOMS), f"runtime/'s folders {sorted(folders)}, its ROOMS {sorted(ROOMS)}"
    for name, below in ROOMS.items():
        doc = ast.get_docstring(ast.parse((PKG / "runtime" / name / "__init__.py").read_text())) or ""
        line = re.search(r"^May import: (.*)$", doc, re.M)
        assert line, f"runtime/{name}/__init__.py: its docstring does not say which rooms it may import"
        said = {w.strip() for w in line.group(1).split(",") if w.strip()}
        assert said == below, f"runtime/{name} says {sorted(said)}, ROOMS {sorted(below)}"


def test_runtime_rooms_import_only_rooms_below_them():
    _, edges = graph()
    wrong = []
    for m, targets in edges.items():
        if unit(m) != "runtime" or m.rsplit(".", 1)[-1] in ALIASES:
            continue
        for t, top in targets:
            if unit(t) != "runtime":
                continue
            a, b = room(m), room(t)
            if a != b and b not in ROOMS.get(a, set()):
                wrong.append(f"{m} -> {t} ({a} may not import {b}{'' if top else '; inside a function'})")
    assert not wrong, "imports against runtime/'s rooms:\n" + "\n".join(sorted(set(wrong)))


def test_at_most_10_files_directly_in_runtime():
    # its alias modules aside: an old path, not code
    loose = sorted(p.name for p in (PKG / "runtime").glob("*.py") if p.stem not in ALIASES)
    assert len(loose) <= MAX_LOOSE_IN_RUNTIME, f"{len(loose)} files directly in runtime/: {loose}"
