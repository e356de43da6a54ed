"""A list that cannot go stale (issue 38 item 4): every Mixture-of-Experts model type of the
installed mlx-lm streams (a registered adapter) or is refused with its reason
(``integration/unstreamable.py``), and docs/architectures.md names each with its status.

The model types are found in mlx-lm itself: every model module that reaches ``switch_layers``
through its own imports (the families, and the wrappers and subclasses built on them), every module
that keeps its experts in a list of modules instead, and every name ``MODEL_REMAPPING`` (and
``MODEL_ARCHITECTURE_REMAPPING``) sends to one of those. A new mlx-lm release with a new family
fails here until the family streams or is refused with a reason.
"""

import ast
import importlib
import re
from pathlib import Path

import mlx_lm.models
import mlx_lm.utils
import pytest

from mlx_lm_streaming import plugins
from mlx_lm_streaming.integration.unstreamable import REFUSED, model_module

MODELS = Path(mlx_lm.models.__file__).parent
DOC = Path(__file__).resolve().parent.parent / "docs" / "architectures.md"


def _imports_and_expert_lists(source: str):
    """The sibling modules a model module imports (``from .x import``, ``from . import x``), and
    whether it keeps experts in a list (``self.experts = [...]``)."""
    siblings, listed = set(), False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                siblings.add(node.module.split(".")[0])
            else:
                siblings.update(a.name for a in node.names)
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.ListComp)):
            listed |= any(
                isinstance(t, ast.Attribute) and t.attr == "experts" for t in node.targets
            )
    return siblings, listed


def moe_modules(models=MODELS) -> dict:
    """``module -> the module of its Model class`` for every MoE model module of mlx-lm."""
    imports, listed = {}, set()
    for path in sorted(models.glob("*.py")):
        siblings, experts_in_a_list = _imports_and_expert_lists(path.read_text())
        imports[path.stem] = siblings
        if experts_in_a_list:
            listed.add(path.stem)
    reach = {m for m, s in imports.items() if "switch_layers" in s} | listed
    grew = True
    while grew:  # wrappers and subclasses: modules that import one that reaches switch_layers
        more = {m for m, s in imports.items() if s & reach and m != "switch_layers"} - reach
        reach |= more
        grew = bool(more)
    out = {}
    for name in sorted(reach):
        model = getattr(importlib.import_module(f"mlx_lm.models.{name}"), "Model", None)
        if model is not None:
            out[name] = model_module(model)
    return out


def remapped(modules: dict) -> dict:
    """``model type -> module`` for the names mlx-lm maps to one of ``modules``."""
    out = {a: t for a, t in mlx_lm.utils.MODEL_REMAPPING.items() if t in modules}
    by_architecture = getattr(mlx_lm.utils, "MODEL_ARCHITECTURE_REMAPPING", {})  # 0.32+
    for (model_type, _), target in by_architecture.items():
        if target in modules and model_type not in modules:
            out[model_type] = target
    return out


def unlisted(modules: dict, adapters, refused: dict) -> list:
    """The modules whose model class is neither streamed (an adapter) nor refused with a
    reason."""
    return sorted(
        m for m, key in modules.items() if key not in adapters and not refused.get(key, "").strip()
    )


@pytest.fixture(scope="module")
def modules():
    return moe_modules()


def test_the_enumeration_finds_the_families_wrappers_and_lists(modules):
    # not vacuous: the families with a SwitchGLU or SwitchMLP, the wrappers on them, a subclass
    # (glm_moe_dsa), a re-export (solar_open is glm4_moe's model), experts in a list (dbrx)
    assert {"qwen3_moe", "mixtral", "nemotron_h", "phixtral", "qwen3_next", "gemma4_text"} <= set(
        modules
    )
    assert {"qwen3_5_moe", "gemma4", "kimi_vl", "qwen3_vl_moe", "dbrx"} <= set(modules)
    assert modules["solar_open"] == "glm4_moe" and modules["qwen3_5_moe"] == "qwen3_5_moe"
    assert "llama" not in modules and "switch_layers" not in modules
    assert remapped(modules)["kimi_k2"] == "deepseek_v3"


def test_every_moe_model_module_streams_or_is_refused_with_a_reason(modules):
    missing = unlisted(modules, plugins.architectures(), REFUSED)
    assert not missing, (
        f"mlx-lm {mlx_lm.__version__} has Mixture-of-Experts models neither streamed nor refused: "
        f"{missing}; add an adapter (architectures/builtin.py, with a parity test) or a reason "
        "(integration/unstreamable.py: REFUSED), and a row in docs/architectures.md"
    )


def test_the_check_fails_when_an_entry_is_removed(modules):
    adapters = plugins.architectures()
    without = {k: v for k, v in adapters.items() if k != "qwen3_moe"}
    assert unlisted(modules, without, REFUSED) == ["qwen3_moe"]
    assert unlisted(modules, adapters, {k: v for k, v in REFUSED.items() if k != "dbrx"}) == [
        "dbrx"
    ]
    assert unlisted(modules, adapters, {**REFUSED, "dbrx": " "}) == ["dbrx"]  # no reason


def test_nothing_is_both_streamed_and_refused():
    assert not set(REFUSED) & set(plugins.architectures())


def _table_rows(text: str, heading: str) -> dict:
    """``model type -> row`` for the backticked names in the first cell of each row of the
    tables under ``## heading`` (up to the next ``## ``)."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            first = line.split("|")[1]
            for name in re.findall(r"`([^`]+)`", first):
                rows[name] = line
    return rows


def test_the_docs_name_every_moe_model_type_with_its_status(modules):
    text = DOC.read_text()
    streamed = _table_rows(text, "Streamed") | _table_rows(text, "Hybrids and SwitchMLP experts")
    refused = _table_rows(text, "Refused")
    types = {**{m: key for m, key in modules.items()}, **remapped(modules)}
    for name, module in sorted(types.items()):
        key = modules.get(module, module)
        if key in REFUSED:
            assert name in refused, f"docs/architectures.md: {name} is not in the Refused table"
        else:
            assert name in streamed, f"docs/architectures.md: {name} is not in a Streamed table"
    # and the Refused table is the list's: every entry, each with words of its reason
    assert set(refused) == set(REFUSED)
    for name, row in refused.items():
        words = re.findall(r"[a-z_]{6,}", REFUSED[name])[:3]
        assert all(w in row for w in words), (name, words, row)
