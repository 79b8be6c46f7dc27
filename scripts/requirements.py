"""Print the project's pinned requirements for some extras, one per line, from
pyproject.toml alone (no source tree, no build), so that the Dockerfile can
install the dependencies in a layer of their own before the source is copied.

    python3 scripts/requirements.py engine > requirements.txt

The base dependencies come first; an extra that names this project
(`opara-triton[engine]`) is expanded. Standard library only (Python >= 3.11).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extras: list[str], pyproject: Path = PYPROJECT) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    self_ref = re.compile(rf"{re.escape(project['name'])}\[([\w,-]+)\]")
    found: list[str] = []

    def add(items: list[str]) -> None:
        for item in items:
            match = self_ref.fullmatch(item.replace(" ", ""))
            if match:
                for extra in match.group(1).split(","):
                    add(optional[extra])
            elif item not in found:
                found.append(item)

    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"error: no extra {', '.join(unknown)} in {pyproject} (extras: {', '.join(optional)})")
    add(project.get("dependencies", []))
    for extra in extras:
        add(optional[extra])
    return found


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
