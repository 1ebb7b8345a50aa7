"""Notifications as code: the Prefect automations that tell a person when an eaglet run failed
or crashed, and when one completed with its τ, through a notification block they name (Slack,
Teams, Discord, a custom webhook, e-mail: any block with Prefect's `notify` capability).

`eaglet serve --notify BLOCK` creates them, `eaglet notify BLOCK` does alone, and
`prefect deploy` of `deployments/prefect.yaml` does in its build step (`notifications_step`)
when `EAGLET_NOTIFY_BLOCK` names a block. All are idempotent: an automation of the same name
is updated in place, never doubled.

What a message says comes from the flow run: its name (config, draft method, until/plan:
`flows/run_names.py`) and state name (Completed, Cached, Failed, Crashed) make the subject;
its state message, which eaglet sets (the τ of a completed run, or the failed stage, its error
and what to do: flows/pipeline.py), opens the body; a link to the run's page ends it. The
link is the server's `PREFECT_UI_URL` when it has one, else the UI address of the API the
automations were created through (what `PREFECT_UI_URL` is for this client: the API URL
without `/api`), so a server started without it still sends a link.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from uuid import UUID

from prefect.automations import AutomationCore, EventTrigger, SendNotification
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_UI_URL

# The flows whose runs are reported (the pipeline and its short form; deployments of either).
FLOWS = ("eaglet-pipeline", "eaglet-pipeline-short-form")
FLOW_RUNS = {"prefect.resource.id": "prefect.flow-run.*"}
OF_EAGLET = {"prefect.resource.role": "flow", "prefect.resource.name": list(FLOWS)}


def run_link(ui_url: str | None) -> str:
    """The message's link to the run's page: the server's own UI URL for it when it knows one
    (`PREFECT_UI_URL` on the server), else `ui_url`'s page for it (else the run's id)."""
    fallback = f"'{ui_url.rstrip('/')}/runs/flow-run/' ~ flow_run.id" if ui_url else "flow_run.id"
    return f"{{{{ (flow_run|ui_url) or ({fallback}) }}}}"


@dataclass(frozen=True)
class Notice:
    """One automation: which flow-run states fire it (by state name: eaglet names a run whose
    every stage was reused Cached), and what the message says."""

    name: str
    states: tuple[str, ...]
    body: str


# Config, draft method (the run's name) and outcome (its state's name), whatever the kind.
SUBJECT = "eaglet {{ flow_run.name }}: {{ flow_run.state.name }}"
NOTICES = (
    Notice(
        name="eaglet: a run failed or crashed",
        states=("Failed", "Crashed"),
        body="{{ flow_run.state.message }}\n"
        "eaglet run {{ flow_run.name }} ended {{ flow_run.state.name }}. "
        "Its page (failure artifact, logs, Retry): ",
    ),
    Notice(
        name="eaglet: a run completed",
        states=("Completed", "Cached"),
        body="{{ flow_run.state.message }}\n"
        "eaglet run {{ flow_run.name }} ended {{ flow_run.state.name }}. "
        "Its page (run report, plots): ",
    ),
)


class NoSuchNotificationBlock(ValueError):
    """The block named for notifications is not on the Prefect server (or cannot notify)."""


def notification_block_id(name: str) -> UUID:
    """The id of the notification block `name`: `<block type slug>/<name>` (as Prefect's
    `block.load` spells it, e.g. `slack-webhook/team`) or the name alone when one notification
    block has it."""
    with get_client(sync_client=True) as client:
        if "/" in name:
            slug, block = name.split("/", 1)
            try:
                document = client.read_block_document_by_name(block, slug, include_secrets=False)
            except ObjectNotFound:
                raise NoSuchNotificationBlock(_missing(name)) from None
            if "notify" not in _capabilities(document):
                raise NoSuchNotificationBlock(
                    f"block {name!r} is a {slug} block, which cannot send notifications"
                )
            return document.id
        found = [
            d
            for d in client.read_block_documents(include_secrets=False)
            if d.name == name and "notify" in _capabilities(d)
        ]
    if len(found) != 1:
        if found:
            kinds = ", ".join(f"{d.block_type.slug}/{name}" for d in found if d.block_type)
            raise NoSuchNotificationBlock(
                f"{len(found)} notification blocks are named {name!r} ({kinds}): name one as "
                "<type>/<name>"
            )
        raise NoSuchNotificationBlock(_missing(name))
    return found[0].id


def _capabilities(document) -> list[str]:
    return list((document.block_schema and document.block_schema.capabilities) or [])


def _missing(name: str) -> str:
    return (
        f"no notification block named {name!r} on the Prefect server: create one in the UI "
        "(Blocks → + → e.g. Slack Webhook, Custom Webhook) or in Python "
        "(`SlackWebhook(url=...).save('team')`), then name it as <type>/<name> or <name>"
    )


def automation_of(notice: Notice, block_id: UUID, ui_url: str | None = None) -> AutomationCore:
    """The automation of `notice`, sending through the block `block_id`, its link to the run's
    page on `ui_url` when the server has no UI URL of its own."""
    return AutomationCore(
        name=notice.name,
        description="Created by eaglet (eaglet serve --notify / eaglet notify); "
        "running either again updates it.",
        trigger=EventTrigger(
            match=FLOW_RUNS,
            match_related=OF_EAGLET,
            expect={f"prefect.flow-run.{state}" for state in notice.states},
            posture="Reactive",
            threshold=1,
        ),
        actions=[
            SendNotification(
                block_document_id=block_id,
                subject=SUBJECT,
                body=notice.body + run_link(ui_url),
            )
        ],
    )


def ensure_notifications(block_name: str) -> list[str]:
    """Create eaglet's automations, or update the ones of the same names, to notify through
    `block_name`; returns one line per automation saying what was done."""
    block_id = notification_block_id(block_name)
    ui_url = PREFECT_UI_URL.value()  # this client's: the API URL without /api, unless set
    done = []
    with get_client(sync_client=True) as client:
        for notice in NOTICES:
            wanted = automation_of(notice, block_id, ui_url)
            existing = client.read_automations_by_name(notice.name)
            for extra in existing[1:]:  # doubles from an older, non-idempotent set-up
                client.delete_automation(extra.id)
            if existing:
                client.update_automation(existing[0].id, wanted)
                done.append(f"notifications: updated {notice.name!r} → {block_name}")
            else:
                client.create_automation(wanted)
                done.append(f"notifications: created {notice.name!r} → {block_name}")
    return done


def notifications_step(block: str | None = None) -> dict[str, list[str]]:
    """`prefect.yaml`'s build step: the automations of `block`, or of the block
    `EAGLET_NOTIFY_BLOCK` names; none (said in one line) when neither names one."""
    block = block or os.environ.get("EAGLET_NOTIFY_BLOCK") or None
    if block is None:
        lines = ["notifications: none (set EAGLET_NOTIFY_BLOCK to a notification block's name)"]
    else:
        lines = ensure_notifications(block)
    for line in lines:
        print(line)
    return {"notifications": lines}
