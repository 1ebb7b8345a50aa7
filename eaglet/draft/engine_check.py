"""The engine check of each export: the conventions engines read without a word when they are
wrong, held against the records of what was trained, and vLLM's own parse of the export.

A draft that an engine loads wrongly still serves: vLLM routes an architecture string to
another class, reads layer ids one off, drafts another k than its block holds, or maps a draft
vocabulary outside the target's, and the only symptom is a low acceptance. So before an export
is recorded, each is held to its method's `ExportConvention` (`DraftMethod.export_convention`)
and `export_problems`:

| convention | what is checked |
|---|---|
| architecture | `architectures[0]` is the string the engine routes to the class the method means |
| layer ids | strictly increasing, in range, the trained ids in the engine's convention |
| block size | a block drafter's block drafts the run's k, and its speculators k says the same |
| vocabulary | the vocabulary, its maps (EAGLE-3's d2t/t2d), a block's mask token: the target's |
| slot offsets | DSpark's anchor keys as vLLM samples them |

A failed convention raises `ConventionError` naming the convention and the file. With a vLLM
installation (`vllm_python`), each export vLLM loads is also parsed by vLLM itself as `vllm
serve` parses its command line (`eaglet/draft/vllm_parse.py`, run by that python: the engine
config, the speculative config and the draft's model config, the architecture resolved in its
registry, no weights loaded, nothing served); a refusal, or a class other than the method's,
fails the same way.

The result is one row per export and engine (`check_exports`): `export`, `engine`, `folder`,
`version`, `parsed` (None: no parse was run, `parse_note` says why), `loaded` (None here; the
served check fills it, with `served_tau` and `offline_tau`), `problems`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from eaglet.config.target import TargetConfig
from eaglet.draft.methods.base import DraftMethod
from eaglet.errors import PermanentError

PARSE_SCRIPT = Path(__file__).with_name("vllm_parse.py")
PARSE_MARK = "EAGLET_VLLM_PARSE "
PARSE_TIMEOUT_S = 600


class ConventionError(PermanentError, ValueError):
    """An export breaks a convention its engine reads silently (the message names it)."""


def _at(config: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(config, dict):
            return None
        config = config.get(part)  # type: ignore[assignment]
    return config


def convention_problems(
    method: DraftMethod,
    export: str,
    folder: Path,
    trained_ids: list[int],
    target_vocab: int,
    target_layers: int,
    k: int,
) -> list[tuple[str, str]]:
    """(convention, what is wrong) of the export `export` in `folder` of a draft trained on
    the target layers `trained_ids` (eaglet's convention) at `k` drafts per round."""
    convention = method.export_convention(export)
    where = Path(folder) / "config.json"
    config = json.loads(where.read_text())
    problems: list[tuple[str, str]] = []
    architectures = config.get("architectures") or []
    if architectures[:1] != [convention.architecture]:
        problems.append((
            "architecture",
            f"{where}: architectures {architectures}; a {method.name} draft declares "
            f"{convention.architecture!r}, which {convention.engine} routes to "
            f"{convention.engine_class}",
        ))  # fmt: skip
    raw = _at(config, convention.layer_ids_key)
    expected = [int(i) + convention.layer_id_offset for i in trained_ids]
    if not isinstance(raw, list) or not raw:
        problems.append(("layer ids", f"{where}: no {convention.layer_ids_key}"))
    else:
        ids = [int(i) for i in raw]
        if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
            problems.append((
                "layer ids",
                f"{where}: {convention.layer_ids_key} {ids} are not strictly increasing",
            ))  # fmt: skip
        outside = [i for i in ids if not 0 <= i - convention.layer_id_offset < target_layers]
        if outside:
            problems.append((
                "layer ids",
                f"{where}: {convention.layer_ids_key} {outside} name no layer of a "
                f"{target_layers}-layer target ({convention.convention})",
            ))  # fmt: skip
        if ids != expected:
            problems.append((
                "layer ids",
                f"{where}: {convention.layer_ids_key} {ids}; the draft was trained on eaglet "
                f"ids {list(trained_ids)}, which {convention.engine} reads as {expected} "
                f"({convention.convention})",
            ))  # fmt: skip
    return problems + method.export_problems(folder, config, target_vocab, k)


def vllm_parse(
    python: str,
    target: TargetConfig,
    speculative_config: dict[str, object],
    max_model_len: int,
    cwd: Path | None = None,
) -> dict[str, Any]:
    """vLLM's own parse of `vllm serve TARGET --speculative-config ...` (no serving): the
    JSON line of `vllm_parse.py`, `{"parsed": false, "error": ...}` when it refused or died."""
    from eaglet.draft.serving import target_args

    args = [
        *target_args(target, max_model_len),
        "--speculative-config", json.dumps(speculative_config),
    ]  # fmt: skip
    # -I: the script's folder (eaglet/draft, whose module names shadow packages) off sys.path
    command = [python, "-I", str(PARSE_SCRIPT), json.dumps({"args": args})]
    # VLLM_TARGET_DEVICE: the CPU build reads it, a GPU build ignores it
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PARSE_TIMEOUT_S, cwd=cwd, env=env,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"parsed": False, "error": f"{type(error).__name__}: {error}"}
    for line in done.stdout.splitlines():
        if line.startswith(PARSE_MARK):
            result: dict[str, Any] = json.loads(line[len(PARSE_MARK) :])
            return result
    tail = (done.stdout + done.stderr)[-1500:]
    return {"parsed": False, "error": f"exit {done.returncode}, no result: {tail}"}


