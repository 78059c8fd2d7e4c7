"""The rooms of the code and which may import which, read from the source (every import, lazy ones too):

    schemas  <-  storage  <-  libraries  <-  stages  <-  flows.runner  <-  flows
                    ^
                 reports (schemas and storage only)

The libraries (under stages/) are rooms of their own, in this order (each may import those below it):

    stages/rl  ->  stages/generation  ->  stages/sandbox  <-  stages/data        stages/evaluation

A stage imports no other stage, only the stage room's infrastructure (harness, registry): what two stages
share lives in a library. String imports count too: `import_module("x.y")` and the `python -m x.y` (or
`--module`, or `-c` source) of a command list; a formatted `stages.{…}` names the registry's stage modules.
A module name computed any other way (a user's reward function, a deployment's entrypoint) is not read.
`flows/runner` imports no Prefect, like everything below it; no module imports the tests; no two modules
import each other, directly or round a longer cycle. docs/architecture.md draws it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from stages.registry import STAGES

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "storage", "stages", "flows", "reports")
LIBRARIES = ("generation", "sandbox", "rl", "data", "evaluation")
# What every stage runs in and the table of stages; any stage may import them, and they import no stage.
STAGE_INFRASTRUCTURE = ("stages", "stages.harness", "stages.registry")
# evaluate_base is the evaluate stage run once on the base model: evaluate's `run` under the run-level name.
SAME_STAGE = {"stages.evaluate_base": "stages.evaluate"}
STAGE_MODULES = {f"stages.{name}" for name in STAGES}
# A `python -m` target: after one of these in a command list (`--module` is the DeepSpeed launcher's -m).
MODULE_FLAGS = ("-m", "--module")
IMPORTING_CALLS = ("import_module", "run_module", "__import__")


def room(module: str) -> str:
    """The room a module lives in: a top-level package, one of the libraries (`stages.rl`, ...),
    `flows.runner`, or `tests` / `benchmarks` / `third-party`."""
    parts = module.split(".")
    if parts[0] == "stages" and len(parts) > 1 and parts[1] in LIBRARIES:
        return f"stages.{parts[1]}"
    if parts[:2] == ["flows", "runner"]:
        return "flows.runner"
    if parts[0] in (*PACKAGES, "tests", "benchmarks"):
        return parts[0]
    return "third-party"


BASE = {"schemas", "storage"}
LIBRARY_ROOMS = {f"stages.{library}" for library in LIBRARIES}
# Which rooms each room may import, besides itself and third-party code: every room below it.
ALLOWED = {
    "schemas": set(),
    "storage": {"schemas"},
    "stages.sandbox": BASE,
    "stages.evaluation": BASE,
    "stages.data": BASE | {"stages.sandbox"},  # a math answer is read the way the sandbox grades it
    "stages.generation": BASE | {"stages.sandbox"},  # the agent loop's tool and judge
    "stages.rl": BASE | {"stages.sandbox", "stages.generation"},  # models and devices as generation loads them
    "stages": BASE | LIBRARY_ROOMS,
    "flows.runner": BASE | LIBRARY_ROOMS | {"stages"},
    "flows": BASE | LIBRARY_ROOMS | {"stages", "flows.runner", "reports"},
    "reports": {"schemas", "storage"},
}
NO_PREFECT = ("schemas", "storage", *sorted(LIBRARY_ROOMS), "stages", "flows.runner", "reports")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


MODULES = project_modules()


def spelled_modules(text: ast.JoinedStr) -> set[str]:
    """The modules a formatted string can name, each placeholder one name; `stages.{…}` is a stage of the
    registry (flows/runner/process.py's command, the fork server's preload and `rlpipe stage` build it from
    STAGES). Empty when the string does not start with fixed text (`f"{package}.x"`): nothing to go by."""
    fixed = [part.value if isinstance(part, ast.Constant) else None for part in text.values]
    if fixed[0] is None:
        return set()
    pattern = "".join(re.escape(part) if part is not None else r"[A-Za-z_]\w*" for part in fixed)
    candidates = STAGE_MODULES if fixed == ["stages.", None] else set(MODULES)
    return {module for module in candidates if re.fullmatch(pattern, module)}


def named_modules(node: ast.expr) -> set[str]:
    """What a string expression names as a module: its text, or what a formatted string can spell."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.JoinedStr):
        return spelled_modules(node)
    return set()


