"""The documentation site (mkdocs.yml, docs/): it builds with --strict, its config reference is
generated from PipelineConfig, a config key the pages name that does not exist fails the build,
and README.md stays a short front page whose commands are the docs' own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytest.importorskip("mkdocs", reason="mkdocs is in the test extra: pip install -e '.[test]'")

from eaglet.config import PipelineConfig  # noqa: E402


def build(config_dir: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=config_dir,
        capture_output=True,
        text=True,
        timeout=120,
    )


def keys(model: type, prefix: str = "") -> typing.Iterator[str]:
    """Every field of a model and of the models under it, as `section.key`."""
    for name, field in model.model_fields.items():
        yield prefix + name
        for arg in [field.annotation, *typing.get_args(field.annotation)]:
            if isinstance(arg, type) and hasattr(arg, "model_fields"):
                yield from keys(arg, f"{prefix}{name}.")


def copy_of_the_docs(tmp_path: Path) -> Path:
    """The site's sources copied (to edit), every other top-level entry linked."""
    root = tmp_path / "project"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name in ("docs", "README.md", "mkdocs.yml"):
            continue
        if not entry.name.startswith(".") and entry.name not in ("site", "runs"):
            os.symlink(entry, root / entry.name)
    for name in ("README.md", "mkdocs.yml"):
        (root / name).write_text((ROOT / name).read_text())
    (root / "docs").mkdir()
    for page in (ROOT / "docs").iterdir():
        if page.is_file():
            (root / "docs" / page.name).write_bytes(page.read_bytes())
    return root


def test_the_site_builds_strictly_with_every_config_key_in_its_reference(tmp_path):
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    reference = (tmp_path / "site" / "config" / "index.html").read_text()
    for key in keys(PipelineConfig):
        section, _, name = key.rpartition(".")
        assert f"<code>{name}</code>" in reference, key
        if section:
            assert f'id="config-{section.replace(".", "-").replace("_", "-")}"' in reference
    for page in ("benchmarks", "reliability", "guarantees", "ui", "running"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_a_config_key_that_does_not_exist_fails_the_build(tmp_path):
    root = copy_of_the_docs(tmp_path)
    page = root / "docs" / "generation.md"
    page.write_text(page.read_text() + "\nSet `generation.max_tokenz: 10` to stop sooner.\n")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0
    assert "docs/generation.md: `generation.max_tokenz` is not a key" in done.stderr, done.stderr

    page.write_text((ROOT / "docs" / "generation.md").read_text())
    readme = root / "README.md"
    readme.write_text(readme.read_text() + "\n```yaml\ntrain:\n  epochz: 20\n```\n")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0
    assert "README.md: YAML key train.epochz is not a key" in done.stderr, done.stderr


def bash_block_after(text: str, start: str) -> str:
    section = text[text.index(start) :]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_the_readme_is_a_short_front_page_with_the_docs_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    assert "make demo" in readme and "make test" in readme
    ui = (ROOT / "docs" / "ui.md").read_text()
    # tests/test_readme_ui.py and tests/test_work_pool.py run the README's blocks: the docs
    # page must say the same commands
    assert bash_block_after(readme, "## Run it from the Prefect UI") == bash_block_after(
        ui, "# Run it from the Prefect UI"
    )
    pool = "With a work pool instead of a serving process:"
    assert bash_block_after(readme, pool) == bash_block_after(ui, pool)
