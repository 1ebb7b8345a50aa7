"""Serving calibration: which k to serve the draft at, per band of batch sizes, measured.

With `evaluate.serving: vllm` and servers eaglet starts (unless `evaluate.calibration: false`),
the served check serves the held-out prompts at each k (`evaluate.calibration_k`, default 1..the
evaluated k) and each concurrency of `evaluate.speedup_concurrency`, with and without the draft
(`eaglet.draft.serving.calibrate`). Here, from those figures: the table (`calibration_table`),
the best k per band of batch sizes (`bands`: band i runs from concurrency c_i to c_{i+1} - 1,
the last to vLLM's max_num_seqs; a band where no k beats serving without the draft gets k = 0,
which vLLM 0.32 reads as "no drafts at these batch sizes", and says so), vLLM 0.32's
`num_speculative_tokens_per_batch_size` (a list of (first batch size, last batch size, k)), the
`serving.json` document and its plot. A server started with that schedule is measured once
more (`schedule_check`): vLLM's counters say how many tokens each draft held at each load, so
whether the build applies the schedule or serves the static k is read, not assumed.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

SERVING_FILE = "serving.json"
CALIBRATION_PLOT_FILE = "calibration.png"
MAX_NUM_SEQS = 256  # vLLM 0.32's default max_num_seqs: the last band's end


def calibration_table(by_k: dict[int, dict[int, dict]], without: dict[int, dict]) -> list[dict]:
    """One row per (k, concurrency): output tokens/s with and without the draft, the
    speed-up, served τ and the tokens each draft held (vLLM's counters over that batch)."""
    return [
        {
            "k": k,
            "concurrency": c,
            "output_tokens_per_s": row["output_tokens_per_s"],
            "output_tokens_per_s_without_draft": without[c]["output_tokens_per_s"],
            "speedup": row["output_tokens_per_s"] / max(without[c]["output_tokens_per_s"], 1e-9),
            "served_tau": row.get("served_tau"),
            "draft_tokens_per_draft": row.get("draft_tokens_per_draft"),
        }
        for k in sorted(by_k)
        for c, row in sorted(by_k[k].items())
    ]


def bands(table: list[dict], max_num_seqs: int = MAX_NUM_SEQS) -> list[dict]:
    """The best k for each band of batch sizes, from the concurrency that starts it; k = 0
    where no k beats serving without the draft."""
    loads = sorted({row["concurrency"] for row in table})
    out = []
    for i, c in enumerate(loads):
        last = loads[i + 1] - 1 if i + 1 < len(loads) else max(max_num_seqs, c)
        best = max((r for r in table if r["concurrency"] == c), key=lambda r: r["speedup"])
        wins = best["speedup"] > 1.0
        out.append({
            "first_batch_size": 1 if i == 0 else c,
            "last_batch_size": last,
            "measured_at_concurrency": c,
            "k": best["k"] if wins else 0,
            "speedup": best["speedup"],
            "note": f"k = {best['k']}: {best['speedup']:.2f}x"
            if wins
            else f"no k beats serving without the draft (best: k = {best['k']}, "
            f"{best['speedup']:.2f}x): no drafts at these batch sizes",
        })  # fmt: skip
    return out


def scheduled_config(base: dict[str, Any], chosen: list[dict]) -> dict[str, Any]:
    """`--speculative-config` with the schedule: k per band, the largest as the static k
    (vLLM caps each band's k at num_speculative_tokens)."""
    largest = max((b["k"] for b in chosen), default=0)
    return {
        **base,
        "num_speculative_tokens": max(largest, 1),
        "num_speculative_tokens_per_batch_size": [
            [b["first_batch_size"], b["last_batch_size"], b["k"]] for b in chosen
        ],
    }


def schedule_to_check(chosen: list[dict]) -> bool:
    """Whether a server run with the schedule can tell anything: not when every band drafts
    the same k > 0 (the schedule is that static k; `schedule_applied` finds it undecidable
    whatever the counters say), so no server is started for it."""
    return len({band["k"] for band in chosen}) > 1 or chosen[0]["k"] == 0


def schedule_applied(chosen: list[dict], check: dict[int, dict]) -> dict[str, Any]:
    """Whether a server run with the schedule drafted each band's k: per concurrency the
    tokens per draft vLLM's counters show, against the band's k and the static k."""
    static = max((b["k"] for b in chosen), default=0)
    rows, verdicts = [], []
    for band in chosen:
        c = band["measured_at_concurrency"]
        held = check.get(c, {}).get("draft_tokens_per_draft")
        rows.append({"concurrency": c, "band_k": band["k"], "draft_tokens_per_draft": held})
        if band["k"] != static and held is not None:
            verdicts.append(abs(held - band["k"]) < abs(held - static))
        elif band["k"] == 0 and held is None:
            verdicts.append(True)  # no drafts at all where the band says none
    if not verdicts:
        verdict = "not decidable: every band chose the same k"
    elif all(verdicts):
        verdict = "applied: each band drafted its own k"
    elif not any(verdicts):
        verdict = (
            f"not applied: the server drafted the static k = {static} at each load whose band "
            "chose another k"
        )
    else:
        verdict = "partly applied: some bands drafted their k, others the static one"
    return {"verdict": verdict, "per_concurrency": rows}


def machine() -> dict[str, Any]:
    """Where the figures were measured (a CPU's figures are no GPU's)."""
    found: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        if torch.cuda.is_available():
            found["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return found


def plot_calibration(table: list[dict], chosen: list[dict], path: Path) -> Path:
    """Speed-up against concurrency, one line per k, each band's chosen k marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for k in sorted({r["k"] for r in table}):
        rows = sorted((r for r in table if r["k"] == k), key=lambda r: r["concurrency"])
        ax.plot([r["concurrency"] for r in rows], [r["speedup"] for r in rows], marker="o",
                label=f"k = {k}")  # fmt: skip
    for band in chosen:
        if band["k"]:
            ax.scatter([band["measured_at_concurrency"]], [band["speedup"]], s=160,
                       facecolors="none", edgecolors="black")  # fmt: skip
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests at once)")
    ax.set_ylabel("speed-up (output tokens/s with / without the draft)")
    ax.set_title("Serving calibration (circled: the chosen k per band)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
