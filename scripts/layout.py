"""The import structure of the project's packages, checked: ``python scripts/layout.py``.

Reads every module of ``tlt_serve/``, ``trainer/`` and ``clients/`` (imports anywhere in a
file, inside functions and ``TYPE_CHECKING`` blocks too: a deferred import is still a
dependency) and checks:

- no circle among modules;
- no circle among packages (a folder is one package; a module directly under ``tlt_serve/``
  is one of its own, since the root package holds everything);
- the front end (``tlt_serve.server``) reaches an engine only through ``tlt_serve.backends``
  itself (its registry), never a backend's insides, and no backend imports the front end.

Prints files and lines per folder, the package graph, and every violation; exits 1 on any.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOTS = ("tlt_serve", "trainer", "clients")
FRONT_END = "tlt_serve.server"
BACKENDS = "tlt_serve.backends"


def module_name(path: Path, top: Path) -> str:
    parts = list(path.relative_to(top).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(top: Path) -> dict[str, Path]:
    found = {}
    for root in ROOTS:
        for path in sorted((top / root).rglob("*.py")):
            found[module_name(path, top)] = path
    return found


def imports_of(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The project's modules ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``
    when ``mod`` is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" for a in node.names]
            # ``from pkg import mod`` imports pkg.mod (and runs pkg's face, when it has one)
            targets = [n for n in names if n in known] or [base]
            if base in known:
                targets.append(base)
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def package_of(module: str, known: dict[str, Path]) -> str:
    """A folder is a package; a module right under ``tlt_serve/`` (not a folder) is its own."""
    if known[module].name == "__init__.py":
        return module
    parent = module.rpartition(".")[0]
    return module if parent == "tlt_serve" else parent


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(top: Path) -> tuple[list[str], dict[str, set[str]]]:
    known = modules(top)
    graph = {m: imports_of(p, m, known) for m, p in known.items()}
    problems = []
    for scc in cycles(graph):
        problems.append("modules import each other: " + " <-> ".join(scc))
    packages: dict[str, set[str]] = defaultdict(set)
    for m, targets in graph.items():
        src = package_of(m, known)
        packages[src]  # every package is a node, even one that imports nothing
        for t in targets:
            dst = package_of(t, known)
            if dst != src:
                packages[src].add(dst)
    for scc in cycles(packages):
        problems.append("packages import each other: " + " <-> ".join(scc))
    for m, targets in graph.items():
        for t in targets:
            if _within(m, FRONT_END) and _within(t, BACKENDS) and t != BACKENDS:
                problems.append(f"{m} imports {t}: the front end reaches engines only "
                                f"through {BACKENDS}")
            if _within(m, BACKENDS) and _within(t, FRONT_END):
                problems.append(f"{m} imports {t}: a backend imports the front end")
    return problems, packages


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def sizes(top: Path) -> list[tuple[str, int, int]]:
    """(folder, files, lines) of every folder holding Python files, project-wide."""
    count: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for root in (*ROOTS, "tests", "benchmarks", "scripts"):
        for path in (top / root).rglob("*.py"):
            folder = str(path.parent.relative_to(top))
            count[folder][0] += 1
            count[folder][1] += len(path.read_text().splitlines())
    return sorted((k, v[0], v[1]) for k, v in count.items())


def main() -> int:
    top = Path(__file__).resolve().parent.parent
    print("folder files lines")
    for folder, files, lines in sizes(top):
        print(f"  {folder} {files} {lines}")
    problems, packages = violations(top)
    print("packages and what they import:")
    for pkg in sorted(packages):
        print(f"  {pkg} -> {', '.join(sorted(packages[pkg])) or '-'}")
    for p in problems:
        print("VIOLATION:", p)
    print(f"{len(problems)} violations")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