def check_exports(
    method: DraftMethod,
    base: Path,
    exports: dict[str, str],
    trained_ids: list[int],
    target: TargetConfig,
    k: int,
    vllm_python: str | None = None,
    served_k: int | None = None,
    max_model_len: int = 512,
) -> list[dict[str, Any]]:
    """One row per export (`exports`: export -> folder under `base`), raising `ConventionError`
    naming every broken convention and file. With `vllm_python`, every export vLLM loads is
    parsed by vLLM at `served_k` drafts per round (default `k`)."""
    from eaglet.target import load_config

    target_config = load_config(target)
    target_vocab = int(target_config.vocab_size)
    target_layers = int(target_config.num_hidden_layers)
    limit = getattr(target_config, "max_position_embeddings", None)
    max_model_len = min(max_model_len, int(limit)) if limit else max_model_len
    rows, failed = [], []
    for export, name in exports.items():
        folder = Path(base) / name
        convention = method.export_convention(export)
        problems = convention_problems(
            method, export, folder, trained_ids, target_vocab, target_layers, k
        )
        row: dict[str, Any] = {
            "export": export,
            "engine": convention.engine,
            "folder": name,
            "architecture": convention.architecture,
            "engine_class": convention.engine_class,
            "version": None,
            "parsed": None,
            "loaded": None,
            "served_tau": None,
            "offline_tau": None,
        }
        if convention.engine != "vllm":
            row["parse_note"] = f"eaglet has no {convention.engine} installation to parse with"
        elif vllm_python is None:
            row["parse_note"] = "no vLLM venv configured (evaluate.vllm_python)"
        elif not problems:  # a broken file is named by its convention, not by vLLM's trace
            spec = method.speculative_config(folder, served_k or k)
            parse = vllm_parse(vllm_python, target, spec, max_model_len)
            row.update(version=parse.get("version"), parsed=bool(parse.get("parsed")))
            row["draft_class"] = parse.get("draft_class")
            if parse.get("engine_error"):  # the platform's refusal, not the export's
                row["parse_note"] = (
                    "vLLM parsed the export's speculative config; its engine config on this "
                    f"platform refused: {parse['engine_error']}"
                )
            if parse.get("error"):
                row["parse_error"] = parse["error"]
                problems.append(("engine parse", f"{folder}: vLLM refused it: {parse['error']}"))
            elif parse.get("draft_class") != convention.engine_class:
                problems.append((
                    "architecture",
                    f"{folder / 'config.json'}: vLLM {parse.get('version')} resolves "
                    f"{parse.get('draft_architectures')} to {parse.get('draft_class')}, not "
                    f"{convention.engine_class}",
                ))  # fmt: skip
        row["problems"] = [f"{name_}: {text}" for name_, text in problems]
        rows.append(row)
        failed += row["problems"]
    if failed:
        raise ConventionError(
            "the engine check failed: " + "; ".join(failed) + ". An engine loads such an "
            "export without an error and serves it wrongly; fix the export's writer (or "
            "the file) and rerun"
        )
    return rows


def engine_check_cells(row: dict[str, Any]) -> dict[str, Any]:
    """A row as a table's cells (Prefect artifacts, the run report)."""
    return {
        "export": row["export"], "engine": row["engine"], "folder": row["folder"],
        "version": row.get("version") or "", "conventions": "ok" if not row["problems"] else
        "; ".join(row["problems"]), "parsed": row.get("parsed"), "loaded": row.get("loaded"),
        "served_tau": row.get("served_tau"), "offline_tau": row.get("offline_tau"),
    }  # fmt: skip


def rows_text(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row, for the run report and `eaglet inspect`."""
    lines = []
    for row in rows:
        parsed = {True: "parsed", False: "refused", None: "not parsed"}[row.get("parsed")]
        line = f"{row['export']} ({row['folder']}) in {row['engine']}"
        line += f" {row['version']}" if row.get("version") else ""
        line += f": conventions ok, {parsed}"
        if row.get("parse_note") and row.get("parsed") is None:
            line += f" ({row['parse_note']})"
        if row.get("loaded") is not None:
            line += ", loaded" if row["loaded"] else ", not loaded"
        if row.get("served_tau") is not None:
            line += f", served tau {row['served_tau']:.3f}"
        if row.get("offline_tau") is not None:
            line += f", offline tau {row['offline_tau']:.3f}"
        lines.append(line)
    return lines
