"""The run report's key figures of each stage, read from its manifest (a dict): one function
per stage, named as the stage (`FIGURES`), and the formats every report shares.

Kept apart from the stage bodies, and out of every stage's code (`eaglet.cache.NOT_OUTPUT`):
rewording a figure never changes a stage's code hash.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eaglet.draft.methods.registry import DEFAULT_METHOD
from eaglet.draft.sampled import sampled_text
from eaglet.draft.segments import segments_text
from eaglet.stages import REJECTED_FILE


def percent(value: float | None) -> str:
    """A share as `12.3%`, `n/a` when unknown (the one format of every report)."""
    return "n/a" if value is None else f"{value:.1%}"


def training_line(info: dict[str, Any]) -> str:
    """Which hidden-states mode trained the draft and the disk its features took or saved."""
    from eaglet.hidden_states.budget import human

    if info.get("hidden_states_mode") == "online":
        saved = info.get("feature_bytes_saved", 0)
        storage = info.get("feature_bytes_saved_storage", "?")
        line = f"online hidden states, 0 B stored ({human(saved)} of {storage} shards saved)"
    else:
        line = f"offline hidden states, {human(info.get('feature_bytes_stored', 0))} of shards"
    if info.get("best_epoch") is not None:  # train.keep_best
        line += f"; draft of epoch {info['best_epoch']:g} (lowest held-out loss)"
    return line


def download(manifest: dict[str, Any]) -> str:
    counts, info = manifest.get("counts", {}), manifest.get("info", {})
    sources = ", ".join(f"{s} {n}" for s, n in info.get("per_source", {}).items())
    text = f"{sources}; {counts.get('duplicates', 0)} duplicates dropped"
    if counts.get("skipped"):
        text += f"; {counts['skipped']} rows skipped ({REJECTED_FILE})"
    return text


def tokenize(manifest: dict[str, Any]) -> str:
    counts = manifest.get("counts", {})
    text = f"{counts.get('rejected', 0)} rejected, {counts.get('too_long', 0)} too long"
    if counts.get("over_context"):
        text += f", {counts['over_context']} over the model's context"
    return text


def generate(manifest: dict[str, Any]) -> str:
    counts, info = manifest.get("counts", {}), manifest.get("info", {})
    records, truncated = counts.get("records", 0), counts.get("truncated", 0)
    return (
        f"engine {info.get('engine', '?')}; {counts.get('failed', 0)} failed samples; "
        f"{truncated} truncated ({percent(truncated / records if records else None)})"
        + (f"; {counts['looped']} stopped looping" if counts.get("looped") else "")
    )


def extract(manifest: dict[str, Any]) -> str:
    quality = manifest.get("info", {}).get("quality", {})
    return (
        f"format {quality.get('reasoning_format', '?')}; reasoning captured "
        f"{percent(quality.get('reasoning_capture_rate'))}; truncated "
        f"{percent(quality.get('truncation_rate'))}"
    )


def hidden_states(manifest: dict[str, Any]) -> str:
    return f"{manifest.get('counts', {}).get('tokens', 0):,} tokens"


def train(manifest: dict[str, Any]) -> str:
    info = manifest.get("info", {})
    final, initial = info.get("final_loss"), info.get("initial_loss")
    loss = "n/a" if final is None else f"{final:.4f}"
    if final is not None and initial is not None:
        loss += f" (first {initial:.4f})"
    method = info.get("method", DEFAULT_METHOD)
    text = f"{method} draft; final loss {loss}; {info.get('steps', 0)} steps"
    if "hidden_states_mode" in info:
        text += f"; {training_line(info)}"
    throughput = info.get("throughput")
    if throughput:  # the finished run's rates (`eaglet.draft.ledger.throughput`)
        ranks = throughput["ranks"]
        per_rank = sum(r["samples_per_s"] for r in ranks) / len(ranks)
        text += f"; {len(ranks)} rank(s) at {per_rank:.1f} samples/s each"
        servers = throughput.get("servers") or {}
        if servers:
            rates = ", ".join(f"{s['samples_per_s']:.1f}" for s in servers.values())
            text += (
                f", {len(servers)} capture server(s) at {rates} samples/s, the ranks waited "
                f"{throughput['wait_share']:.0%} of their step time: bound by {throughput['bound']}"
            )
    return text


def evaluate(manifest: dict[str, Any]) -> str:
    info = manifest.get("info", {})
    tau, untrained = info.get("tau"), info.get("untrained_tau")
    if tau is None:
        return ""
    method = info.get("method", DEFAULT_METHOD)
    text = f"τ {tau:.3f} ({method}) trained vs {untrained:.3f} untrained"
    if info.get("segments"):
        text += "; " + segments_text(info["segments"], symbol="τ")
    if info.get("sampled"):
        text += "; " + sampled_text(info["sampled"], symbol="τ")
    if info.get("sets"):
        text += "; sets: " + ", ".join(f"{n} τ {t:.3f}" for n, t in info["sets"].items())
    return text


# A stage -> its key figures from its manifest (a stage with none shows none).
FIGURES: dict[str, Callable[[dict[str, Any]], str]] = {
    f.__name__: f for f in (download, tokenize, generate, extract, hidden_states, train, evaluate)
}
