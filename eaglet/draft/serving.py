"""Serving-verified acceptance: the draft inside a real vLLM server, measured by its own counters.

Owns the command of a vLLM server for the target with the draft as its `eagle3` speculative
model (started and stopped by `eaglet.vllm_process`),
reading the spec-decode counters of `GET /metrics` (`read_counters`), and `served_acceptance`:
send the held-out prompts as token ids (greedy, or sampled at evaluate.temperature and top_p with
seeded requests; the evaluation's max_new_tokens and end tokens),
read the counters before and after, and turn the deltas into tau = 1 + accepted / drafts, the
acceptance per draft position and `emitted_tau` (output tokens per round, from the responses'
token counts: tau without the drafts accepted past a request's stop). vLLM's k is a server
setting (`num_speculative_tokens` of
`--speculative-config`); the deltas say which k the server ran (draft tokens / drafts), and a
server running another k than the offline evaluation is an error, since tau is only comparable
at the same k. Counters are server-wide: on a shared endpoint, other traffic during the
measurement is counted too.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from eaglet.config.evaluate import EvaluateConfig
from eaglet.config.target import TargetConfig
from eaglet.draft.methods import method_of_draft
from eaglet.errors import PermanentError
from eaglet.progress import Steps
from eaglet.target import load_config, target_dtype
from eaglet.vllm_process import free_port, vllm_server

PREFIX = "vllm:spec_decode_"
DRAFTS = PREFIX + "num_drafts_total"
DRAFT_TOKENS = PREFIX + "num_draft_tokens_total"
ACCEPTED = PREFIX + "num_accepted_tokens_total"
ACCEPTED_PER_POS = PREFIX + "num_accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_POSITION = re.compile(r'position="(\d+)"')


# vLLM 0.32's CPU build spreads each request's temperature over its draft positions with a
# kernel that casts the floats to integers (vllm/utils/cpu_triton_utils.py, _expand_kernel_impl):
# sampled verification then divides the target's logits by garbage (tests/test_serving_vllm.py)
SAMPLED_CAUSE = (
    ", or a server that verifies sampled drafts wrongly: vLLM 0.32's CPU build does (it "
    "casts each request's temperature to an integer there); check sampled tau on a GPU build, "
    "or set evaluate.temperature: 0 for the served check"
)


class ServingError(PermanentError, RuntimeError):
    """The server cannot give a served tau (no speculative decoding, another k, no drafts)."""


class ServingGapError(PermanentError, ValueError):
    """Served tau and offline tau differ by more than `evaluate.max_serving_gap`."""


@dataclass
class SpecDecodeCounters:
    """vLLM's spec-decode counters, summed over engines; `per_position[j]` = accepted tokens at
    draft position j (0-based)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: dict[int, float] = field(default_factory=dict)

    def __sub__(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        positions = set(self.per_position) | set(before.per_position)
        return SpecDecodeCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            {
                j: self.per_position.get(j, 0.0) - before.per_position.get(j, 0.0)
                for j in sorted(positions)
            },
        )

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")


def emitted_tau(new_tokens: int, num_prompts: int, num_rounds: int) -> float:
    """Tokens a verification round adds to the output, on average: every output token but each
    prompt's first (the prefill's) over the rounds. tau (1 + accepted / rounds, vLLM's count)
    also credits the drafts accepted past the stop in a request's last round, which add nothing
    to the output; this figure, which speed follows, does not."""
    return (new_tokens - num_prompts) / num_rounds if num_rounds else float("nan")


def parse_counters(metrics_text: str) -> SpecDecodeCounters | None:
    """The spec-decode counters from Prometheus text; None when the server has none (it runs
    without speculative decoding)."""
    counters, seen = SpecDecodeCounters(), False
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or not match["name"].startswith(PREFIX):
            continue
        name, value = match["name"], float(match["value"])
        seen = True
        if name == DRAFTS:
            counters.drafts += value
        elif name == DRAFT_TOKENS:
            counters.draft_tokens += value
        elif name == ACCEPTED:
            counters.accepted += value
        elif name == ACCEPTED_PER_POS:
            position = _POSITION.search(match["labels"] or "")
            if position is not None:
                j = int(position.group(1))
                counters.per_position[j] = counters.per_position.get(j, 0.0) + value
    return counters if seen else None


def read_counters(client: httpx.Client, base_url: str) -> SpecDecodeCounters:
    response = client.get(f"{base_url}/metrics", timeout=30)
    response.raise_for_status()
    counters = parse_counters(response.text)
    if counters is None:
        raise ServingError(
            f"{base_url}/metrics has no vllm:spec_decode_* counters: the server runs without "
            "speculative decoding; start it with --speculative-config "
            '\'{"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": K}\''
        )
    return counters


