"""Layering: flows → tasks → eaglet; the core never imports Prefect, tasks or flows, not even
inside a function; no import cycle among the project's modules, counting
the imports inside functions too. The import graph is read from the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folder -> the package it is imported as (the Prefect side installs as eaglet_prefect.*).
PACKAGES = {
    "eaglet": "eaglet",
    "tasks": "eaglet_prefect.tasks",
    "flows": "eaglet_prefect.flows",
    "deployments": "eaglet_prefect.deployments",
}


def module_name(path: Path) -> str:
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1:] == ["__init__"] else parts
    return ".".join([PACKAGES[folder], *parts])


MODULES = {module_name(path): path for folder in PACKAGES for path in (ROOT / folder).rglob("*.py")}


def layer(name: str) -> str:
    """core, tasks, flows, deployments or prefect: where a module sits (other: its root)."""
    for layer_name, package in (("core", "eaglet"), *((f, p) for f, p in PACKAGES.items())):
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


def test_tasks_never_import_flows():
    offenders = {n: imports_of(n) for n in MODULES if layer(n) == "tasks"}
    assert {k for k, v in offenders.items() if "flows" in roots(v)} == set()


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
    registry = methods / "__init__.py"
    text = registry.read_text()
    line = '    "dflash": "eaglet.draft.methods.dflash",\n'
    assert line in text
    registry.write_text(text.replace(line, line + '    "toy": "eaglet.draft.methods.toy",\n'))
    result = subprocess.run(
        [sys.executable, "-c", ADD_A_METHOD], cwd=tmp_path, capture_output=True, text=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ok ['dflash', 'eagle3', 'peagle', 'toy']")
