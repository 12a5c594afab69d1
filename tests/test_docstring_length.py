"""Docstrings say why in a sentence or two and link to docs/ARCHITECTURE.md for the rest: none reaches 20 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("netstorm", "node", "scheduler", "bpf")
LIMIT = 20


def test_no_docstring_in_the_code_reaches_twenty_lines() -> None:
    long = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    doc = ast.get_docstring(node, clean=False)
                    if doc is not None and doc.count("\n") + 1 >= LIMIT:
                        long.append(f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')} "
                                    f"({doc.count(chr(10)) + 1} lines)")
    assert not long, "docstrings of 20+ lines (make them a sentence or two and a link): " + ", ".join(long)
