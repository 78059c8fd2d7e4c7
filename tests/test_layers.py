"""The rooms of the code and which may import which, read from the source (every import, lazy ones too):

    schemas  <-  storage  <-  libraries (stages/generation, sandbox, rl, data, evaluation)  <-  stages  <-  flows
                    ^
                 reports (schemas and storage only)

`flows/runner` (the process runner) imports no Prefect, like everything below it; no module imports the
tests; no two modules import each other, directly or round a longer cycle. docs/architecture.md draws it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "storage", "stages", "flows", "reports")
LIBRARIES = ("generation", "sandbox", "rl", "data", "evaluation")


def room(module: str) -> str:
    """The room a module lives in: a top-level package, `libraries` (the engines the stages use),
    `flows.runner`, or `tests` / `benchmarks` / `third-party`."""
    parts = module.split(".")
    if parts[0] == "stages" and len(parts) > 1 and parts[1] in LIBRARIES:
        return "libraries"
    if parts[:2] == ["flows", "runner"]:
        return "flows.runner"
    if parts[0] in (*PACKAGES, "tests", "benchmarks"):
        return parts[0]
    return "third-party"


# Which rooms each room may import, besides itself and third-party code.
ALLOWED = {
    "schemas": set(),
    "storage": {"schemas"},
    "libraries": {"schemas", "storage"},
    "stages": {"schemas", "storage", "libraries"},
    "flows.runner": {"schemas", "storage", "libraries", "stages"},
    "flows": {"schemas", "storage", "libraries", "stages", "flows.runner", "reports"},
    "reports": {"schemas", "storage"},
}
NO_PREFECT = ("schemas", "storage", "libraries", "stages", "flows.runner", "reports")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function (relative imports resolved)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


MODULES = project_modules()


def project_imports(module: str) -> set[str]:
    return {name for name in imports_of(MODULES[module]) if name in MODULES and name != module}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_the_rooms_below_it(module: str) -> None:
    own = room(module)
    names = {name for name in imports_of(MODULES[module]) if name.rpartition(".")[0] not in MODULES}  # no symbols
    wrong = sorted(f"{name} ({room(name)})" for name in names if room(name) not in {own, "third-party", *ALLOWED[own]})
    assert not wrong, f"{module} ({own}) imports {', '.join(wrong)}; it may import {sorted(ALLOWED[own])}"
    if own in NO_PREFECT:
        prefect = sorted(name for name in imports_of(MODULES[module]) if name.split(".")[0] == "prefect")
        assert not prefect, f"{module} ({own}) imports {prefect}: only the flow side may import Prefect"


def test_no_module_imports_another_that_imports_it_back() -> None:
    graph = {module: project_imports(module) for module in MODULES}
    # A package's __init__ importing its own submodules is how packages re-export; not a cycle of design.
    for module in graph:
        graph[module] = {name for name in graph[module] if not (MODULES[name].name == "__init__.py"
                                                                and module.startswith(name + "."))}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the path, 2 finished

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for name in sorted(graph[module]):
            if state.get(name) == 1:
                cycles.append([*path[path.index(name):], name])
            elif name not in state:
                visit(name, [*path, name])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_the_rooms_are_what_the_scan_thinks_they_are() -> None:
    """The scan itself: a room is found for a known module of each kind, and a known upward import is caught
    by the rule (so the tests above could fail)."""
    assert room("stages.rl.losses") == "libraries" and room("stages.harness") == "stages"
    assert room("flows.runner.forkserver") == "flows.runner" and room("flows.cli.commands") == "flows"
    assert "stages" not in ALLOWED["storage"] and "flows" not in ALLOWED["flows.runner"]
    assert "schemas.config" in project_imports("storage.layout")