def imports_in(tree: ast.AST, package: list[str], started: bool = True) -> set[str]:
    """Every module (or `module.symbol`) `tree` imports: import statements at the top or inside a function
    (relative ones resolved against `package`), `import_module("x")` calls, and with `started` the modules of
    the processes it starts (the `-m x` / `-c "source"` of command lists)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Call) and node.args:
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in IMPORTING_CALLS:
                found.update(named_modules(node.args[0]))
        elif started and isinstance(node, ast.List | ast.Tuple):
            for flag, value in zip(node.elts, node.elts[1:], strict=False):
                if isinstance(flag, ast.Constant) and flag.value in MODULE_FLAGS:
                    found.update(named_modules(value))
                elif (isinstance(flag, ast.Constant) and flag.value == "-c" and isinstance(value, ast.Constant)
                      and isinstance(value.value, str)):
                    found.update(imports_in(ast.parse(value.value), []))
    return found


def imports_of(path: Path, started: bool = True) -> set[str]:
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    return imports_in(ast.parse(path.read_text(), str(path)), package, started)


def module_of(name: str) -> str | None:
    """The project module an imported name is, or holds (`stages.harness.exit_with` -> `stages.harness`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def project_imports(module: str) -> set[str]:
    """The project modules `module` imports in its own process (a program it starts may import it back: the
    reward host imports rewards.py, which starts it)."""
    return {name for name in imports_of(MODULES[module], started=False) if name in MODULES and name != module}


def wrong_imports(module: str, names: set[str]) -> list[str]:
    """The names `module` may not import: a room not below its own, or (a stage) another stage."""
    own = room(module)
    wrong = {f"{name} ({room(name)})" for name in names if room(name) not in {own, "third-party", *ALLOWED[own]}}
    if own == "stages":
        other_stages = {module_of(name) for name in names if room(name) == "stages"} - {module, None}
        wrong |= {f"{name} (a stage)" for name in other_stages
                  if name not in STAGE_INFRASTRUCTURE and name != SAME_STAGE.get(module)}
    return sorted(wrong)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_the_rooms_below_it(module: str) -> None:
    own = room(module)
    wrong = wrong_imports(module, imports_of(MODULES[module]))
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


def test_a_room_may_import_what_the_rooms_it_imports_may() -> None:
    """The order is one order: a room that may import another may import everything below that one too."""
    gaps = {own: sorted(ALLOWED[below] - ALLOWED[own]) for own in ALLOWED for below in ALLOWED[own]
            if ALLOWED[below] - ALLOWED[own]}
    assert not gaps, f"rooms missing what the rooms below them may import: {gaps}"
    assert all(own not in ALLOWED[below] for own in ALLOWED for below in ALLOWED[own]), "two rooms import each other"


def test_the_rooms_are_what_the_scan_thinks_they_are() -> None:
    """The scan itself: a room is found for a known module of each kind, and a known upward import is caught
    by the rule (so the tests above could fail)."""
    assert room("stages.rl.losses") == "stages.rl" and room("stages.harness") == "stages"
    assert room("flows.runner.forkserver") == "flows.runner" and room("flows.cli.commands") == "flows"
    assert "stages" not in ALLOWED["storage"] and "flows" not in ALLOWED["flows.runner"]
    assert "schemas.config" in project_imports("storage.layout")
    assert wrong_imports("storage.layout", {"stages.sandbox.rewards.RewardInput"}) == [
        "stages.sandbox.rewards.RewardInput (stages.sandbox)"]
    assert wrong_imports("stages.sandbox.rewards", {"stages.generation.base"}) == [
        "stages.generation.base (stages.generation)"]
    assert wrong_imports("stages.rl.trainer", {"stages.generation.device.resolve_dtype"}) == []


def test_a_stage_imports_only_the_stage_infrastructure() -> None:
    assert wrong_imports("stages.evaluate", {"stages.score.graded_text", "stages.harness.exit_with"}) == [
        "stages.score (a stage)"]
    assert wrong_imports("stages.harness", {"stages.generate"}) == ["stages.generate (a stage)"]
    assert wrong_imports("stages.evaluate_base", {"stages.evaluate.run", "stages.registry"}) == []
    assert wrong_imports("stages.train", {"stages.evaluate"}) == ["stages.evaluate (a stage)"]


def scanned(source: str, package: str = "storage", started: bool = True) -> set[str]:
    return imports_in(ast.parse(source), package.split("."), started)


def test_string_imports_are_read() -> None:
    """A planted string import is found, so a layer broken through one fails the rule."""
    planted = scanned('import importlib\nmodule = importlib.import_module("stages.generate")\n')
    assert "stages.generate" in planted
    assert wrong_imports("storage.layout", planted) == ["stages.generate (stages)"]
    from_import = 'from importlib import import_module\nimport_module("stages.sandbox.worker")'
    assert "stages.sandbox.worker" in scanned(from_import)
    assert scanned('import_module(name)') == set()  # a computed name is not read


def test_command_lists_name_the_modules_they_start() -> None:
    command = scanned('command = [sys.executable, "-m", "stages.generation.server", "--listen-fd", "3"]')
    assert "stages.generation.server" in command and "--listen-fd" not in command
    assert scanned('command = [sys.executable, "-m", "stages.generation.server"]', started=False) == set()
    assert scanned('subprocess.run(("python", "--module", "flows.runner.forkserver"))') >= {"flows.runner.forkserver"}
    source = scanned('[sys.executable, "-c", "import sys; from stages.sandbox.reward_host import main; main()"]')
    assert {"stages.sandbox.reward_host", "stages.sandbox.reward_host.main"} <= source
    assert wrong_imports("stages.sandbox.sandbox", command) == ["stages.generation.server (stages.generation)"]


def test_a_formatted_stage_target_is_every_stage_of_the_registry() -> None:
    stages = scanned('command = [sys.executable, "-m", f"stages.{target.stage}", "--run", run_id]', "flows.runner")
    assert stages == {f"stages.{name}" for name in STAGES} and "stages.evaluate_base" in stages
    assert "stages.harness" not in stages  # the registry's stages, not every module a name would spell
    assert scanned('importlib.import_module(f"stages.sandbox.{part}")') >= {"stages.sandbox.worker",
                                                                             "stages.sandbox.rewards"}
    assert scanned('importlib.import_module(f"{package}.{name}")') == set()
    assert wrong_imports("stages.generation.client", stages) == sorted(f"{name} (stages)" for name in stages)
