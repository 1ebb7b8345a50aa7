"""The `eaglet` command's subcommands, one module each: `register(commands)` adds its
parser(s), each with its handler. `flows/cli.py` builds the parser from `COMMANDS`."""

from __future__ import annotations

from eaglet_prefect.flows.commands import (
    doctor,
    eval_draft,
    fixture_model,
    gc,
    inspect_work_dir,
    run,
    serve,
)

COMMANDS = (run, doctor, inspect_work_dir, eval_draft, gc, serve, fixture_model)
