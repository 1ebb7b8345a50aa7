"""The evaluate stage: held-out prompts → acceptance length τ of the draft, beside an untrained
draft's τ (and, with evaluate.serving=vllm, τ served by vLLM), as `report.json`, a PNG plot and
artifacts. The untrained draft is scored once per target, evaluation settings, code and draft
shape: its pass is kept in `WORK_DIR/.untrained-tau/` (outside the stage folders, which `eaglet
gc` prunes) and read back by the next evaluate of a draft of the same shape."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from pathlib import Path

from eaglet.cache import code_hash, stage_config
from eaglet.config import PipelineConfig
from eaglet.draft.calibration import CALIBRATION_PLOT_FILE, SERVING_FILE, machine, plot_calibration
from eaglet.draft.engine_check import check_exports, engine_check_cells
from eaglet.draft.evaluate import evaluation_report
from eaglet.draft.methods import draft_method
from eaglet.draft.methods.registry import DEFAULT_METHOD
from eaglet.draft.model_card import (
    EXPORTS_FOLDER,
    model_card,
    upstream_manifests,
    write_card_folders,
)
from eaglet.draft.sampled import sampled_summary, sampled_text
from eaglet.draft.segments import segments_text
from eaglet.draft.set_evaluation import evaluate_sets
from eaglet.progress import Throttle
from eaglet.reasoning import detect_format
from eaglet.records.io import read_jsonl
from eaglet.records.prompts import Prompt
from eaglet.split import is_heldout
from eaglet.stage_context import StageContext
from eaglet.stages import ACCEPTANCE_PLOT_FILE, DRAFT_FOLDER, PROMPTS_FILE, REPORT_FILE
from eaglet.storage import (
    Manifest,
    StageOutput,
    canonical_json,
    final_path,
    stage_dir,
    write_json_atomic,
)
from eaglet.target import end_token_ids, load_tokenizer

UNTRAINED_CACHE = ".untrained-tau"  # in the work dir: the untrained draft's passes


def untrained_cache(config: PipelineConfig) -> Path:
    """The folder of the untrained draft's passes for this target, these evaluation settings
    and this code (the draft's shape and the prompts name the file in it:
    `eaglet.draft.evaluate.untrained_key`)."""
    keyed = {"config": stage_config("evaluate", config), "code": code_hash("evaluate", config)}
    key = hashlib.sha256(canonical_json(keyed).encode()).hexdigest()[:20]
    return Path(config.work_dir) / UNTRAINED_CACHE / key


def heldout_prompts(config: PipelineConfig, prompts: Manifest) -> list[list[int]]:
    """The prompt ids of the held-out samples (never trained on), at most evaluate.max_prompts."""
    fraction = config.train.holdout_fraction
    heldout = [
        p.prompt_ids
        for p in read_jsonl(stage_dir(config.work_dir, prompts) / PROMPTS_FILE, Prompt)
        if is_heldout(p.sample_id, fraction)
    ][: config.evaluate.max_prompts]
    if not heldout:
        raise ValueError(
            f"no held-out prompts: train.holdout_fraction={fraction} left none of "
            f"{prompts.counts['records']} prompts for evaluation; raise it"
        )
    return heldout


def run(
    ctx: StageContext, config: PipelineConfig, inputs: dict[str, Manifest], folder: Path
) -> StageOutput:
    heldout = heldout_prompts(config, inputs["prompts"])
    # The vLLM export; layer ids from the draft's own config: what a server reads.
    draft_dir = stage_dir(config.work_dir, inputs["draft"]) / DRAFT_FOLDER
    # every export held to its engine's conventions and parsed by vLLM, before it is measured
    engine_rows = engine_checks(config, inputs["draft"], draft_dir)
    tokenizer = load_tokenizer(config.target)
    eos = end_token_ids(config.target, tokenizer)
    # τ per segment (thinking, answer, tool), split from output ids as extract splits them
    reasoning_format = detect_format(
        tokenizer, config.reasoning.format, config.tokenize.chat_template_kwargs
    )
    throttle = Throttle()

    def progress(update: dict) -> None:
        if throttle.ready(force=update["done"] == update["total"]):
            ctx.info(
                f"evaluate {update['done']}/{update['total']} prompt passes ({update['pass']}), "
                f"{update['done'] / max(update['elapsed_s'], 1e-9):.2f} prompts/s, "
                f"ETA {timedelta(seconds=round(update['eta_s']))}"
            )

    report = evaluation_report(
        config.evaluate, config.target, draft_dir, heldout, eos, None, folder, progress,
        reasoning_format, untrained_cache(config), ctx.info,
    )  # fmt: skip
    if config.evaluate.sets:  # the named sets, beside the held-out prompts
        report["sets"] = evaluate_sets(
            config.evaluate.sets, draft_dir, config.target, tokenizer, config.evaluate,
            config.tokenize.chat_template_kwargs, eos, ctx.info,
        )  # fmt: skip
        write_json_atomic(folder / REPORT_FILE, report)
        rows = [
            {"set": name, "category": category or "(all)", "tau": round(f["tau"], 3),
             "emitted_tau": round(f["emitted_tau"], 3), "rounds": f["rounds"],
             "prompts": f["prompts"], "prompts_sha256": s["prompts_sha256"][:16]}
            for name, s in report["sets"].items()
            for category, f in [(None, s), *s.get("categories", {}).items()]
        ]  # fmt: skip
        ctx.table("evaluation-sets", rows, "τ per named evaluation set and category")
    trained, served, sampled = report["draft"], report.get("served"), report.get("sampled")
    for row in engine_rows:  # one draft in every export: the offline tau is each one's
        row["offline_tau"] = trained["tau"]
        if row["export"] == "vllm" and served is not None:
            row.update(loaded=True, served_tau=served["tau"])
    report["engine_checks"] = engine_rows
    report["prompts_sha256"] = hashlib.sha256(canonical_json(heldout).encode()).hexdigest()
    serving = serving_document(report, engine_rows, folder)
    report["cards"] = write_cards(config, inputs["draft"], report, folder, serving)
    write_json_atomic(folder / REPORT_FILE, report)
    publish(ctx, report, len(heldout), report["draft"]["num_speculative_tokens"], folder)
    if serving is not None:
        ctx.image(
            "calibration-plot",
            folder / CALIBRATION_PLOT_FILE,
            "served speed-up against concurrency, one line per k, the chosen k per band circled",
        )
        ctx.table(
            "serving-calibration",
            [{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
             for row in serving["table"]],
            f"served tokens/s with and without the draft per k and concurrency; schedule: "
            f"{serving['speculative_config']['num_speculative_tokens_per_batch_size']} "
            f"({serving['schedule_check']['verdict']})",
        )  # fmt: skip
    if engine_rows:
        ctx.table(
            "engine-check",
            [engine_check_cells(row) for row in engine_rows],
            "each export: its engine's conventions, vLLM's own parse of it (no server), "
            "loaded and served tau where the served check ran it, offline tau",
        )
    return StageOutput(
        counts={"records": len(heldout)},
        info={
            "method": trained.get("method", DEFAULT_METHOD),
            "tau": trained["tau"],
            "emitted_tau": trained["emitted_tau"],
            "untrained_tau": report["untrained"]["tau"],
            "segments": {
                name: {"tau": seg["tau"], "rounds": seg["rounds"]}
                for name, seg in report["segments"].items()
            },
            **({"served_tau": served["tau"]} if served is not None else {}),
            **(
                {
                    "speedup": {
                        str(r["concurrency"]): round(r["speedup"], 3) for r in served["speedup"]
                    }
                }  # fmt: skip
                if served is not None and served.get("speedup")
                else {}
            ),
            **(
                {"sets": {name: round(s["tau"], 4) for name, s in report["sets"].items()}}
                if report.get("sets")
                else {}
            ),  # fmt: skip
            **({"sampled": sampled_summary(sampled)} if sampled is not None else {}),
            **({"engine_checks": engine_rows} if engine_rows else {}),
            **(
                {
                    "calibration": {
                        "bands": [
                            (b["first_batch_size"], b["last_batch_size"], b["k"])
                            for b in serving["bands"]
                        ],
                        "schedule": serving["schedule_check"]["verdict"],
                        "plot": str(final_path(folder / CALIBRATION_PLOT_FILE)),
                    }
                }
                if serving is not None
                else {}
            ),  # fmt: skip
        },
    )


def serving_document(report: dict, engine_rows: list[dict], folder: Path) -> dict | None:
    """serving.json of the calibration (`eaglet.draft.calibration`), None without one; its
    plot written beside report.json."""
    calibration = (report.get("served") or {}).get("calibration")
    if not calibration:
        return None
    version = next((r.get("version") for r in engine_rows if r["engine"] == "vllm"), None)
    spec = {
        **calibration["speculative_config"],
        "model": str(final_path(folder / EXPORTS_FOLDER / DRAFT_FOLDER)),
    }
    plot_calibration(calibration["table"], calibration["bands"], folder / CALIBRATION_PLOT_FILE)
    return {
        "speculative_config": spec,
        "bands": calibration["bands"],
        "schedule_check": calibration["schedule_check"],
        "table": calibration["table"],
        "engine": "vllm",
        "engine_version": version or "unknown (no vLLM parse in this run)",
        "machine": machine(),
        "prompts": report["prompts"],
        "prompts_sha256": report["prompts_sha256"],
        "note": "measured by eaglet's served check; a CPU's figures are no GPU's: rerun the "
        "same command on the machine that serves",
    }


def write_cards(
    config: PipelineConfig, draft: Manifest, report: dict, folder: Path, serving: dict | None
) -> dict:
    """A model card for each export, in this folder's own copy of it
    (`eaglet.draft.model_card`: why not in the train folder); export -> folder."""
    from eaglet.fingerprints import model_fingerprint

    train_folder = stage_dir(config.work_dir, draft)
    exports = draft.info.get("exports") or {"vllm": DRAFT_FOLDER}
    manifests = {
        stage: m.model_dump() for stage, m in upstream_manifests(config.work_dir, draft).items()
    }
    target = config.target
    method = draft_method(draft.info.get("method", DEFAULT_METHOD))
    k = report["draft"]["num_speculative_tokens"]
    served = report.get("served") or {}
    cards = {}
    for export, name in exports.items():
        spec = {**method.speculative_config(train_folder / name, k), "model": f"./{name}"}
        records = {
            "target": {
                "model": target.model,
                "revision": target.revision,
                "fingerprint": model_fingerprint(target.model, target.revision, config.work_dir),
            },
            "manifests": manifests,
            "heldout_sha256": report["prompts_sha256"],
            "thinking": config.tokenize.chat_template_kwargs.get("enable_thinking"),
            "serving": serving if export == "vllm" else None,
            "served_command": served.get("command") if export == "vllm" else None,
            "speculative_config": spec,
        }
        cards[export] = model_card(export, name, report, records)
    written = write_card_folders(folder, train_folder, exports, cards)
    if serving is not None:
        write_json_atomic(folder / written["vllm"] / SERVING_FILE, serving)
    return written


def engine_checks(config: PipelineConfig, draft: Manifest, draft_dir: Path) -> list[dict]:
    """The engine check of every export the train stage recorded (`eaglet.draft.engine_check`),
    with vLLM's own parse when a vLLM venv is configured (evaluate.vllm_python); [] for a
    train manifest from before exports named their layer ids."""
    ids = draft.info.get("aux_layer_ids")
    if ids is None:
        return []
    method = draft_method(draft.info.get("method", DEFAULT_METHOD))
    settings = config.evaluate
    saved = json.loads((draft_dir / "config.json").read_text())
    return check_exports(
        method, draft_dir.parent, draft.info.get("exports") or {"vllm": DRAFT_FOLDER},
        [int(i) for i in ids], config.target, method.positions(config.train),
        vllm_python=settings.vllm_python,
        served_k=method.evaluation_k(saved, settings.num_speculative_tokens),
    )  # fmt: skip


def publish(
    ctx: StageContext, report: dict, prompts: int, speculative_tokens: int, folder: Path
) -> None:
    """The evaluation's log line and artifacts: τ against the untrained draft (and served),
    τ by k, acceptance per position as a table and a plot."""
    trained, baseline = report["draft"], report["untrained"]
    served = report.get("served")
    line = (
        f"{trained.get('method', DEFAULT_METHOD)} draft: acceptance length tau "
        f"{trained['tau']:.3f} "
        f"(untrained draft {baseline['tau']:.3f}; "
        f"{trained['emitted_tau']:.3f} output tokens per round) on {prompts} held-out "
        f"prompts, k = {speculative_tokens}"
    )
    sampled = report.get("sampled")
    if sampled is not None:
        line += "; " + sampled_text(sampled_summary(sampled))
    if served is not None:
        at = f" at T={served['temperature']:g}" if served.get("temperature") else ""
        line += f"; served by vLLM{at}: tau {served['tau']:.3f} (gap {report['serving_gap']:.3f})"
        if served.get("speedup"):
            line += "; speed-up " + ", ".join(
                f"{row['speedup']:.2f}x at concurrency {row['concurrency']}"
                for row in served["speedup"]
            )
            ctx.table(
                "serving-speedup",
                [
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
                    for row in served["speedup"]
                ],  # fmt: skip
                "vLLM with and without the draft: output tokens/s, time per output token, "
                "speed-up and served τ per concurrency (on a CPU, the fixture's draft is nearly "
                "as large as its target: this is no GPU figure)",
            )
    segments = report.get("segments", {})
    if segments:
        line += "; by segment: " + segments_text(segments)
    ctx.info(line)
    by_k = ", ".join(f"k={k}: {tau:.3f}" for k, tau in report["tau_by_k"].items())
    ctx.markdown(
        "draft-evaluation",
        f"# Draft evaluation\n\n{line}.\n\nOffline tau by k: {by_k}.\n\n"
        f"Report: `{final_path(folder / REPORT_FILE)}`",
        "acceptance length tau of the trained draft against an untrained one",
    )
    if segments:
        ctx.table(
            "acceptance-by-segment",
            [
                {"segment": name, "rounds": seg["rounds"], "tau": round(seg["tau"], 3),
                 "emitted_tau": round(seg["emitted_tau"], 3),
                 "acceptance_rate": round(seg["acceptance_rate"], 3)}
                for name, seg in segments.items()
            ],
            "tau of the trained draft by where the verified position lies: thinking, answer "
            "or tool-call tokens (each round counts for the segment of its first draft)",
        )  # fmt: skip
    ctx.table(
        "acceptance-per-position",
        [
            {"position": i + 1, "acceptance": a}
            for i, a in enumerate(trained.get("per_position_acceptance", []))
        ],
        "the share of drafted tokens accepted at each speculative position",
    )
    ctx.image(
        "acceptance-plot",
        folder / ACCEPTANCE_PLOT_FILE,
        "acceptance per speculative position, trained and untrained draft",
    )