def served_model_name(client: httpx.Client, base_url: str) -> str:
    response = client.get(f"{base_url}/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def served_acceptance(
    base_url: str,
    prompts: list[list[int]],
    num_speculative_tokens: int,
    max_new_tokens: int,
    stop_token_ids: list[int],
    concurrency: int = 4,
    request_timeout_s: float = 600.0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> dict:
    """Send `prompts` (token ids; greedy, or sampled at `temperature` and `top_p` with request
    i seeded `seed + i`) and measure tau from the counters' deltas."""
    base_url = base_url.rstrip("/")
    t0 = time.time()
    with httpx.Client() as client:
        model = served_model_name(client, base_url)
        before = read_counters(client, base_url)

        def complete(numbered: tuple[int, list[int]]) -> int:
            i, prompt = numbered
            body = {
                "model": model, "prompt": prompt, "max_tokens": max_new_tokens,
                "temperature": temperature, "stop_token_ids": stop_token_ids,
            }  # fmt: skip
            if temperature > 0:
                body.update(top_p=top_p, seed=seed + i)
            response = client.post(
                f"{base_url}/v1/completions", json=body, timeout=request_timeout_s
            )
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            new_tokens = sum(pool.map(complete, enumerate(prompts)))
        delta = read_counters(client, base_url) - before
    if delta.drafts <= 0:
        raise ServingError(
            f"{base_url}: {len(prompts)} prompts gave no drafts in vLLM's counters; is the "
            "draft loaded as the speculative model?"
        )
    served_k = delta.draft_tokens / delta.drafts
    if round(served_k) != num_speculative_tokens:
        raise ServingError(
            f"{base_url} drafts {served_k:.2f} tokens per round, the offline evaluation "
            f"{num_speculative_tokens}: set evaluate.num_speculative_tokens to the server's "
            "num_speculative_tokens (or restart the server with it) so tau compares at the same k"
        )
    return {
        "tau": delta.tau,
        "temperature": temperature,
        **({"top_p": top_p} if temperature > 0 else {}),
        "num_speculative_tokens": num_speculative_tokens,
        "num_prompts": len(prompts),
        "num_drafts": int(delta.drafts),
        "draft_tokens": int(delta.draft_tokens),
        "accepted_tokens": int(delta.accepted),
        "new_tokens": new_tokens,
        "emitted_tau": emitted_tau(new_tokens, len(prompts), int(delta.drafts)),
        "acceptance_rate": delta.accepted / delta.draft_tokens if delta.draft_tokens else 0.0,
        # accepted at draft position j (1-based) over all drafts, as the offline report says it
        "per_position_acceptance": [
            delta.per_position.get(j, 0.0) / delta.drafts for j in range(num_speculative_tokens)
        ],
        "seconds": time.time() - t0,
    }


# --------------------------------------------------------------------------- the server


def speculative_config(draft_dir: Path, num_speculative_tokens: int) -> dict:
    """vLLM's `--speculative-config` for the draft in `draft_dir`, by its method."""
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    return method_of_draft(config).speculative_config(Path(draft_dir), int(num_speculative_tokens))


def vllm_command(
    python: str,
    target: TargetConfig,
    draft_dir: Path | None,
    num_speculative_tokens: int,
    port: int,
    max_model_len: int | None,
    extra_args: list[str],
) -> list[str]:
    """The server eaglet starts: the target with the draft (`draft_dir`), or alone (None)."""
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", *target_args(target, max_model_len),
        "--served-model-name", "eaglet-target", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if draft_dir is not None:
        spec = speculative_config(draft_dir, num_speculative_tokens)
        command += ["--speculative-config", json.dumps(spec)]
    return command + list(extra_args)


def target_args(target: TargetConfig, max_model_len: int | None) -> list[str]:
    """vLLM's arguments for the target: every server eaglet starts and the engine check's
    parse (`eaglet.draft.engine_check.vllm_parse`) name it so."""
    args = ["--model", target.model, "--dtype", target_dtype(target)]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    if target.revision:
        args += ["--revision", target.revision]
    if target.trust_remote_code:
        args += ["--trust-remote-code"]
    return args


def check_gap(served: dict, offline_tau: float, max_gap: float, where: str) -> float:
    """|served tau - offline tau| at the same k and temperature; above `max_gap` a
    `ServingGapError` with both."""
    gap = abs(served["tau"] - offline_tau)
    if gap > max_gap:
        at = f"temperature {served['temperature']:g}" if served.get("temperature") else "greedy"
        raise ServingGapError(
            f"served tau {served['tau']:.3f} (vLLM's counters: {served['num_drafts']} drafts, "
            f"{served['accepted_tokens']} accepted, k={served['num_speculative_tokens']}) vs "
            f"offline tau {offline_tau:.3f} at the same k, {at}: gap {gap:.3f} > "
            f"evaluate.max_serving_gap {max_gap}. The draft serves differently from how it was "
            f"evaluated (layer ids read in another convention, another target or draft on the "
            f"server, a dtype change{SAMPLED_CAUSE if served.get('temperature') else ''}); both "
            f"reports are in {where}"
        )
    return gap


def _started(settings: EvaluateConfig, log_path: Path) -> dict:
    """How `vllm_server` starts each server of the served check: its log, its time limit."""
    return dict(
        log_path=log_path, startup_timeout_s=settings.startup_timeout_s,
        timeout_setting="evaluate.startup_timeout_s",
    )  # fmt: skip


def measure_served(
    settings: EvaluateConfig,
    target: TargetConfig,
    draft_dir: Path,
    prompts: list[list[int]],
    stop_token_ids: list[int],
    log_path: Path,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Served tau of the draft in `draft_dir` (the vLLM export) on `prompts`: at
    `settings.serving_endpoint`, or in servers started here with `settings.vllm_python` and
    stopped before this returns (their logs beside `log_path`): the served check, and with
    `speedup_concurrency` and the calibration their figures, each server a step whose progress
    goes to `log` (`eaglet.progress.Steps`)."""
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    k = method_of_draft(config).evaluation_k(config, settings.num_speculative_tokens)
    measure = dict(
        prompts=prompts, num_speculative_tokens=k, max_new_tokens=settings.max_new_tokens,
        stop_token_ids=stop_token_ids, temperature=settings.temperature, top_p=settings.top_p,
        seed=settings.sampling_seed,
    )  # fmt: skip
    if settings.serving_endpoint:
        return dict(served_acceptance(settings.serving_endpoint, **measure), server="endpoint")
    longest = max(len(p) for p in prompts) + settings.max_new_tokens + k + 16
    limit = getattr(load_config(target), "max_position_embeddings", None)
    max_model_len = min(longest, limit) if limit else longest
    command = vllm_command(
        settings.vllm_python, target, draft_dir, k, free_port(), max_model_len, settings.vllm_args
    )
    ks = (settings.calibration_k or list(range(1, k + 1))) if settings.calibrates else []
    servers = 1 + bool(settings.speedup_concurrency) + (len(set(ks) - {k}) + 1 if ks else 0)
    with Steps("served check", servers, log) as steps:
        steps.start(f"vLLM with the draft at k={k}")
        with vllm_server(command, **_started(settings, log_path)) as base_url:
            served = served_acceptance(base_url, **measure)
            with_draft = throughput(base_url, prompts, settings, stop_token_ids, counters=True)
        steps.finish("; ".join([f"served τ {served['tau']:.3f}", *_rates(with_draft)]))
        served = dict(served, server="started by eaglet", command=command)
        without: dict[int, dict] = {}
        if settings.speedup_concurrency:
            steps.start("vLLM without the draft")
            plain = vllm_command(
                settings.vllm_python, target, None, k, free_port(), max_model_len,
                settings.vllm_args,
            )  # fmt: skip
            alone = _started(settings, log_path.with_name(log_path.stem + "-no-draft.log"))
            with vllm_server(plain, **alone) as base_url:
                without = throughput(base_url, prompts, settings, stop_token_ids, counters=False)
            steps.finish("".join(_rates(without)))
            served["speedup"] = speedup_table(with_draft, without)
        if ks:
            served["calibration"] = calibrate(
                settings, target, draft_dir, prompts, stop_token_ids, log_path, max_model_len,
                {k: with_draft}, without, ks, steps,
            )  # fmt: skip
    return served


def _rates(rows: dict[int, dict]) -> list[str]:
    """Throughput's rows as a progress line's part ([] without any)."""
    said = ", ".join(f"{r['output_tokens_per_s']:.0f} at {c}" for c, r in rows.items())
    return [f"output tokens/s at each concurrency: {said}"] if said else []


def calibrate(
    settings: EvaluateConfig,
    target: TargetConfig,
    draft_dir: Path,
    prompts: list[list[int]],
    stop_token_ids: list[int],
    log_path: Path,
    max_model_len: int,
    measured: dict[int, dict[int, dict]],
    without: dict[int, dict],
    ks: list[int],
    steps: Steps,
) -> dict:
    """The served figures at each of `ks` (`eaglet.draft.calibration`), a server per k not
    yet `measured`, the bands' best k and a last server run with that schedule, whose
    counters say whether the build applies it; each server a step of `steps`."""
    from eaglet.draft.calibration import (
        bands,
        calibration_table,
        schedule_applied,
        schedule_to_check,
        scheduled_config,
    )

    by_k = {k: rows for k, rows in measured.items() if k in ks}

    def serve(k: int, spec: dict | None, name: str) -> dict[int, dict]:
        steps.start(f"vLLM at k={k}" if spec is None else "vLLM with the chosen schedule")
        command = vllm_command(
            settings.vllm_python, target, draft_dir, k, free_port(), max_model_len,
            settings.vllm_args,
        )  # fmt: skip
        if spec is not None:
            command[command.index("--speculative-config") + 1] = json.dumps(spec)
        started = _started(settings, log_path.with_name(f"{log_path.stem}-{name}.log"))
        with vllm_server(command, **started) as base_url:
            rows = throughput(base_url, prompts, settings, stop_token_ids, counters=True)
        steps.finish("".join(_rates(rows)))
        return rows

    for k in ks:
        if k not in by_k:
            by_k[k] = serve(k, None, f"k{k}")
    table = calibration_table(by_k, without)
    chosen = bands(table)
    spec = scheduled_config(speculative_config(draft_dir, max(ks)), chosen)
    if schedule_to_check(chosen):
        check = serve(max(ks), spec, "schedule")
    else:
        check, steps.total = {}, steps.total - 1  # its server was counted in advance
    return {
        "table": table,
        "bands": chosen,
        "speculative_config": spec,
        "schedule_check": schedule_applied(chosen, check),
    }


def throughput(
    base_url: str,
    prompts: list[list[int]],
    settings: EvaluateConfig,
    stop_token_ids: list[int],
    counters: bool,
) -> dict[int, dict]:
    """Per concurrency c: the prompts (repeated to at least c) sent c at a time, greedy:
    output tokens/s, time per output token (a request's seconds over its tokens, averaged),
    and with `counters` τ from vLLM's counters diffed over this batch alone."""
    out = {}
    with httpx.Client() as client:
        model = served_model_name(client, base_url)
        for c in settings.speedup_concurrency:
            batch = (prompts * ((c + len(prompts) - 1) // len(prompts)))[: max(c, len(prompts))]
            before = read_counters(client, base_url) if counters else None

            def one(prompt: list[int]) -> tuple[int, float]:
                body = {
                    "model": model,
                    "prompt": prompt,
                    "temperature": 0.0,
                    "max_tokens": settings.max_new_tokens,
                    "stop_token_ids": stop_token_ids,
                }
                started = time.perf_counter()
                response = client.post(f"{base_url}/v1/completions", json=body, timeout=600)
                response.raise_for_status()
                tokens = int(response.json()["usage"]["completion_tokens"])
                return tokens, (time.perf_counter() - started) / max(tokens, 1)

            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=c) as pool:
                results = list(pool.map(one, batch))
            seconds = time.perf_counter() - t0
            tokens = sum(n for n, _ in results)
            row = {
                "requests": len(batch),
                "output_tokens": tokens,
                "seconds": seconds,
                "output_tokens_per_s": tokens / max(seconds, 1e-9),
                "time_per_output_token_ms": 1000 * sum(t for _, t in results) / len(results),
            }
            if before is not None:
                delta = read_counters(client, base_url) - before
                row["served_tau"] = delta.tau if delta.drafts else None
                row["draft_tokens_per_draft"] = (
                    delta.draft_tokens / delta.drafts if delta.drafts else None
                )
            out[c] = row
    return out


def speedup_table(with_draft: dict[int, dict], without: dict[int, dict]) -> list[dict]:
    """One row per concurrency: both runs' output tokens/s and time per output token, and the
    speed-up (with / without). The fixture's draft is nearly as large as its target on a CPU:
    its figure says how a round's costs compare here, not what a GPU serving a real model gets."""
    return [
        {
            "concurrency": c,
            "output_tokens_per_s": with_draft[c]["output_tokens_per_s"],
            "output_tokens_per_s_without_draft": without[c]["output_tokens_per_s"],
            "speedup": with_draft[c]["output_tokens_per_s"]
            / max(without[c]["output_tokens_per_s"], 1e-9),
            "time_per_output_token_ms": with_draft[c]["time_per_output_token_ms"],
            "time_per_output_token_ms_without_draft": without[c]["time_per_output_token_ms"],
            "served_tau": with_draft[c].get("served_tau"),
        }
        for c in sorted(with_draft)
    ]
