"""Layering: flows → tasks → eaglet, and the core never imports Prefect."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_core_never_imports_prefect_tasks_or_flows():
    offenders = {
        str(path.relative_to(ROOT)): imported_modules(path) & {"prefect", "tasks", "flows"}
        for path in (ROOT / "eaglet").rglob("*.py")
    }
    # The CLI may start a flow, but only through a lazy import inside a function.
    offenders = {k: v for k, v in offenders.items() if v and k != "eaglet/cli.py"}
    assert offenders == {}


def test_cli_imports_flows_lazily():
    tree = ast.parse((ROOT / "eaglet" / "cli.py").read_text())
    top_level = {
        node.module.split(".")[0]
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not top_level & {"prefect", "flows", "tasks"}


def test_tasks_never_import_flows():
    for path in (ROOT / "tasks").rglob("*.py"):
        assert "flows" not in imported_modules(path), path
