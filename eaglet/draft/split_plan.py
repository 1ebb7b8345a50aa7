"""How many capture servers keep how many training ranks busy: measured, not found by hand.

Online training from vLLM servers (train.hidden_states: online, hidden_states.backend: vllm)
runs at the slower of two rates: what the capture servers deliver (samples/s per server) and
what the training ranks consume (samples/s per rank). `calibrate` measures both for this target
and draft on a short calibration: each server of `hidden_states.vllm.endpoints` alone, at its
`concurrency`, on requests of the run's sample length; one training rank on this machine's
`train.device`, a few optimizer steps of the real trainer (`eaglet.draft.train.setup` and
`train_step`) on features of the right widths (their values do not change the arithmetic).
`SplitPlan` says what the configured servers and ranks give, which side bounds the run, and
the best split of the same number of devices (SpecForge found 5+3 on H200 and 4+4 on B300 by
hand). `eaglet doctor` prints `doctor_lines`; a finished run's train manifest holds the
rates it saw (`eaglet.draft.ledger.throughput`), which the report shows
(`eaglet.report_figures.train`).
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglet.config import PipelineConfig
from eaglet.draft.vocab import count_tokens
from eaglet.hidden_states.backends.base import Window
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION, layer_ids_of
from eaglet.target import load_config

CAPTURE_REQUESTS_PER_SLOT = 3  # calibration requests per unit of hidden_states.vllm.concurrency
TRAIN_STEPS = 4  # measured optimizer steps, after one warm-up step


@dataclass
class Calibration:
    server_rates: dict[str, float]  # url -> samples/s, that server alone
    rank_rate: float  # samples/s one training rank trains (its compute only)
    sample_tokens: int  # the length of the calibration samples
    device: str


@dataclass
class SplitPlan:
    calibration: Calibration
    servers: int  # configured: hidden_states.vllm.endpoints
    ranks: int  # configured: train.nnodes x train.nproc_per_node

    @property
    def server_rate(self) -> float:  # the mean server's samples/s
        rates = list(self.calibration.server_rates.values())
        return sum(rates) / len(rates) if rates else 0.0

    @property
    def ranks_per_server(self) -> float:
        return self.server_rate / max(self.calibration.rank_rate, 1e-9)

    @property
    def capture_rate(self) -> float:
        return sum(self.calibration.server_rates.values())

    @property
    def training_rate(self) -> float:
        return self.ranks * self.calibration.rank_rate

    @property
    def bound(self) -> str:
        return "capture" if self.capture_rate < self.training_rate else "training"

    def best_split(self, devices: int) -> tuple[int, int, float]:
        """(servers, ranks, samples/s) of `devices` shared between the two sides, best rate."""
        c, t = self.server_rate, self.calibration.rank_rate
        return max(
            ((s, devices - s, min(s * c, (devices - s) * t)) for s in range(1, devices)),
            key=lambda split: split[2],
            default=(1, 1, min(c, t)),
        )

    def lines(self) -> list[str]:
        cal = self.calibration
        out = [
            f"split: capture server {url}: {rate:.1f} samples/s"
            for url, rate in cal.server_rates.items()
        ]
        out.append(
            f"split: one training rank ({cal.device}): {cal.rank_rate:.1f} samples/s "
            f"({cal.sample_tokens}-token samples, train.batch_size rows a step)"
        )
        need = math.ceil(self.training_rate / max(self.server_rate, 1e-9))
        keep = math.floor(self.capture_rate / max(cal.rank_rate, 1e-9))
        out.append(
            f"split: one server keeps {self.ranks_per_server:.2f} ranks busy; the "
            f"{self.ranks} rank(s) configured need {need} server(s), the {self.servers} "
            f"configured keep {keep} rank(s) busy"
        )
        rate = min(self.capture_rate, self.training_rate)
        waits = "the ranks wait for features" if self.bound == "capture" else "the servers idle"
        out.append(
            f"split: as configured ({self.servers} servers + {self.ranks} ranks) "
            f"{rate:.1f} samples/s, bound by {self.bound} ({waits})"
        )
        devices = self.servers + self.ranks
        if devices >= 2:
            s, r, best = self.best_split(devices)
            out.append(
                f"split: suggested for {devices} devices: {s} server(s) + {r} rank(s), "
                f"{best:.1f} samples/s"
            )
        return out


def calibrate(config: PipelineConfig, sample_tokens: int | None = None) -> Calibration:
    """Both rates for `config` (its servers must be up). `sample_tokens`: the calibration
    samples' length (default: `run_sample_tokens`)."""
    from eaglet.draft.train import training_device

    tokens = sample_tokens or run_sample_tokens(config)
    return Calibration(
        server_rates=capture_rates(config, tokens),
        rank_rate=training_rate(config, tokens),
        sample_tokens=tokens,
        device=str(training_device(config.train)),
    )


