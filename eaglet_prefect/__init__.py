"""The Prefect side of eaglet, installed under the project's own name: `eaglet_prefect.flows`
(the DAG and the `eaglet` command), `eaglet_prefect.tasks` (one thin task per stage) and
`eaglet_prefect.deployments` (`eaglet serve`), never as top-level `flows`, `tasks` and
`deployments` that could collide with another project's in site-packages.

The repository keeps its layout (`flows/`, `tasks/`, `deployments/` beside `eaglet/`); this
package's `flows`, `tasks` and `deployments` are relative symlinks to those folders, committed
in git, so every `eaglet_prefect.<x>.<module>` import names a file path that exists
(`eaglet_prefect/flows/pipeline.py`): Python, the wheel's build (it follows the links) and a
reader's tools (pyright, go-to-definition) all find the same file. Copy a clone with its links
kept (`shutil.copytree(..., symlinks=True)`), or a copy's edits to `tasks/` are not what runs.
"""
