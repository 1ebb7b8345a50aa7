"""The Prefect blocks eaglet reads, for the tasks (`tasks/context.py`) and the CLI (`eaglet
doctor`) alike: a Secret block's value. Beside `tasks/` and `flows/`, so that the CLI reads a
secret without importing a task module, and no stage is keyed by this code (a secret never
decides what a stage writes: `eaglet.cache` follows `eaglet` and `eaglet_prefect.tasks` only)."""

from __future__ import annotations

from prefect.exceptions import ObjectNotFound


def prefect_secret(name: str) -> str:
    """The value of the Prefect Secret block `name` (ValueError naming it when there is none):
    a stage's secrets, and `eaglet doctor`'s."""
    from prefect.blocks.system import Secret

    try:
        return str(Secret.load(name).get())
    except (ValueError, ObjectNotFound) as exc:
        raise ValueError(
            f"no Prefect Secret block named {name!r} on this Prefect server; create it "
            f"(UI: Blocks > Secret, or `Secret(value=...).save({name!r})`) or use "
            "generation.api_key_env"
        ) from exc
