"""The model card of each export (`README.md` in the Hugging Face card format), generated from
the run's records, never typed: what a reader of the hub needs to trust a draft's τ.

Front matter: `base_model` (the target, when it is a hub id; a local folder is named in the
text), `library_name` (the engine that loads the export), `tags` (method, engine). Body: τ per
named evaluation set with its prompts' sha256, rounds, k, temperature and thinking setting; the
held-out prompts likewise; τ by segment; the served check and the engine check's rows; the
serving schedule (`serving.json` beside the export) and the command that serves it; the
training data (sources, revisions, content hashes, counts and rejected rows, the generation's
sampling); the target's fingerprint and revision; the training settings; eaglet's version and
the stages' code hashes. A part the run did not measure is said to be missing, never left out.

Where the cards go. Cards depend on the evaluation (its sets, its k, its served check), and one
train folder may be evaluated under several evaluate keys, each writing its own card; a card
written into the train stage's folder would be overwritten by the next evaluation and sit
outside the train manifest's hashes. So the evaluate stage writes its own copy of each export
(`exports/<folder>/`: the train folder's files hard-linked, no second copy of the weights on
one file system) with the card beside them (`write_card_folders`).

Each section's figures are one Markdown table (tests read them back).
"""

from __future__ import annotations

import json
import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from eaglet.stages import PRODUCER
from eaglet.storage import read_manifest, stage_folder

EXPORTS_FOLDER = "exports"  # in the evaluate folder: its copy of each export, with its card
CARD_FILE = "README.md"
TAU_CONVENTION = (
    "τ is the acceptance length with the bonus token (vLLM's and speculators' count): "
    "1 + accepted drafts / verification rounds, greedy unless a temperature is given; "
    "SpecForge's 'drafts per step' is τ − 1"
)
LIBRARY = {"vllm": "vllm", "speculators": "vllm", "sglang": "sglang"}


def eaglet_version() -> str:
    try:
        return metadata.version("eaglet")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def upstream_manifests(work_dir: Path, draft_manifest: Any) -> dict[str, Any]:
    """Every upstream stage's manifest of the train stage (`upstream` keys, walked back)."""
    found: dict[str, Any] = {PRODUCER["draft"]: draft_manifest}
    todo = dict(draft_manifest.upstream)
    while todo:
        stage, key = todo.popitem()
        if stage in found:
            continue
        manifest = read_manifest(stage_folder(work_dir, stage, key))
        if manifest is not None:
            found[stage] = manifest
            todo.update(manifest.upstream)
    return found


def _thinking(setting: object) -> str:
    return "template default" if setting is None else ("on" if setting else "off")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    def cell(value: Any) -> str:
        if value is None:
            return "—"
        if isinstance(value, float):
            return f"{value:.3f}"
        return str(value).replace("|", "\\|")

    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *["| " + " | ".join(cell(v) for v in row) + " |" for row in rows],
    ]


