"""`eaglet gc WORK_DIR [--yes]`: eaglet's stage folders nothing uses, listed with their sizes
and removed only with --yes (`eaglet.work_dir_gc`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eaglet import work_dir_lock
from eaglet.work_dir_status import is_work_dir


def cmd_gc(args: argparse.Namespace) -> int:
    """List the stage folders nothing uses any more and their sizes; remove them with --yes."""
    from eaglet.hidden_states.budget import human
    from eaglet.work_dir_gc import NothingKnownInUse, remove, survey

    work_dir = Path(args.work_dir)
    if not work_dir.is_dir() or not is_work_dir(work_dir):
        print(f"error: {work_dir} is not a work dir eaglet ran in", file=sys.stderr)
        return 2
    with work_dir_lock.held(work_dir):  # never while a run uses the work dir
        try:
            found = survey(work_dir)
        except NothingKnownInUse as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for line in found.notes + found.held:
            print(f"note: {line}")
        for line in found.not_followed:
            print(f"not followed (a symlink): {line}")
        folders = found.superseded
        total = sum(f.bytes for f in folders)
        for item in folders:
            print(f"  {human(item.bytes):>10}  {item.folder.relative_to(work_dir)}")
        kept = f"{found.kept} folders in use kept (the current config's keys, the last run's)"
        if not folders:
            print(f"nothing to free in {work_dir}: {kept}")
        elif not args.yes:
            print(f"{len(folders)} folders, {human(total)}, that nothing uses; {kept}. Run "
                  "again with --yes to remove them")  # fmt: skip
        else:
            print(f"removed {len(folders)} folders, freed {human(remove(folders, work_dir))}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    gc = commands.add_parser("gc", help="list (and with --yes remove) superseded stage folders")
    gc.add_argument("work_dir")
    gc.add_argument("--yes", action="store_true", help="remove what it lists")
    gc.set_defaults(handler=cmd_gc)