def run_sample_tokens(config: PipelineConfig) -> int:
    """A sample of this run: a prompt of half its limit and a whole answer, within a window."""
    generation = config.generation.max_tokens + config.tokenize.max_prompt_tokens // 2
    return max(8, min(config.train.max_seq_len, generation))


def _samples(config: PipelineConfig, count: int, tokens: int) -> list[Window]:
    vocab = load_config(config.target).vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (count, tokens), generator=g)
    return [Window(f"calibration-{i}", row.tolist()) for i, row in enumerate(ids)]


def capture_rates(config: PipelineConfig, tokens: int) -> dict[str, float]:
    """url -> samples/s of each capture server alone (one warm-up request first)."""
    from eaglet.hidden_states.backends.vllm import VllmBackend

    settings = config.hidden_states
    aux = layer_ids_of(config, load_config(config.target).num_hidden_layers)
    count = CAPTURE_REQUESTS_PER_SLOT * settings.vllm.concurrency
    rates = {}
    for url in settings.vllm.endpoints:
        one = settings.model_copy(
            update={"vllm": settings.vllm.model_copy(update={"endpoints": [url]})}
        )
        source = VllmBackend(config.target, one, aux)
        try:
            source.features(_samples(config, 1, tokens))
            started = time.monotonic()
            source.features(_samples(config, count, tokens))
            rates[url.rstrip("/")] = count / (time.monotonic() - started)
        finally:
            source.close()
    return rates


class CalibrationData:
    """Windows of `tokens` tokens with random features of the target's widths: what the
    trainer reads, for timing only (the `HiddenStatesData` interface)."""

    mode = "calibration"
    root = Path("calibration")

    def __init__(self, count: int, tokens: int, vocab: int, hidden: int, layers: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (count, tokens), generator=g)  # [N, n]
        self.hidden, self.layers, self.tokens = hidden, layers, tokens
        self.windows = [(i, 0, tokens) for i in range(count)]
        self.samples = [{"sample_id": f"c{i}", "length": tokens} for i in range(count)]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        n, H = self.tokens, self.hidden
        return {
            "input_ids": self.ids[i],  # [n]
            "loss_mask": torch.arange(n) >= n // 4,  # [n]: the answer, as extract marks it
            "aux_hidden_states": torch.randn(n, self.layers * H, generator=g),  # [n, kH]
            "final_hidden_states": torch.randn(n, H, generator=g),  # [n, H]
        }

    def aux_width(self) -> int:
        return self.layers * self.hidden

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for row in self.ids:
            counts += count_tokens(row, torch.arange(len(row)) >= 0, vocab_size)
        return counts

    def fingerprint(self, batch_size: int, max_seq_len: int) -> str:
        return "calibration"


def training_rate(config: PipelineConfig, tokens: int) -> float:
    """Samples/s of one training rank: `TRAIN_STEPS` optimizer steps of the real trainer
    (after a warm-up step) on calibration windows, in a scratch folder."""
    from eaglet.draft.train import setup, train_step

    train = config.train.model_copy(update={"init_from": None, "keep_best": "off"})
    model = load_config(config.target)
    aux = layer_ids_of(config, model.num_hidden_layers)
    batches = TRAIN_STEPS + 1
    data = CalibrationData(
        batches * train.batch_size, tokens, model.vocab_size, model.hidden_size, len(aux)
    )
    seconds = []
    with tempfile.TemporaryDirectory(prefix="eaglet-calibration-") as scratch:
        run = setup(data, config.target, Path(scratch), train, aux, AUX_LAYER_CONVENTION, False)
        for b in range(batches):
            rows = list(range(b * train.batch_size, (b + 1) * train.batch_size))
            started = time.monotonic()
            train_step(run, rows)
            seconds.append(time.monotonic() - started)
    return train.batch_size / statistics.median(seconds[1:])


def doctor_lines(config: PipelineConfig) -> list[str]:
    """What `eaglet doctor` says of the split: nothing unless the run trains online from
    served features; else the calibration's rates and the plan, or why it could not run."""
    if config.train.hidden_states != "online" or config.hidden_states.backend != "vllm":
        return []
    if config.hidden_states.vllm.vllm_python:
        return ["split: not measured (eaglet starts its own server during the run; list "
                "running servers in hidden_states.vllm.endpoints to plan a split)"]  # fmt: skip
    try:
        calibration = calibrate(config)
    except Exception as exc:  # a server down: the preflight above names it
        return [f"split: not measured: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"]
    ranks = config.train.nnodes * config.train.nproc_per_node
    return SplitPlan(calibration, len(config.hidden_states.vllm.endpoints), ranks).lines()
