"""The packages import downward only: ``kvkernels`` at the bottom, ``kvpolicies`` above it, ``kvmodels`` (with
its transformers route ``kvmodels.hf``) on top. No package imports a
private module or name of another, and no model imports ``kvpolicies`` (models offer ``cache.observe``).
Above the library, outside ``src/`` and the wheel, sit the research folders: the evaluation harness
``evals`` and the studies in ``experiments`` (which use the harness). They import the library; the library
never imports them, and ``evals`` never imports ``experiments``. Read from the source (AST), so a lazy
import inside a function counts as much as one at the top of a file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
LEVEL = {"kvkernels": 0, "kvpolicies": 1, "kvmodels": 2}
#: Top-level folders of the repository beside ``src/`` (run from its root, not installed), above the library.
RESEARCH = {"evals": 3, "experiments": 4}
MODELS = ("kvmodels.llama", "kvmodels.gptj", "kvmodels.mpt", "kvmodels.lckv")


def _modules() -> dict[str, Path]:
    out = {}
    for root, tops in ((SRC, LEVEL), (ROOT, RESEARCH)):
        for top in tops:
            for path in sorted((root / top).rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                out[name] = path
    return out


def imports(path: Path, module: str) -> list[tuple[str, int]]:
    """``(imported name, line)`` for every import in ``path``: ``a.b`` for ``import a.b``, ``a.b.c`` for
    ``from a.b import c`` (relative imports resolved against ``module``)."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return found


def violations() -> list[str]:
    bad = []
    level = LEVEL | RESEARCH
    for module, path in _modules().items():
        top = module.split(".")[0]
        for name, line in imports(path, module):
            other = name.split(".")[0]
            if other not in level or other == top:
                continue
            where = f"{module} (line {line}) imports {name}"
            if top in LEVEL and other in RESEARCH:
                bad.append(f"{where}: the library imports research code ({other}/, outside src/)")
            elif level[other] > level[top]:
                bad.append(f"{where}: upward ({top} sits below {other})")
            if top in RESEARCH:
                continue  # research code may use what the library keeps private (e.g. reference rules)
            if any(part.startswith("_") for part in name.split(".")[1:]):
                bad.append(f"{where}: a private name of another package")
            if module in MODELS and other == "kvpolicies":
                bad.append(f"{where}: a model imports kvpolicies (models know no particular policy: they "
                           "offer cache.observe and the cache's policy reads what it needs)")
    return bad


def test_packages_import_downward_only():
    assert violations() == []


def test_the_check_reads_the_library_and_the_research_folders():
    found = _modules()
    assert {"kvkernels.merge", "kvpolicies.compose", "kvmodels.cli", "evals", "evals.sweep",
            "experiments", "experiments.passkey_margins"} <= set(found)
    assert all(name.split(".")[0] in LEVEL | RESEARCH for name in found)


@pytest.mark.parametrize("source, module, expected", [
    ("from kvmodels.cache import PagedKVCache\n", "kvpolicies.compose", "upward"),
    ("from kvkernels._modes import update_scores_ref\n", "kvpolicies.compose", "private"),
    ("from kvkernels.merge import _retained_mask\n", "kvmodels.cache", "private"),
    ("from kvpolicies.budget.squeeze import residual_cos_sim\n", "kvmodels.llama", "particular policy"),
    ("from kvpolicies.base import residual_cos_sim\n", "kvmodels.gptj", "particular policy"),
    ("def f():\n    import kvpolicies\n", "kvkernels.merge", "upward"),
    ("from evals.sweep import Runner\n", "kvmodels.cli", "research"),
    ("def f():\n    from experiments import passkey_margins\n", "kvpolicies.compose", "research"),
    ("import evals.tasks\n", "kvkernels", "research"),
    ("from experiments.adakv_imbalance import kept\n", "evals.sweep", "upward"),
])
def test_the_check_catches(tmp_path, monkeypatch, source, module, expected):
    """Each rule fires on the import it forbids (each of these existed before the layering was fixed)."""
    path = tmp_path / "m.py"
    path.write_text(source)
    monkeypatch.setattr(__import__(__name__), "_modules", lambda: {module: path})
    assert len(violations()) == 1 and expected in violations()[0]
