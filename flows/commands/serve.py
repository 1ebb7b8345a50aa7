"""`eaglet serve` (the deployments for the Prefect UI, `deployments/serve.py`) and `eaglet
notify BLOCK` (the automations that tell a person when a run fails, crashes or completes)."""

from __future__ import annotations

import argparse
import os
import sys

from eaglet_prefect.flows.prefect_server import (
    SERVER_WAIT_S,
    check_credentials,
    profile_setting,
    server_wait_s,
    wait_for_server,
)


def cmd_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # A run submitted in the UI starts within ~2 s, not Prefect's 10 s poll (its first sign
    # of life on the run page, issue 38); set the variable to choose otherwise.
    os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", "2")
    api_url = os.environ.get("PREFECT_API_URL") or profile_setting("PREFECT_API_URL")
    wait_s = server_wait_s(api_url) if api_url else 0
    if api_url and not wait_for_server(api_url, wait_s):
        starting = "" if wait_s == SERVER_WAIT_S else " (and no process here is starting one)"
        print(
            f"error: no Prefect server answers at PREFECT_API_URL={api_url} after "
            f"{wait_s:.0f} s{starting}: start one (`prefect server start`) or fix the URL",
            file=sys.stderr,
        )
        return 2
    if api_url:
        check_credentials(api_url)  # a team's server without its credentials: exit 2
    if args.notify and cmd_notify(args) != 0:
        return 2
    from eaglet_prefect.deployments.serve import main as serve

    serve()
    return 0


def cmd_notify(args: argparse.Namespace) -> int:
    """Create (or update) the automations that notify through the block `args.notify` when a
    run fails or crashes, and when one completes with its τ."""
    from eaglet_prefect.deployments.notifications import (
        NoSuchNotificationBlock,
        ensure_notifications,
    )

    if not args.notify:
        print("error: name a notification block (or set EAGLET_NOTIFY_BLOCK)", file=sys.stderr)
        return 2
    try:
        lines = ensure_notifications(args.notify)
    except NoSuchNotificationBlock as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


NOTIFY_OPTIONS = {"metavar": "BLOCK", "default": os.environ.get("EAGLET_NOTIFY_BLOCK") or None}
NOTIFY_HELP = (
    "a Prefect notification block (<type>/<name>, e.g. slack-webhook/team, or its name) to "
    "tell when a run fails or crashes, and when one completes with its τ; default: "
    "$EAGLET_NOTIFY_BLOCK"
)


def register(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="serve the deployments for the Prefect UI")
    serve.add_argument("--notify", **NOTIFY_OPTIONS, help=NOTIFY_HELP + " (optional)")
    serve.set_defaults(handler=cmd_serve)

    notify = commands.add_parser(
        "notify", help="notify through a Prefect block when a run fails, crashes or completes"
    )
    notify.add_argument("notify", nargs="?", **NOTIFY_OPTIONS, help=NOTIFY_HELP)
    notify.set_defaults(handler=cmd_notify)
