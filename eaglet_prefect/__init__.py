"""The Prefect side of eaglet, installed under the project's own name: `eaglet_prefect.flows`
(the DAG and the `eaglet` command), `eaglet_prefect.tasks` (one thin task per stage) and
`eaglet_prefect.deployments` (`eaglet serve`), never as top-level `flows`, `tasks` and
`deployments` that could collide with another project's in site-packages.

The repository keeps its layout (`flows/`, `tasks/`, `deployments/` beside `eaglet/`): the
wheel installs those folders here (`[tool.setuptools.package-dir]` in pyproject.toml), and in
a clone (or a copy of one) this package's subpackages are found in the folder above it.
"""

from pathlib import Path

_HERE = Path(__file__).resolve().parent
if not (_HERE / "flows").is_dir():  # a clone: the folders sit beside this package
    __path__.append(str(_HERE.parent))  # type: ignore[name-defined]  # noqa: F821
