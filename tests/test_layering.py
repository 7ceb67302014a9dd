"""The house's rules, read from the source (docs/architecture.md): imports run downward only, and the
cross-task report knows no benchmark by name.

Every import counts, the ones inside functions too (a lazy import is still a dependency: the old
report.py <-> report_figures.py circle was one). Nothing is imported here; the modules are parsed.
"""

from __future__ import annotations

import ast
from pathlib import Path

from harness import REPO_ROOT
from harness.tasks import TASKS

PACKAGES = ("harness", "metrics")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO_ROOT / pkg).rglob("*.py"))}


def imported(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The project modules `path` (module `name`) imports, wherever in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(path, name, known) for name, path in known.items()}


def reachable(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in g.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_no_import_circle():
    assert cycles(graph()) == []


def test_tasks_never_reach_the_report_or_the_app():
    g = graph()
    for name in g:
        if under(name, "harness.tasks"):
            bad = sorted(m for m in reachable(g, name) if under(m, "harness.report") or m in ("harness.app", "harness.__main__"))
            assert not bad, f"{name} imports (through its imports) {bad}"


def test_methods_and_generation_never_reach_tasks_or_report():
    g = graph()
    for name in g:
        if under(name, "harness.methods") or under(name, "harness.generation"):
            bad = sorted(m for m in reachable(g, name) if under(m, "harness.tasks") or under(m, "harness.report")
                         or m == "harness.app")
            assert not bad, f"{name} imports (through its imports) {bad}"


def test_bottom_modules_import_nothing_above_them():
    """The table helpers and run records sit under every report section: they import nothing from harness."""
    g = graph()
    for name in ("harness.tables", "harness.results", "harness.stats"):
        assert not {m for m in g[name] if under(m, "harness")}, name


def test_metrics_import_nothing_from_harness():
    g = graph()
    for name, deps in g.items():
        if under(name, "metrics"):
            assert not [m for m in deps if under(m, "harness")], name


def test_the_cross_task_report_names_no_benchmark():
    """No string literal of harness/report/ equals a registered task name: each benchmark's tables, pairing and
    claims come from its own folder through the registry (harness.tasks.task_reports)."""
    names = set(TASKS)
    found = []
    report = sorted((REPO_ROOT / "harness" / "report").rglob("*.py"))
    assert report, "harness/report/ holds the cross-task report"
    for path in report:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert not found, found


def test_every_registered_task_has_its_folder():
    for name, module in TASKS.items():
        parts = module.split(".")
        assert parts[:2] == ["harness", "tasks"] and len(parts) == 4 and parts[3] == "task", (name, module)
        assert (REPO_ROOT / "harness" / "tasks" / parts[2] / "task.py").is_file(), name
