#!/usr/bin/env python3
"""The shape of the services' and libraries' code: what issue #19 measures before and after.

    python scripts/code_shape.py [ROOT] [--top N] [--json]

Counts over ``services/*/src`` and ``libs/*/src`` (tests and benches excluded): the largest classes
(lines, methods) and functions (lines), functions over 60 lines, ``# type: ignore`` comments and broad
``except`` clauses (bare ``except:``, ``except Exception``, ``except BaseException``; those that re-raise are
counted apart, since they only clean up).

    python scripts/code_shape.py --check

fails (exit 1, naming each) when a class is over 300 lines or a function over 80: the limits issue #31 set for
services/ and libs/, which ``make lint`` (and so ``make test``) holds.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

BROAD = {"Exception", "BaseException"}
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80


def sources(root: Path) -> list[Path]:
    return sorted(p for base in ("services", "libs") for p in (root / base).glob("*/src/**/*.py"))


def _is_broad(handler: ast.ExceptHandler) -> bool:
    t = handler.type
    if t is None:
        return True
    names = t.elts if isinstance(t, ast.Tuple) else [t]
    return any(isinstance(n, ast.Name) and n.id in BROAD for n in names)


def _reraises(handler: ast.ExceptHandler) -> bool:
    return any(isinstance(node, ast.Raise) for node in ast.walk(handler))


def measure(root: Path) -> dict[str, object]:
    classes, functions = [], []
    ignores = broad = broad_reraise = 0
    for path in sources(root):
        text = path.read_text()
        rel = str(path.relative_to(root))
        ignores += text.count("type: ignore")
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body)
                classes.append((node.end_lineno - node.lineno + 1, methods, f"{rel}:{node.lineno} {node.name}"))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
            elif isinstance(node, ast.ExceptHandler) and _is_broad(node):
                if _reraises(node):
                    broad_reraise += 1
                else:
                    broad += 1
    classes.sort(reverse=True)
    functions.sort(reverse=True)
    return {"files": len(sources(root)), "type_ignores": ignores, "broad_excepts": broad,
            "broad_excepts_that_reraise": broad_reraise,
            "functions_over_60_lines": sum(1 for n, _ in functions if n > 60),
            "classes": classes, "functions": functions}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", default=".", type=Path, help="the repository (default: here)")
    parser.add_argument("--top", type=int, default=5, help="how many of the largest classes and functions")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--check", action="store_true",
                        help=f"fail on a class over {MAX_CLASS_LINES} lines or a function over {MAX_FUNCTION_LINES}")
    args = parser.parse_args(argv)
    m = measure(args.root)
    if args.check:
        return check(m)
    top = {**m, "classes": m["classes"][: args.top], "functions": m["functions"][: args.top]}
    if args.json:
        json.dump(top, sys.stdout, indent=2)
        print()
        return 0
    print(f"{m['files']} files: {m['type_ignores']} type: ignore, {m['broad_excepts']} broad except "
          f"(+{m['broad_excepts_that_reraise']} that re-raise), {m['functions_over_60_lines']} functions over 60 lines")
    print("largest classes:")
    for lines, methods, where in top["classes"]:
        print(f"  {lines:5d} lines {methods:3d} methods  {where}")
    print("largest functions:")
    for lines, where in top["functions"]:
        print(f"  {lines:5d} lines  {where}")
    return 0


def check(m: dict[str, Any]) -> int:
    over = [f"class {where}: {lines} lines (limit {MAX_CLASS_LINES})"
            for lines, _, where in m["classes"] if lines > MAX_CLASS_LINES]
    over += [f"function {where}: {lines} lines (limit {MAX_FUNCTION_LINES})"
             for lines, where in m["functions"] if lines > MAX_FUNCTION_LINES]
    for line in over:
        print(line, file=sys.stderr)
    if over:
        print(f"{len(over)} over the limits: split by concern (docs/design.md §10)", file=sys.stderr)
        return 1
    print(f"code shape: every class ≤ {MAX_CLASS_LINES} lines, every function ≤ {MAX_FUNCTION_LINES}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
