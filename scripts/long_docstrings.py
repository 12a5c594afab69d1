"""List the docstrings of N or more lines (default 20), longest first: a docstring says why in a sentence
or two and links to docs/ARCHITECTURE.md for the rest.

    python scripts/long_docstrings.py [N]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("netstorm", "node", "scheduler", "bpf", "scripts", "examples")


def long_docstrings(minimum: int) -> list[tuple[int, str, int, str]]:
    """(lines, file, line, name) of every module, class and function docstring of ``minimum``+ lines."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                first = node.body[0] if node.body else None
                if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                        and isinstance(first.value.value, str) and first.end_lineno is not None):
                    lines = first.end_lineno - first.lineno + 1
                    if lines >= minimum:
                        found.append((lines, str(path.relative_to(ROOT)), first.lineno,
                                      getattr(node, "name", "<module>")))
    return sorted(found, reverse=True)


if __name__ == "__main__":
    rows = long_docstrings(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
    for lines, path, line, name in rows:
        print(f"{lines:4d}  {path}:{line}  {name}")
    sys.exit(1 if rows else 0)
