"""The one dependency rule, enforced on the source: planning imports no torch and
nothing above it; the engine never imports serving; nothing imports the tools on top.

Every import statement counts, including those inside functions (a lazy import
still ties the layers together)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "opara_core"

# layer -> module prefixes it must never import
FORBIDDEN = {
    "planning": ("torch", "opara_core.engine", "opara_core.serving", "opara_core.zoo", "opara_core.models", "opara_core.bench"),
    "engine": ("opara_core.serving", "opara_core.bench", "opara_core.__main__"),
    "serving": ("opara_core.bench", "opara_core.__main__"),
}


def imports(path: Path) -> list[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def violations(layer: str) -> list[str]:
    found = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in imports(path):
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[layer]):
                found.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_layer_imports_above_itself(layer):
    assert (PACKAGE / layer).is_dir()
    assert violations(layer) == []


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    """The rule itself can fail: a planning module that imports torch inside a function."""
    fake = tmp_path / "opara_core"
    (fake / "planning").mkdir(parents=True)
    (fake / "planning" / "bad.py").write_text("def f():\n    from ..engine import capture\n    import torch.fx\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert violations("planning") == [
        "opara_core/planning/bad.py imports opara_core.engine",
        "opara_core/planning/bad.py imports opara_core.engine.capture",
        "opara_core/planning/bad.py imports torch.fx",
    ]


def test_planning_and_the_plan_cli_run_without_torch():
    code = (
        "import sys\n"
        "import opara_core.planning.dag, opara_core.planning.order, opara_core.planning.plan, opara_core.planning.policies, opara_core.planning.iteration, opara_core.__main__\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
