"""Layering: flows → tasks → eaglet; the core never imports Prefect, tasks or flows, not even
inside a function; no import cycle among the project's modules, counting
the imports inside functions too. The import graph is read from the source with `ast`.
The tests themselves, read the same way: no test module imports another, and a test that
asserts on a clock difference is marked `serial`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The project's packages, each in the folder its name spells (eaglet_prefect/tasks is a link
# to the repository's tasks/: eaglet_prefect/__init__.py) -> its layer's name.
PACKAGES = {
    "eaglet": "core",
    "eaglet_prefect.tasks": "tasks",
    "eaglet_prefect.flows": "flows",
    "eaglet_prefect.deployments": "deployments",
    # the Prefect blocks the tasks and the CLI read (a module, not a package): to the core, and
    # to these tests, it is Prefect
    "eaglet_prefect.blocks": "prefect",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_name(path): path
    for package in PACKAGES
    for path in ROOT.joinpath(*package.split(".")).rglob("*.py")
}


def layer(name: str) -> str:
    """core, tasks, flows, deployments or prefect: where a module sits (other: its root)."""
    for package, layer_name in PACKAGES.items():
        if name == package or name.startswith(package + "."):
            return layer_name
    return name.split(".")[0]


def imports_of(name: str, top_level_only: bool = False) -> set[str]:
    """Every module `name` imports (project or not), relative imports resolved, `from pkg
    import mod` read as `pkg.mod` when that is a module."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else ast.walk(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            submodules = (f"{module}.{alias.name}" for alias in node.names)
            found.update(m for m in submodules if m in MODULES)
    return found


