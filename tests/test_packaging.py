"""The wheel: it installs `eaglet` and the Prefect side under the project's own name
(`eaglet_prefect.flows`, `.tasks`, `.deployments`), never top-level `flows`, `tasks` or
`deployments` that would collide with another project's; the `eaglet` command points there; and
from the wheel's layout the flow finds its tasks and every stage keeps the code hash it has in
a clone (so installing eaglet does not re-key a work dir that a clone filled)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from eaglet.cache import code_hash
from eaglet.stages import STAGES
from tests.conftest import ROOT
from tests.pipeline_helpers import copy_project

pytestmark = pytest.mark.slow  # builds a wheel (a few seconds)

SOURCES = ("eaglet", "eaglet_prefect", "tasks", "flows", "deployments")
LINKED = ("flows", "tasks", "deployments")  # eaglet_prefect/<name>: a link to ../<name>


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the project (the build leaves nothing in the checkout),
    its eaglet_prefect links kept as links, as in a clone: the build follows them."""
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        shutil.copytree(
            ROOT / name,
            source / name,
            symlinks=True,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    assert (source / "eaglet_prefect" / "flows").is_symlink()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(source)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (built,) = out.glob("eaglet-*.whl")
    return built


def test_the_wheel_installs_only_eaglet_and_eaglet_prefect(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.endswith(".dist-info/RECORD")}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"eaglet", "eaglet_prefect"}
    for folder in ("tasks", "flows", "deployments"):
        modules = {p.name for p in (ROOT / folder).glob("*.py")}
        assert {n.split("/")[-1] for n in names if n.startswith(f"eaglet_prefect/{folder}/")} >= (
            modules
        ), folder
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert (
        "eaglet = eaglet_prefect.flows.cli:main"
        in zipfile.ZipFile(wheel).read(entry_points).decode()
    )


def test_every_package_of_the_clone_is_in_the_wheel(wheel):
    """pyproject.toml finds the packages (through eaglet_prefect's links), no hand-kept list
    (one missed eaglet.hidden_states.backends): each folder with an `__init__.py` under
    eaglet/ and eaglet_prefect/ is a package of the wheel, with its modules."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "find" in setuptools["packages"] and "package-dir" not in setuptools
    names = set(zipfile.ZipFile(wheel).namelist())
    folders = [ROOT / "eaglet", *(ROOT / "eaglet_prefect" / f for f in LINKED)]
    packages = {init.parent for folder in folders for init in folder.rglob("__init__.py")}
    modules = {m.relative_to(ROOT).as_posix() for p in packages for m in p.glob("*.py")}
    missing = sorted(modules - names)
    assert missing == []


PROBE = """
import json, sys
import eaglet, eaglet_prefect.flows.pipeline as pipeline
from eaglet.cache import code_hash
from eaglet.stages import STAGES
print(json.dumps({
    "eaglet": eaglet.__file__,
    "pipeline": pipeline.__file__,
    "tasks": {stage: sys.modules[task.fn.__module__].__file__
              for stage, task in pipeline.TASKS.items()},
    "code_hash": {stage: code_hash(stage) for stage in STAGES},
    "bare_names": [name for name in ("tasks", "flows", "deployments")
                   if __import__("importlib.util").util.find_spec(name) is not None],
}))
"""


def test_from_the_wheel_the_flow_finds_its_tasks_and_the_code_hashes_are_the_clones(
    wheel, tmp_path
):
    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)
    elsewhere = tmp_path / "elsewhere"  # not the checkout: nothing found by the working folder
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(installed)}  # before the checkout's editable install
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout)
    assert Path(seen["eaglet"]).is_relative_to(installed)
    assert Path(seen["pipeline"]).is_relative_to(installed / "eaglet_prefect" / "flows")
    assert set(seen["tasks"]) == set(STAGES)
    for stage, path in seen["tasks"].items():
        assert Path(path) == installed / "eaglet_prefect" / "tasks" / f"{stage}.py"
    assert seen["code_hash"] == {stage: code_hash(stage) for stage in STAGES}
    # The clone's editable install still answers bare names? It must not either.
    assert seen["bare_names"] == []

    command = subprocess.run(
        [sys.executable, "-m", "eaglet_prefect.flows.cli", "--help"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert command.returncode == 0 and "fixture-model" in command.stdout, command.stderr


def test_a_copy_of_the_clone_imports_its_own_flows_and_tasks(tmp_path):
    """A copy with its links kept (what the tests that edit or serve a copy run) imports the
    copy's flows and tasks, through its own eaglet_prefect, from the files of its `flows/` and
    `tasks/` (the ones a test edits), not the checkout's."""
    project = copy_project(tmp_path / "project")
    probe = subprocess.run(
        [sys.executable, "-c", COPY_PROBE], cwd=project, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(project)}, timeout=300,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    files = {name: Path(path).resolve() for name, path in json.loads(probe.stdout).items()}
    assert files == {
        "eaglet": project / "eaglet" / "__init__.py",
        "eaglet_prefect": project / "eaglet_prefect" / "__init__.py",
        "eaglet_prefect.flows.pipeline": project / "flows" / "pipeline.py",
        "eaglet_prefect.tasks.train": project / "tasks" / "train.py",
    }


COPY_PROBE = """
import json, eaglet, eaglet_prefect
import eaglet_prefect.flows.pipeline as pipeline, eaglet_prefect.tasks.train as train
print(json.dumps({m.__name__: m.__file__ for m in (eaglet, eaglet_prefect, pipeline, train)}))
"""
