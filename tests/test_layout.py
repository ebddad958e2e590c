"""The layout (README.md, "Files"): the root holds the minimal core, and imports point down only.

    entry points   train.py eval_lambada.py analyze_layers.py sample.py, tools/*, study/*
    library        lab/*
    loading        load_pythia.py (model and data only), data/*
    core           model.py (torch only)
"""

import ast
from pathlib import Path

from conftest import ROOT

ROOT_SCRIPTS = {"train", "eval_lambada", "analyze_layers", "sample"}
PACKAGES = ("lab", "tools", "study", "data")


def project_modules() -> dict[str, Path]:
    """Every project module by its import name (lab.checkpoint, tools.bench, model, ...)."""
    root = Path(ROOT)
    modules = {p.stem: p for p in root.glob("*.py")}
    for package in PACKAGES:
        for p in (root / package).glob("*.py"):
            if p.stem != "__init__":
                modules[f"{package}.{p.stem}"] = p
    return modules


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports anywhere in it (function-local imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, set(modules)) for name, path in modules.items()}


def test_the_root_holds_the_core_only():
    assert {p.stem for p in Path(ROOT).glob("*.py")} == ROOT_SCRIPTS | {"model", "load_pythia"}


def test_imports_point_down():
    graph = import_graph()
    assert graph["model"] == set()
    assert {m.split(".")[0] for m in graph["load_pythia"]} <= {"model", "data"}
    for name, deps in graph.items():
        if name.startswith("data."):
            assert all(d.startswith("data.") for d in deps), (name, deps)
        if name.startswith("lab."):
            assert not {d for d in deps if d in ROOT_SCRIPTS or d.startswith(("tools.", "study."))}, (name, deps)
    entry_points = ROOT_SCRIPTS | {n for n in graph if n.startswith("tools.")}
    importers = {n: sorted(m for m, deps in graph.items() if n in deps) for n in entry_points}
    assert all(not who for who in importers.values()), importers
    assert not any(d.startswith("study.") for n, deps in graph.items() if not n.startswith("study.") for d in deps)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A chain of imports that comes back to where it started, or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        for dep in sorted(graph[name]):
            cycle = visit(dep, path + [name])
            if cycle:
                return cycle
        done.add(name)
        return None

    return next((c for c in (visit(n, []) for n in sorted(graph)) if c), None)


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_the_cycle_check_sees_a_cycle():
    """As lab.checkpoint <-> load_pythia once were (through a function-local import)."""
    graph = {"lab.checkpoint": {"load_pythia", "model"}, "load_pythia": {"lab.checkpoint"}, "model": set()}
    assert find_cycle(graph) == ["lab.checkpoint", "load_pythia", "lab.checkpoint"]