def project_graph() -> dict[str, set[str]]:
    return {name: {m for m in imports_of(name) if m in MODULES} - {name} for name in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def roots(names: set[str]) -> set[str]:
    return {layer(n) for n in names}


def test_no_import_cycle_among_the_projects_modules():
    assert find_cycle(project_graph()) is None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_never_imports_prefect_tasks_or_flows():
    offenders = {
        name: roots(imports_of(name)) & {"prefect", "tasks", "flows", "deployments"}
        for name in MODULES
        if layer(name) == "core"
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_cli_imports_prefect_tasks_and_the_flow_only_inside_functions():
    """`eaglet inspect` and `eaglet --help` start without loading Prefect or the flow."""
    top_level = imports_of("eaglet_prefect.flows.cli", top_level_only=True)
    assert not roots(top_level) & {"prefect", "tasks"}
    assert "eaglet_prefect.flows.pipeline" not in top_level
    server = imports_of("eaglet_prefect.flows.prefect_server", top_level_only=True)
    assert not roots(server) & {"prefect"}


# What a command of the CLI may not import, even inside a function: the CLI is a layer over
# core functions and the flow, which wires the tasks.
NOT_FOR_THE_CLI = ("eaglet_prefect.tasks", "eaglet.stage_bodies", "eaglet.fixture")
# `eaglet fixture-model` builds the fixture models: that package is its subject.
CLI_EXCEPTIONS = {("eaglet_prefect.flows.commands.fixture_model", "eaglet.fixture")}


def test_the_cli_imports_no_task_stage_body_or_fixture_module():
    """`eaglet doctor` reads a secret through `eaglet_prefect.blocks`, `eaglet run` and `demo`
    leave the demo's inputs to the flow's demo-setup task: no command reaches into a task, a
    stage's body or the fixtures (but the command that builds fixtures)."""
    cli = [n for n in MODULES if n == "eaglet_prefect.flows.cli" or ".flows.commands" in n]
    assert "eaglet_prefect.flows.commands.run" in cli
    found = sorted(
        f"{name} imports {module}"
        for name in cli
        for module in imports_of(name)
        for banned in NOT_FOR_THE_CLI
        if (module == banned or module.startswith(banned + "."))
        and (name, banned) not in CLI_EXCEPTIONS
    )
    assert found == []


def test_tasks_never_import_flows():
    offenders = {n: imports_of(n) for n in MODULES if layer(n) == "tasks"}
    assert {k for k, v in offenders.items() if "flows" in roots(v)} == set()


LINKED = ("flows", "tasks", "deployments")  # eaglet_prefect/<name> -> ../<name>


def test_the_prefect_side_is_linked_into_eaglet_prefect_by_relative_symlinks():
    """A clone's eaglet_prefect/flows, tasks, deployments are relative links to the top-level
    folders (so a copy or a move of the clone keeps them), not copies and not a `__path__`
    trick that only the interpreter follows."""
    import os

    for name in LINKED:
        link = ROOT / "eaglet_prefect" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", link
        assert link.resolve() == ROOT / name
    assert "__path__" not in (ROOT / "eaglet_prefect" / "__init__.py").read_text()


def test_every_project_import_names_a_file_path_that_exists():
    """Static resolution, as pyright or go-to-definition does it: each `eaglet*` module that
    the code, tests and benchmarks import is `<its name's path>.py` or its `__init__.py` under
    the repository root (through the links), and nothing imports a bare `flows`, `tasks` or
    `deployments`."""

    def is_file(module: str) -> bool:
        base = ROOT.joinpath(*module.split("."))
        return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()

    folders = ("eaglet", *LINKED, "tests", "benchmarks")
    unresolved, bare = [], []
    for path in sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue  # relative imports: their folder is the file's own
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            bare += [f"{where} {n}" for n in names if n.split(".")[0] in LINKED]
            unresolved += [
                f"{where} {n}" for n in names if n.split(".")[0] in {"eaglet", "eaglet_prefect"}
                and not is_file(n)
            ]  # fmt: skip
    assert unresolved == [] and bare == [], (unresolved, bare)


def test_no_engine_imports_another_engine():
    """The registry builds engines by module path; the HTTP base never imports its subclasses."""
    from eaglet.engines.registry import ENGINES

    engine_modules = {spec.module for spec in ENGINES.values()}
    graph = project_graph()
    assert not graph["eaglet.engines.registry"] & engine_modules
    for module in engine_modules | {"eaglet.engines.http"}:
        assert not (graph[module] & engine_modules) - {module}, module


ADD_A_METHOD = r"""
import sys
from eaglet.cache import stage_modules
from eaglet.config import load_config
from eaglet.draft.methods import METHODS, draft_method

config = load_config(None, ["train.method=toy"])
method = draft_method("toy")
assert method.name == "toy", method.name
assert "eaglet.draft.methods.toy" in stage_modules("train", config)
assert "eaglet.draft.methods.toy" not in stage_modules("train", load_config(None, []))
print("ok", sorted(METHODS))
"""


def test_adding_a_draft_method_is_its_module_and_one_registry_line(tmp_path):
    """In a copy of the project: a module for a new method and one line in the registry make
    it a `train.method` choice, the trainer's, and a key of the train stage's code."""
    import shutil
    import subprocess
    import sys

    shutil.copytree(
        ROOT / "eaglet", tmp_path / "eaglet", ignore=shutil.ignore_patterns("__pycache__")
    )
    methods = tmp_path / "eaglet" / "draft" / "methods"
    (methods / "toy.py").write_text(
        '"""A toy method: EAGLE-3 under another name."""\n'
        "from eaglet.draft.methods.eagle3 import Eagle3Method\n\n\n"
        'class ToyMethod(Eagle3Method):\n    name = "toy"\n\n\nMETHOD = ToyMethod()\n'
    )
    registry = methods / "registry.py"
    text = registry.read_text()
    line = '    "dflash": "eaglet.draft.methods.dflash",\n'
    assert line in text
    registry.write_text(text.replace(line, line + '    "toy": "eaglet.draft.methods.toy",\n'))
    result = subprocess.run(
        [sys.executable, "-c", ADD_A_METHOD], cwd=tmp_path, capture_output=True, text=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ok ['dflash', 'dspark', 'eagle3', 'peagle', 'toy']")


def test_the_method_seam_names_no_any():
    """What the trainer and evaluator hand a method, and what it gives back, is typed: no
    `Any` in the seam module (the type checker in `make lint` checks each method against it),
    and each method module's `METHOD` is declared a `DraftMethod` so that it is checked."""
    base = ROOT / "eaglet" / "draft" / "methods" / "base.py"
    tree = ast.parse(base.read_text(encoding="utf-8"))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "Any" not in names
    from eaglet.draft.methods import METHODS

    for module in METHODS.values():
        path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
        source = path.read_text(encoding="utf-8")
        assert re.search(r"^METHOD: DraftMethod = ", source, re.M), module


# --- the tests themselves: each test module stands alone; a bound on seconds runs alone --------

TESTS = ROOT / "tests"
TEST_FILES = {
    ".".join(path.relative_to(ROOT).with_suffix("").parts): path
    for path in sorted(TESTS.rglob("*.py"))
}
TEST_MODULES = {name for name in TEST_FILES if name.rpartition(".")[2].startswith("test_")}


def modules_imported_by(name: str) -> set[str]:
    """Every module the file `name` under tests/ imports, inside functions too, relative
    imports resolved, `from pkg import mod` read as `pkg.mod` as well."""
    path = TEST_FILES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_no_test_module_imports_another_test_module():
    """Each test module stands alone (issue 35): what test modules share is in a helper module
    (tests/*_helpers.py, fake_servers.py, ...) or, for fixtures, in a conftest.py. No file under
    tests/ imports a test module (file name test_*.py), not even inside a function."""
    offenders = {
        name: sorted(modules_imported_by(name) & TEST_MODULES - {name}) for name in TEST_FILES
    }
    assert {name: found for name, found in offenders.items() if found} == {}


CLOCKS = {"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "time", "time_ns"}


def is_clock_call(node: ast.AST) -> bool:
    """`time.monotonic()`, `time.time()`, `time.perf_counter()` (or `monotonic()` imported)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr in CLOCKS and isinstance(func.value, ast.Name) and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id in CLOCKS - {"time"}


def holds_clock_difference(node: ast.AST) -> bool:
    """`node` holds a subtraction of a clock reading and another time (elapsed or remaining
    seconds), not of a constant (`time.time() - 5` is a moment, not a duration)."""
    return any(
        isinstance(sub, ast.BinOp)
        and isinstance(sub.op, ast.Sub)
        and not any(isinstance(side, ast.Constant) for side in (sub.left, sub.right))
        and any(is_clock_call(n) for side in (sub.left, sub.right) for n in ast.walk(side))
        for sub in ast.walk(node)
    )


class ClockBounds:
    """Which functions of one test file assert on a clock difference: in the assert itself,
    through a name bound to one (assignments followed within the function), through a name
    unpacked from the matching position of what a function of the same file returns, or by
    calling a function of the same file that does. Values kept in containers are followed
    only as whole values (a dict holding seconds makes every assert on that dict count)."""

    def __init__(self, tree: ast.Module):
        self.functions = {
            node.name: node
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        self.returns: dict[str, set[int | None]] = {}  # name -> timed positions (None: all)
        self.timed: dict[str, set[str]] = {name: set() for name in self.functions}
        changed = True
        while changed:  # to a fixed point: functions return what other functions timed
            changed = False
            for name, function in self.functions.items():
                timed = self.timed_names(function)
                returns = self.timed_returns(function, timed)
                if timed != self.timed[name] or returns != self.returns.get(name, set()):
                    self.timed[name], self.returns[name], changed = timed, returns, True
        self.asserting = {
            name
            for name, function in self.functions.items()
            if any(
                isinstance(node, ast.Assert) and self.is_timed(node.test, self.timed[name])
                for node in ast.walk(function)
            )
        }
        changed = True
        while changed:
            changed = False
            for name, function in self.functions.items():
                if name not in self.asserting and self.calls(function) & self.asserting:
                    self.asserting.add(name)
                    changed = True

    def calls(self, function: ast.AST) -> set[str]:
        return {
            node.func.id
            for node in ast.walk(function)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        }

    def is_timed(self, node: ast.AST, timed: set[str]) -> bool:
        if holds_clock_difference(node):
            return True
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id in timed:
                return True
            if (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Name)
                and None in self.returns.get(sub.func.id, set())
            ):
                return True
        return False

    def timed_names(self, function: ast.AST) -> set[str]:
        timed: set[str] = set()
        changed = True
        while changed:
            changed = False
            for node in ast.walk(function):
                if isinstance(node, ast.Assign):
                    targets, value = node.targets, node.value
                elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
                    targets, value = [node.target], node.value
                else:
                    continue
                if value is None:
                    continue
                new = set()
                for target in targets:
                    positions = (
                        self.returns.get(value.func.id, set())
                        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                        else set()
                    )
                    if isinstance(target, ast.Tuple) and positions and None not in positions:
                        new |= {
                            element.id
                            for i, element in enumerate(target.elts)
                            if i in positions and isinstance(element, ast.Name)
                        }
                    elif self.is_timed(value, timed):
                        new |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
                if new - timed:
                    timed |= new
                    changed = True
        return timed

    def timed_returns(self, function: ast.AST, timed: set[str]) -> set[int | None]:
        positions: set[int | None] = set()
        for node in ast.walk(function):
            if not isinstance(node, ast.Return) or node.value is None:
                continue
            if isinstance(node.value, ast.Tuple):
                elements = enumerate(node.value.elts)
                positions |= {i for i, e in elements if self.is_timed(e, timed)}
            elif self.is_timed(node.value, timed):
                positions.add(None)
        return positions


def marks_serial(decorators_or_value: list[ast.AST]) -> bool:
    """A `pytest.mark.serial` among decorators or in a `pytestmark` value."""
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "serial"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        for item in decorators_or_value
        for node in ast.walk(item)
    )


def module_pytestmark(body: list[ast.stmt]) -> list[ast.AST]:
    return [
        node.value
        for node in body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
    ]


def unmarked_clock_bounds(tree: ast.Module) -> list[str]:
    """The test functions of a test module that assert on a clock difference and are not
    marked `serial` (on the function, its class, or the module's `pytestmark`)."""
    bounds = ClockBounds(tree)
    if marks_serial(module_pytestmark(tree.body)):
        return []
    found = []
    scopes = [(tree.body, [])] + [
        (node.body, node.decorator_list + module_pytestmark(node.body))
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    ]
    for body, marks in scopes:
        for node in body:
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.name.startswith("test")
                and node.name in bounds.asserting
                and not marks_serial(marks + node.decorator_list)
            ):
                found.append(node.name)
    return found


def test_a_test_that_bounds_seconds_is_marked_serial():
    """`make test` runs the `serial` tests alone, after the parallel part: a test asserting on
    a `time.monotonic()` / `time.time()` difference must be one of them, or a busy neighbour
    decides its outcome."""
    offenders = {
        name: found
        for name in sorted(TEST_MODULES)
        if (found := unmarked_clock_bounds(ast.parse(TEST_FILES[name].read_text("utf-8"))))
    }
    assert offenders == {}


def holds_a_serial_test(tree: ast.Module) -> bool:
    """A `serial` mark anywhere in a module: its `pytestmark`, a class's or a function's."""
    decorated = [
        node.decorator_list
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    return marks_serial(module_pytestmark(tree.body)) or any(map(marks_serial, decorated))


def test_make_finds_every_module_that_holds_a_serial_test():
    """`make test` and `make test-fast` collect the serial part from the modules their grep
    finds (`SERIAL_FILES`); a module it missed would have its serial tests run by neither part."""
    makefile = (ROOT / "Makefile").read_text()
    (pattern,) = re.findall(r"^SERIAL_FILES = \$\(shell grep -rlE '([^']+)' tests", makefile, re.M)
    serial_runs = [
        line for line in makefile.splitlines() if re.search(r'-m (serial|".* and serial")', line)
    ]
    assert len(serial_runs) == 2 and all("$(SERIAL_FILES)" in line for line in serial_runs)
    holding = {n for n in TEST_MODULES if holds_a_serial_test(ast.parse(TEST_FILES[n].read_text()))}
    found = {n for n in TEST_MODULES if re.search(pattern, TEST_FILES[n].read_text())}
    assert holding and holding <= found, sorted(holding - found)


CLOCK_BOUNDS = """
import time
import pytest

def timed_call():
    started = time.monotonic()
    return 0, time.monotonic() - started

def test_direct():
    started = time.monotonic()
    assert time.monotonic() - started < 2

def test_through_a_name():
    started = time.time()
    seconds = time.time() - started
    assert seconds < 2

def test_through_a_helper():
    code, seconds = timed_call()
    assert code == 0 and seconds < 2

def test_only_the_helpers_other_value():
    code, _ = timed_call()
    assert code == 0

def test_a_moment_is_not_a_duration():
    assert time.time() - 5 < time.time()

@pytest.mark.serial
def test_marked():
    started = time.monotonic()
    assert time.monotonic() - started < 2
"""


def test_the_clock_bound_finder_finds_unmarked_bounds():
    tree = ast.parse(CLOCK_BOUNDS)
    assert unmarked_clock_bounds(tree) == [
        "test_direct",
        "test_through_a_name",
        "test_through_a_helper",
    ]
    serial_module = ast.parse(
        CLOCK_BOUNDS + "\npytestmark = [pytest.mark.slow, pytest.mark.serial]\n"
    )
    assert unmarked_clock_bounds(serial_module) == []


# A stage's facts live in its declaration (eaglet/stages.py) and its body module
# (eaglet/stage_bodies/<stage>.py), plus the package doing its work where it has one; anywhere
# else a stage's name as a string is a branch on that stage that the declaration should answer.
STAGE_PACKAGES = {
    "generate": ("eaglet/engines/",),  # the engines the stage generates with
    "hidden_states": ("eaglet/hidden_states/",),
    "train": ("eaglet/draft/",),  # the draft model, its training and its evaluation
    "evaluate": ("eaglet/draft/",),
}
# Files that still hold stage names and belong to someone else's work in progress: remove
# each entry once the file asks the declaration instead.
ALLOWED_FOR_NOW: dict[str, str] = {}
# Where the product's code is: the core, the tasks, the flows (and CLI), the deployments.
PRODUCT_FOLDERS = ("eaglet", "tasks", "flows", "deployments")
# A string equal to a stage's name that means something else in its place.
NOT_A_STAGE_NAME = {
    ("eaglet/config/datasets.py", "train"): "a dataset's default split",
    # The config's own sections, named like their stages, as keys of its raw data: the demo's
    # evaluate.sets, an older override's flat hidden_states key, resolve_paths' updates.
    ("eaglet/config/pipeline.py", "evaluate"): "the evaluate section's key in a config's data",
    ("eaglet/config/loading.py", "evaluate"): "the evaluate section's key in a config's data",
    ("eaglet/config/loading.py", "hidden_states"): "the hidden_states section's key in its data",
    ("eaglet/datasets.py", "train"): "the dataset split a parquet file's rows load into",
    ("eaglet/fixture/model.py", "train"): "the fixture corpus's random stream",
    ("eaglet/fixture/corpus.py", "train"): "the fixture corpus's random stream",
    ("eaglet/draft/train.py", "hidden_states"): "a key of the train manifest's info",
}


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are statements of their own (docstrings)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def stage_names_in(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each string constant in `source` equal to one of `names`, docstrings
    left out."""
    tree = ast.parse(source)
    skipped = docstrings(tree)
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in names
        and id(node) not in skipped
    )


def stage_may_be_named_in(stage: str, path: str) -> bool:
    return (
        path == "eaglet/stages.py"
        or path == f"eaglet/stage_bodies/{stage}.py"
        or path == f"tasks/{stage}.py"  # a stage's task names its stage
        or path.startswith(STAGE_PACKAGES.get(stage, ()))
        or path in ALLOWED_FOR_NOW
        or (path, stage) in NOT_A_STAGE_NAME
    )


def test_a_stage_is_named_only_in_its_declaration_and_its_own_modules():
    """Per-stage knowledge (figures, resume notes, files read, reuse) is reached through the
    stage's declaration (`eaglet.stages`), never by a branch on a stage-name literal."""
    from eaglet.stages import STAGES

    found = []
    for path in sorted(p for part in PRODUCT_FOLDERS for p in (ROOT / part).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for line, name in stage_names_in(path.read_text(encoding="utf-8"), set(STAGES)):
            if not stage_may_be_named_in(name, relative):
                found.append(f"{relative}:{line}: {name!r}")
    assert found == [], "stage names outside their declaration and own modules:\n" + "\n".join(
        found
    )


def test_the_exceptions_to_stage_names_are_still_needed():
    """An allowance no file needs any more is removed, so the lists only shrink."""
    from eaglet.stages import STAGES

    named = {
        path.relative_to(ROOT).as_posix(): {
            n for _, n in stage_names_in(path.read_text(encoding="utf-8"), set(STAGES))
        }
        for part in PRODUCT_FOLDERS
        for path in (ROOT / part).rglob("*.py")
    }
    assert [p for p in ALLOWED_FOR_NOW if not named.get(p)] == []
    assert [k for k in NOT_A_STAGE_NAME if k[1] not in named.get(k[0], set())] == []


def test_the_stage_name_finder_skips_docstrings_and_finds_branches():
    source = '''"""The train stage."""


def figures(stage):
    """For "train" only."""
    if stage == "train":
        return {"evaluate": 1}
    return f"{stage} train"
'''
    assert stage_names_in(source, {"train", "evaluate"}) == [(6, "train"), (7, "evaluate")]


TOY_BACKEND = '''"""A toy hidden-state backend: the hf backend's features, its own section."""
from pydantic import Field

from eaglet.hidden_states.backends.base import BackendSettings
from eaglet.hidden_states.backends.hf import InProcessBackend

OPENED = []  # the toy's `scale` each time a source was opened


class ToySettings(BackendSettings):
    """The toy backend."""

    scale: float = Field(1.0, description="Recorded when a source is opened.")


class ToyBackend(InProcessBackend):
    name = "toy"
    settings = ToySettings

    def open(self, target, settings, aux_layer_ids):
        OPENED.append(settings.toy.scale)
        return super().open(target, settings, aux_layer_ids)

    def preflight(self, config, report):
        report.passed.append(f"hidden_states.toy.scale {config.hidden_states.toy.scale}: fine")


BACKEND = ToyBackend()
'''

ADD_A_BACKEND = r"""
import json, sys
from pathlib import Path
from eaglet.cache import stage_config, stage_modules
from eaglet.config import PipelineConfig, load_config
from eaglet.draft.online import OnlineData
from eaglet.hidden_states.backends import BACKENDS
from eaglet.hidden_states.backends import toy
from eaglet.hidden_states.stage import stage_body, target_shape
from eaglet.preflight import PreflightReport, check_hidden_states_backend
from eaglet.records.examples import Example

model, work = sys.argv[1], Path(sys.argv[2])
config = load_config(None, [f"target.model={model}", f"work_dir={work}",
                            "hidden_states.backend=toy", "hidden_states.toy.scale=2"])
default = load_config(None, [f"target.model={model}", f"work_dir={work}"])
assert "eaglet.hidden_states.backends.toy" in stage_modules("hidden_states", config)
assert "eaglet.hidden_states.backends.toy" not in stage_modules("hidden_states", default)
assert "ToySettings" in json.dumps(PipelineConfig.model_json_schema())  # the form's section
report = PreflightReport()
check_hidden_states_backend(config, report)
assert report.passed == ["hidden_states.toy.scale 2.0: fine"], report.passed

examples = work / "examples.jsonl"
examples.parent.mkdir(parents=True, exist_ok=True)
examples.write_text("".join(
    Example(sample_id=f"s{i}", source="t", reasoning="", content="",
            input_ids=list(range(1, 9 + i)), loss_mask=[1] * (8 + i),
            finish_reason="stop").model_dump_json() + "\n"
    for i in range(3)
))
folder = work / "hidden_states"
folder.mkdir()
output = stage_body(config, examples, report=lambda line: None)(folder)
assert output.info["backend"] == "toy" and output.counts["records"] == 3, output
assert toy.OPENED == [2.0], toy.OPENED  # the stage's shards came from the toy's source
online = OnlineData(examples, config.target, target_shape(config)[2],
                    hidden_states=config.hidden_states)
assert online.features([0])[0]["aux_hidden_states"].shape[0] == 8
assert toy.OPENED == [2.0, 2.0], toy.OPENED  # and online training's
print(json.dumps({"backends": sorted(BACKENDS),
                  "default_key_config": stage_config("hidden_states", default),
                  "toy_key_config": stage_config("hidden_states", config)}, default=str))
"""


@pytest.mark.slow  # seconds of subprocess or timeouts: outside the fast suite
def test_adding_a_hidden_state_backend_is_its_module_and_one_registry_line(
    tmp_path, fixture_model_dir
):
    """In a copy of the project: a module for a new backend and one line in the registry make
    it a `hidden_states.backend` choice with its own config section (in the form's schema
    too), the backend the hidden_states stage and online training open, the preflight's check,
    and a key of the stage's code; the stage keys of a run of another backend stay as they
    were."""
    import json
    import shutil
    import subprocess
    import sys

    from eaglet.cache import stage_config
    from eaglet.config import load_config

    shutil.copytree(
        ROOT / "eaglet", tmp_path / "eaglet", ignore=shutil.ignore_patterns("__pycache__")
    )
    backends = tmp_path / "eaglet" / "hidden_states" / "backends"
    (backends / "toy.py").write_text(TOY_BACKEND)
    registry = backends / "__init__.py"
    text = registry.read_text()
    line = '    "vllm": "eaglet.hidden_states.backends.vllm",\n'
    assert line in text
    toy_line = '    "toy": "eaglet.hidden_states.backends.toy",\n'
    registry.write_text(text.replace(line, line + toy_line))
    work = tmp_path / "work"
    result = subprocess.run(
        [sys.executable, "-c", ADD_A_BACKEND, str(fixture_model_dir), str(work)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["backends"] == ["hf", "toy", "vllm"]
    here = load_config(None, [f"target.model={fixture_model_dir}", f"work_dir={work}"])
    assert found["default_key_config"] == json.loads(
        json.dumps(stage_config("hidden_states", here), default=str)
    )
    assert found["toy_key_config"]["hidden_states"]["toy"] == {"scale": 2.0}


def test_loading_a_config_imports_no_backends_heavy_dependencies():
    """Every backend's module is imported with the config (its section is a field): it keeps
    torch, httpx and the target's code inside the functions that use them, so `eaglet
    inspect`, the CLI and the flow form load a config in a fraction of a second."""
    import subprocess
    import sys

    probe = "import sys, eaglet.config; print(sorted({'torch', 'httpx'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