def model_card(
    export: str, folder_name: str, report: dict[str, Any], records: dict[str, Any]
) -> str:
    """The card of the export `export` (in `folder_name`), from the evaluation's `report`
    (report.json) and `records`: `target` (model, revision, fingerprint), `manifests` (stage
    -> manifest dict), `heldout_sha256`, `serving` (serving.json or None), `served_command`,
    `speculative_config`, `thinking`."""
    manifests = records["manifests"]
    train = manifests[PRODUCER["draft"]]
    info, draft = train["info"], report["draft"]
    method = draft.get("method", info.get("method", "eagle3"))
    engine = LIBRARY.get(export, export)
    target = records["target"]
    front: dict[str, Any] = {}
    if not Path(target["model"]).is_dir():
        front["base_model"] = target["model"]
    front.update(
        library_name=engine,
        tags=["speculative-decoding", "eaglet", method, engine, f"{method}-draft"],
    )
    k = draft["num_speculative_tokens"]
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", ""]
    lines += [
        f"# {method} draft for {target['model']}",
        "",
        f"A {method} speculative-decoding draft trained by eaglet for the target "
        f"`{target['model']}`; this folder (`{folder_name}`) is the export for {export}. "
        "Every figure below is generated from the run's records."
        + (
            " `base_model` is left out of the front matter: the target is a local folder."
            if "base_model" not in front
            else ""
        ),
        "",
        "## Acceptance length",
        "",
        TAU_CONVENTION + ".",
        "",
    ]
    rows = [
        [
            "held-out", "(all)", report["prompts"], records.get("heldout_sha256"),
            draft.get("num_rounds"), k, draft.get("temperature", 0.0),
            _thinking(records.get("thinking")), report["tau"],
        ]
    ]  # fmt: skip
    for name, s in (report.get("sets") or {}).items():
        for category, f in [("(all)", s), *sorted((s.get("categories") or {}).items())]:
            rows.append([
                name, category, f["prompts"], s["prompts_sha256"], f["rounds"],
                s["num_speculative_tokens"], s["temperature"], _thinking(s.get("thinking")),
                f["tau"],
            ])  # fmt: skip
    header = ["set", "category", "prompts", "prompts sha256", "rounds", "k", "temperature",
              "thinking", "tau"]  # fmt: skip
    lines += _table(header, rows)
    lines.append("")
    if not report.get("sets"):
        lines += ["No named evaluation set was run (evaluate.sets is empty).", ""]
    lines += [
        f"An untrained draft of the same shape: τ {report['untrained_tau']:.3f} on the "
        f"held-out prompts. Offline τ by k: "
        + ", ".join(f"k={kk}: {t:.3f}" for kk, t in report.get("tau_by_k", {}).items())
        + ".",
        "",
        "## τ by segment",
        "",
    ]
    segments = report.get("segments") or {}
    if segments:
        lines += _table(
            ["segment", "rounds", "tau"],
            [[name, seg["rounds"], seg["tau"]] for name, seg in segments.items()],
        )
    else:
        lines.append("No segment figures were recorded.")
    lines += ["", "## Served check", ""]
    served = report.get("served")
    if served is not None:
        lines.append(
            f"Served by vLLM ({served.get('server', '?')}) at k = "
            f"{served['num_speculative_tokens']}: τ {served['tau']:.3f} from its own counters "
            f"over {served['num_drafts']} drafts, offline τ {report['tau']:.3f} (gap "
            f"{report.get('serving_gap', float('nan')):.3f})."
        )
    else:
        lines.append("No served check was run (evaluate.serving: none).")
    lines += ["", "## Engine check", ""]
    checks = report.get("engine_checks") or []
    if checks:
        lines += _table(
            ["export", "engine", "version", "conventions", "parsed", "loaded", "served tau",
             "offline tau"],
            [[r["export"], r["engine"], r.get("version"), "ok" if not r["problems"] else
              "; ".join(r["problems"]), r.get("parsed"), r.get("loaded"), r.get("served_tau"),
              r.get("offline_tau")] for r in checks],
        )  # fmt: skip
    else:
        lines.append("No engine check was recorded.")
    lines += ["", "## Serving", ""]
    serving = records.get("serving")
    if serving is not None:
        m = serving.get("machine", {})
        lines += [
            "The serving schedule measured for this draft (`serving.json`): k per band of batch "
            f"sizes, on {m.get('gpu') or m.get('processor')} ({m.get('cpus')} CPUs), vLLM "
            f"{serving.get('engine_version', '?')}; a server run with it: "
            f"{serving['schedule_check']['verdict']}.",
            "",
            *_table(
                ["first batch size", "last batch size", "k", "speed-up", "note"],
                [
                    [b["first_batch_size"], b["last_batch_size"], b["k"], b["speedup"], b["note"]]
                    for b in serving["bands"]
                ],
            ),  # fmt: skip
            "",
            "```",
            f"vllm serve {target['model']} --speculative-config "
            f"'{json.dumps(serving['speculative_config'])}'",
            "```",
        ]
    else:
        lines.append(
            "No serving schedule was calibrated (evaluate.serving: vllm with a server eaglet "
            f"starts writes one). Served at the evaluated k = {k}:"
        )
        if engine == "vllm":
            lines += [
                "",
                "```",
                f"vllm serve {target['model']} --speculative-config "
                f"'{json.dumps(records['speculative_config'])}'",
                "```",
            ]
        else:
            lines.append(f"eaglet has not served this export in {engine}.")
    if records.get("served_command"):
        lines += ["", "The served check's own command:", "", "```",
                  " ".join(records["served_command"]), "```"]  # fmt: skip
    lines += ["", "## Training data", ""] + data_lines(manifests)
    lines += [
        "",
        "## Target",
        "",
        f"- model: `{target['model']}`",
        f"- revision: {target.get('revision') or '— (none pinned)'}",
        f"- fingerprint: `{target.get('fingerprint')}`",
        "",
        "## Training",
        "",
        f"- method: {method}; {info.get('train_samples')} samples, {info.get('steps')} steps, "
        f"{info.get('epochs_completed')} epochs; loss {info.get('initial_loss', 0):.3f} -> "
        f"{info.get('final_loss', 0):.3f}",
        f"- target layers (HF hidden_states indices): {info.get('aux_layer_ids')}",
        "",
        "```yaml",
        yaml.safe_dump(train.get("config", {}), sort_keys=True).rstrip(),
        "```",
        "",
        "## Provenance",
        "",
        f"- eaglet {eaglet_version()}",
        *[
            f"- {stage}: key `{m.get('key')}`, code `{str(m.get('code_hash'))[:16]}`"
            for stage, m in manifests.items()
        ],
        "",
    ]
    return "\n".join(lines)


def data_lines(manifests: dict[str, Any]) -> list[str]:
    """The training data: sources, revisions and content hashes, counts, rejected rows, the
    generation's sampling (what the records hold; a stage not found is said to be missing)."""
    download = manifests.get(PRODUCER["samples"])
    if download is None:
        return ["The download stage's record was not found in the work dir."]
    per_source = download["info"].get("per_source", {})
    lines = _table(
        ["source", "split", "revision", "limit", "content sha256", "rows"],
        [
            [d.get("source"), d.get("split"), d.get("revision"), d.get("limit"),
             d.get("content"), per_source.get(d.get("source"))]
            for d in download["config"].get("datasets", [])
        ],
    )  # fmt: skip
    c = download["counts"]
    lines += ["", f"- downloaded: {c.get('records')} rows ({c.get('duplicates', 0)} duplicates "
              f"and {c.get('skipped', 0)} skipped rows left out)"]  # fmt: skip
    generate = manifests.get(PRODUCER["generations"])
    extract = manifests.get(PRODUCER["examples"])
    if generate is not None:
        g, sampling = generate["counts"], generate["config"].get("generation", {})
        lines.append(
            f"- generated: {g.get('records')} answers ({g.get('failed', 0)} failed, "
            f"{g.get('looped', 0)} looped, {g.get('truncated', 0)} truncated) by "
            f"{generate['info'].get('engine')}; sampling: temperature "
            f"{sampling.get('temperature')}, top_p {sampling.get('top_p')}, max_tokens "
            f"{sampling.get('max_tokens')}, seed {sampling.get('seed')}, sampling plan "
            f"{sampling.get('sampling_plan') or 'none'}"
        )
    if extract is not None and generate is not None:
        kept = extract["counts"]["records"]
        lines.append(
            f"- extracted: {kept} examples; {generate['counts']['records'] - kept} rows "
            "rejected by the quality gate"
        )
    train = manifests[PRODUCER["draft"]]["info"]
    lines.append(
        f"- trained on {train.get('train_samples')} samples ({train.get('train_tokens')} tokens)"
    )
    return lines


def write_card_folders(
    evaluate_folder: Path, train_folder: Path, exports: dict[str, str], cards: dict[str, str]
) -> dict[str, str]:
    """The evaluate folder's copy of each export (`exports/<folder>/`, the train folder's
    files hard-linked, copied where a link cannot be made) with its card; export -> folder
    relative to the evaluate folder."""
    written = {}
    for export, name in exports.items():
        out = Path(evaluate_folder) / EXPORTS_FOLDER / name
        out.mkdir(parents=True, exist_ok=True)
        for source in sorted((Path(train_folder) / name).iterdir()):
            if source.is_file() and source.name != CARD_FILE:
                link = out / source.name
                # a link left by an earlier try is unlinked, never written through: the copy
                # below would write into the train folder's own file
                link.unlink(missing_ok=True)
                try:
                    os.link(source, link)
                except OSError:  # another file system: a copy, whole or not at all
                    partial = link.with_name(link.name + ".partial")
                    shutil.copyfile(source, partial)
                    os.replace(partial, link)
        (out / CARD_FILE).write_text(cards[export], encoding="utf-8")
        written[export] = f"{EXPORTS_FOLDER}/{name}"
    return written
