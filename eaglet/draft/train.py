"""Train a draft model on the target's hidden states: the run and its loop.

This module owns the run; the data side (shards -> windows -> this process's micro-batches on
the device) is eaglet/draft/train_data.py; what the draft is, its loss and its files are the
method's (`train.method`, eaglet/draft/methods/: EAGLE-3's training-time-test unroll and loss,
DFlash's blocks). Reads top to bottom, nanoGPT-style: the draft's settings and the loss
plot, then `setup` (its steps: count the steps, load the borrowed target head, the vocab, build
the draft, the optimizer, resume, the schedule), `train_step` (one optimizer step over one global
batch), `train_loop` (the epochs, with logging and checkpoints) and `summarize`. `train_draft`
calls the four in order. `TrainConfig` (eaglet/config/train.py) is the one settings type.

Data parallel: under `torchrun` (see eaglet/draft/launch.py) every process takes its share of
each global batch (rows rank, rank + world, ...), the loss of each predicted position (TTT step
or block position) is normalized by the count over the whole global batch, and gradients are
summed across processes before the step, so N processes follow one process's loss curve. Only
rank 0 writes checkpoints and metrics.

It writes, under `out_dir`: `draft/` (the checkpoint vLLM loads), `state/` (resumable state),
`metrics.jsonl`, `loss.png`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError

from eaglet.config.target import TargetConfig
from eaglet.config.train import TrainConfig
from eaglet.cpu_threads import apply_threads
from eaglet.draft import ledger
from eaglet.draft.checkpoint import load_training_state, save_training_state
from eaglet.draft.heldout_tau import HeldoutTau
from eaglet.draft.init_from import grown_vocab, load_starting_draft, read_starting_draft, with_vocab
from eaglet.draft.methods import DEFAULT_METHOD, draft_method
from eaglet.draft.methods.base import DraftMethod, TrainingView
from eaglet.draft.optimizer import make_optimizer
from eaglet.draft.schedule import warmup_cosine
from eaglet.draft.target_head import TargetHead, load_target_head
from eaglet.draft.train_data import HiddenStatesData, epoch_order, first_sample, load_pieces, plan
from eaglet.draft.vocab import DraftVocab, build_draft_vocab, vocab_over
from eaglet.errors import NonFiniteError, PermanentError
from eaglet.stages import DRAFT_FOLDER, LOSS_PLOT_FILE, TRAIN_STATE_FOLDER
from eaglet.storage import atomic_folder, final_path
from eaglet.target import resolve_device

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- plotting


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss(
    metrics: list[dict], path: Path, heldout: list[dict] | None = None, method: str = DEFAULT_METHOD
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Legends sit outside the axes (inside, they covered the curves).
    fig = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2)
    steps = [m["step"] for m in metrics]
    ax_loss.plot(steps, [m["loss"] for m in metrics], label="training")
    if heldout:  # train.keep_best: the held-out loss at each epoch's end
        ax_loss.plot(
            [r["step"] for r in heldout], [r["loss"] for r in heldout], "o-", label="held out"
        )
        lines = ax_loss.get_lines()
        taus = [r for r in heldout if "tau" in r]
        if taus:  # keep_best: tau, on a second axis: the loss can fall while tau drops
            ax_tau = ax_loss.twinx()
            lines += ax_tau.plot(
                [r["step"] for r in taus], [r["tau"] for r in taus], "s--", color="tab:red",
                label="held-out tau (right axis)",
            )  # fmt: skip
            ax_tau.set_ylabel("held-out tau", color="tab:red")
        ax_loss.legend(handles=lines, loc="upper center", bbox_to_anchor=(0.5, -0.15),
                       ncols=3, frameon=False)  # fmt: skip
    ax_loss.set(xlabel="step", ylabel="loss", title=f"{method} training loss")
    for i in range(len(metrics[0]["acc"]) if metrics else 0):
        ax_acc.plot(steps, [m["acc"][i] for m in metrics], label=f"position {i + 1}")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="draft argmax = target argmax", ylim=(0, 1))
    if metrics:
        ax_acc.legend(loc="upper left", bbox_to_anchor=(1.02, 1), frameon=False)
    fig.savefig(str(path), dpi=100)


# ----------------------------------------------------------------------------------- the run


def distributed() -> tuple[int, int]:
    """(rank, world size): (0, 1) unless a process group is up (this process runs under
    torchrun, started by eaglet/draft/train_worker.py)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def training_device(config: TrainConfig) -> torch.device:
    """`train.device`; under torchrun a bare `cuda` means this process's GPU (LOCAL_RANK)."""
    device = torch.device(resolve_device(config.device))
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def autocast_dtype(config: TrainConfig, device: torch.device) -> torch.dtype | None:
    """bfloat16 when asked for and the device runs it, else None (plain float32)."""
    if config.precision != "bfloat16":
        return None
    if device.type == "cuda" and torch.cuda.is_bf16_supported() or device.type == "cpu":
        return torch.bfloat16
    log.warning("train.precision=bfloat16: %s does not support it; training in float32", device)
    return None


@dataclass
class Run:
    """What `setup` builds: the data, the borrowed target matrices, the draft, the optimizer and
    schedule, and where the run stands (`step`)."""

    config: TrainConfig
    data: Any  # HiddenStatesData, or OnlineData (eaglet/draft/online.py) with batch_items
    out_dir: Path
    aux_layer_ids: list[int]
    aux_layer_convention: str
    device: torch.device
    autocast: torch.dtype | None
    rank: int
    world: int
    vocab: DraftVocab
    method: DraftMethod
    positions: int  # predicted positions per anchor: the per-position statistics' length
    draft: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    view: TrainingView  # what the method's loss reads: settings, draft, the target's matrices
    lm_head: torch.Tensor  # [V, H], the target's
    t2d: torch.Tensor  # bool [V]
    steps_per_epoch: int
    total_steps: int
    stop_at: int
    step: int
    start_step: int
    fingerprint: str
    heldout: Any = None  # HiddenStatesData of the held-out samples, with train.keep_best
    # {"epoch", "step", "loss"} per epoch's end, and "tau" with keep_best: tau (rank 0)
    heldout_losses: list[dict] = field(default_factory=list)
    heldout_tau: Callable[[Any], float] | None = None  # keep_best: tau, on rank 0
    started: float = field(default_factory=time.time)
    step_seconds: float = 0.0  # in train_step (data, forward, backward, optimizer), this process
    trained_windows: int = 0  # this process's share of the steps this run took

    @property
    def draft_dir(self) -> Path:
        return self.out_dir / DRAFT_FOLDER

    @property
    def state_dir(self) -> Path:
        return self.out_dir / TRAIN_STATE_FOLDER

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    @property
    def plot_path(self) -> Path:
        return self.out_dir / LOSS_PLOT_FILE

    @property
    def best_dir(self) -> Path:  # train.keep_best: the draft of the lowest held-out loss
        return self.out_dir / "best"

    @property
    def best(self) -> dict | None:
        """The epoch's end to export: the lowest held-out loss, or the highest tau."""
        if self.config.keep_best == "tau":
            return max(self.heldout_losses, key=lambda r: r.get("tau", 0.0), default=None)
        return min(self.heldout_losses, key=lambda r: r["loss"], default=None)


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


# ------------------------------------------------------------------------ setup, step by step


def count_steps(data: Any, config: TrainConfig) -> tuple[int, int, int, str]:
    """Steps per epoch, total steps, the step this run stops at (train.max_steps), and the
    fingerprint of the batch order, which a resume checks is unchanged."""
    if len(data) == 0:
        raise ValueError(f"no training samples in {data.root}")
    steps_per_epoch = math.ceil(len(data) / config.batch_size)
    total_steps = config.epochs * steps_per_epoch
    stop_at = min(total_steps, config.max_steps or total_steps)
    fingerprint = data.fingerprint(config.batch_size, config.max_seq_len)
    if config.length_buckets:  # another batch order: a resume must not mix the two
        fingerprint += "+length-buckets"
    return steps_per_epoch, total_steps, stop_at, fingerprint


def load_checked_head(target: TargetConfig, data: Any, layers: int) -> TargetHead:
    """The target's embed_tokens and lm_head (borrowed, frozen), checked against the features:
    `layers` target layers of hidden_size each."""
    head = load_target_head(target)
    H = head.config["hidden_size"]
    if data.aux_width() != layers * H:
        raise ValueError(
            f"aux_hidden_states are {data.aux_width()} wide, expected {layers} layers * {H}"
        )
    return head


def start_vocab(
    data: Any,
    head: TargetHead,
    config: TrainConfig,
    out_dir: Path,
    resuming: bool,
    rank: int,
    world: int,
    brought: DraftVocab | None = None,
    full: bool = False,
) -> DraftVocab:
    """The draft vocab, computed once: a resumed run reuses the saved one; a fresh run counts
    the data's tokens, once rank 0 has cleared an old state, best draft and metrics, and picks
    the most frequent (or keeps the vocab a starting draft `brought`, its coverage measured on
    this data)."""
    _barrier(world)  # every process has looked before rank 0 clears an old state
    if resuming:
        return DraftVocab.load(out_dir / TRAIN_STATE_FOLDER / "vocab.json")
    if rank == 0:
        shutil.rmtree(out_dir / TRAIN_STATE_FOLDER, ignore_errors=True)
        shutil.rmtree(out_dir / "best", ignore_errors=True)
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)
        (out_dir / ledger.LEDGER_FILE).unlink(missing_ok=True)
    counts = data.token_counts(head.config["vocab_size"])
    if full:  # a method that drafts over the target's whole vocabulary
        return vocab_over(torch.arange(head.config["vocab_size"]), counts)
    if brought is not None and config.init_from_vocab == "grow":
        return grown_vocab(brought, counts, config.draft_vocab_size)
    if brought is not None:
        return vocab_over(brought.ids, counts)
    return build_draft_vocab(counts, config.draft_vocab_size)


def build_draft(
    method: DraftMethod,
    head: TargetHead,
    config: TrainConfig,
    vocab: DraftVocab,
    aux_layer_ids: list[int],
    device: torch.device,
    start: torch.nn.Module | None = None,
) -> torch.nn.Module:
    """A fresh draft of `method` on `device` (or the starting draft of train.init_from, as it
    came), the same initial weights in every process."""
    torch.manual_seed(config.seed)
    if start is not None:  # its vocabulary grown by this data's tokens (init_from_vocab: grow)
        return with_vocab(start, vocab, head.lm_head).to(device)
    return method.build(head, config, vocab, aux_layer_ids).to(device)


def starting_draft(
    config: TrainConfig, head: TargetHead, aux_layer_ids: list[int]
) -> tuple[torch.nn.Module | None, DraftVocab | None]:
    """train.init_from's draft and vocab, checked against the target and the run's layer ids
    (`eaglet.draft.init_from`); (None, None) for a fresh draft."""
    if not config.init_from:
        return None, None
    start = read_starting_draft(
        config.init_from, config.init_from_layer_convention, head.config["num_hidden_layers"]
    )
    draft, vocab = load_starting_draft(start, head.config, aux_layer_ids)
    log.info(
        "starting from %s (%s format, layers %s, draft vocab %d)",
        start.folder, start.format, start.aux_layer_ids, vocab.size,
    )  # fmt: skip
    return draft, vocab


class DamagedCheckpointError(PermanentError, RuntimeError):
    """A training checkpoint that cannot be read (cut short, damaged): never retried."""


def resume_from(
    out_dir: Path,
    draft: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    fingerprint: str,
    rank: int,
    total_steps: int,
) -> tuple[int, list[dict], DraftVocab]:
    """Load `state/` into `draft` and `optimizer`; return the step it reached, the held-out
    losses up to it and the saved vocab. Rank 0 drops the metrics logged after that step."""
    state_dir, metrics_path = out_dir / TRAIN_STATE_FOLDER, out_dir / "metrics.jsonl"
    try:
        meta, vocab = load_training_state(state_dir, draft, optimizer)
    except (SafetensorError, OSError, ValueError, KeyError, RuntimeError) as exc:
        raise DamagedCheckpointError(
            f"the training checkpoint {final_path(state_dir)} cannot be read "
            f"({str(exc).splitlines()[0][:200]}): rerun with --refresh-from train to start "
            "training over (the damaged folder is set aside, not deleted)"
        ) from exc
    if meta["data_fingerprint"] != fingerprint:
        raise ValueError(
            f"{state_dir} was trained on other data or batch settings; delete it (or pass "
            "resume=False) to start over"
        )
    step = meta["step"]
    heldout_losses = [r for r in meta.get("heldout_losses", []) if r["step"] <= step]
    if rank == 0:
        kept = [m for m in read_metrics(metrics_path) if m["step"] <= step]
        metrics_path.write_text("".join(json.dumps(m) + "\n" for m in kept))
        ledger.cut_back(out_dir, step)
    log.info("resuming at step %d of %d", step, total_steps)
    return step, heldout_losses, vocab


def lr_schedule(
    optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int, step: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup then cosine to train.lr_floor, standing at `step` (a resumed run's)."""
    for group in optimizer.param_groups:  # the schedule scales the configured peak
        group["lr"] = config.lr
        group.pop("initial_lr", None)
    return warmup_cosine(
        optimizer, config.warmup_steps, total_steps, start_step=step, floor=config.lr_floor
    )


# ------------------------------------------------------------------------------------- setup


# ~65 lines: the named steps in order, then the Run's fields by name
def setup(
    data: Any,
    target: TargetConfig,
    out_dir: Path,
    config: TrainConfig,
    aux_layer_ids: list[int],
    aux_layer_convention: str,
    resume: bool,
    heldout: Any = None,
) -> Run:
    """Data, target head, vocab, draft, optimizer, schedule; restored from `state/` when it
    exists and `resume` (the same vocab, weights, optimizer moments and step). `heldout`: the
    held-out windows train.keep_best measures at each epoch's end."""
    started = time.time()
    apply_threads("train", config.threads)  # in this thread: a Prefect task's, a worker's
    method = draft_method(config.method)
    rank, world = distributed()
    device = training_device(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    steps_per_epoch, total_steps, stop_at, fingerprint = count_steps(data, config)
    head = load_checked_head(target, data, len(aux_layer_ids))
    method.layer_ids(aux_layer_ids, head.config["num_hidden_layers"])  # checks them
    resuming = resume and (out_dir / "state" / "state.json").exists()
    start, brought = starting_draft(config, head, aux_layer_ids) if not resuming else (None, None)
    vocab = start_vocab(
        data, head, config, out_dir, resuming, rank, world, brought, method.full_vocab
    )
    draft = build_draft(method, head, config, vocab, aux_layer_ids, device, start)
    optimizer = make_optimizer(draft, config.optimizer, config.lr)
    step, heldout_losses = 0, []
    if resuming:
        step, heldout_losses, vocab = resume_from(
            out_dir, draft, optimizer, fingerprint, rank, total_steps
        )
    schedule = lr_schedule(optimizer, config, total_steps, step)
    log.info("draft vocab %d ids, coverage %.4f", vocab.size, vocab.coverage)

    embed, lm_head = head.embed.to(device), head.lm_head.to(device)
    view = TrainingView(
        settings=config, draft=draft, embed=embed,
        draft_lm_head=lm_head[vocab.ids.to(device)], device=device,
        autocast=autocast_dtype(config, device),
    )  # fmt: skip
    return Run(
        config=config,
        data=data,
        out_dir=out_dir,
        aux_layer_ids=list(aux_layer_ids),
        aux_layer_convention=aux_layer_convention,
        device=device,
        autocast=autocast_dtype(config, device),
        rank=rank,
        world=world,
        vocab=vocab,
        method=method,
        positions=method.positions(config),
        draft=draft,
        optimizer=optimizer,
        schedule=schedule,
        view=view,
        lm_head=lm_head,
        t2d=vocab.t2d.to(device),
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        stop_at=stop_at,
        step=step,
        start_step=step,
        fingerprint=fingerprint,
        heldout=heldout,
        heldout_losses=heldout_losses,
        started=started,
    )


# -------------------------------------------------------------------------------------- step


@torch.no_grad()
def heldout_loss(run: Run) -> float:
    """The training loss over the held-out windows (train.keep_best): per TTT step the summed
    loss over all of them divided by their counted positions, weighted step_weight**i. Each
    process takes rows rank, rank + world, ... of every batch; the sums add across processes."""
    c, data = run.config, run.heldout
    sums = torch.zeros(2, run.positions, dtype=torch.float64, device=run.device)  # loss, count
    run.draft.eval()
    try:
        for first in range(0, len(data), c.batch_size):
            indices = list(range(first, min(first + c.batch_size, len(data))))
            for b in load_pieces(run, indices, data):
                _, stats = run.method.piece_loss(run.view, b, None)
                sums[0] += torch.tensor(stats.loss_sum, dtype=torch.float64, device=run.device)
                sums[1] += torch.tensor(stats.count, dtype=torch.float64, device=run.device)
    finally:
        run.draft.train()
    if run.world > 1:
        dist.all_reduce(sums)
    loss_sums, counts = sums.tolist()
    return sum(
        c.ttt_step_weight**i * s / max(n, 1)
        for i, (s, n) in enumerate(zip(loss_sums, counts, strict=True))
    )


def train_step(run: Run, indices: list[int]) -> dict:
    """One optimizer step over the global batch `indices`; returns its global loss, per TTT step
    the loss sums, hits and counted positions, and the tokens it read."""
    c = run.config
    pieces = load_pieces(run, indices)
    counts = torch.zeros(run.positions, dtype=torch.int64, device=run.device)
    for b in pieces:
        for i in range(run.positions):
            counts[i] += run.method.counted(i, b).sum()
    # loss, hits, tokens
    sums = torch.zeros(3, run.positions, dtype=torch.float64, device=run.device)
    if run.world > 1:
        dist.all_reduce(counts)
    denominators = counts.tolist()

    run.optimizer.zero_grad(set_to_none=True)
    for b in pieces:
        loss, stats = run.method.piece_loss(run.view, b, denominators)
        if not bool(torch.isfinite(loss)):  # checked before any step: the weights stay good
            raise NonFiniteError(
                f"train step {run.step + 1}: the loss is not finite (NaN or inf) on the batch "
                f"whose first sample is {first_sample(run.data, b['windows'])}: lower "
                "train.lr, or check the hidden states (eaglet inspect --verify)"
            )
        loss.backward()
        sums[0] += torch.tensor(stats.loss_sum, dtype=torch.float64, device=run.device)
        sums[1] += torch.tensor(stats.hits, dtype=torch.float64, device=run.device)
        sums[2, 0] += int(b["lengths"].sum())

    params = [p for p in run.draft.parameters() if p.requires_grad]
    if run.world > 1:  # the gradient of the global loss: the sum of every process's part
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        dist.all_reduce(sums)
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad = g.view_as(p)
    torch.nn.utils.clip_grad_norm_(params, c.grad_clip)
    run.optimizer.step()
    run.schedule.step()

    weights = [c.ttt_step_weight**i for i in range(run.positions)]
    loss_sums, hits = sums[0].tolist(), sums[1].tolist()
    return {
        "loss": sum(
            w * s / max(n, 1) for w, s, n in zip(weights, loss_sums, denominators, strict=True)
        ),
        "loss_sum": loss_sums,
        "hits": hits,
        "count": denominators,
        "tokens": int(sums[2, 0]),
        "windows": [int(w) for b in pieces for w in b["windows"]],  # this process's
    }


# -------------------------------------------------------------------------------------- loop


class Meter:
    """Averages of loss, per-step accuracy and throughput since the last log line."""

    def __init__(self, positions: int):
        self.positions = positions  # per TTT step (EAGLE-3) or block position (DFlash)
        self._reset()

    def _reset(self) -> None:
        self.loss, self.batches, self.tokens, self.t0 = 0.0, 0, 0, time.time()
        self.hits, self.counts = [0.0] * self.positions, [0] * self.positions

    def add(self, result: dict) -> None:
        self.loss += result["loss"]
        self.batches += 1
        self.tokens += result["tokens"]
        for i in range(self.positions):
            self.hits[i] += result["hits"][i]
            self.counts[i] += result["count"][i]

    def flush(self, step: int, total_steps: int, epoch: int, lr: float, queue=None) -> dict:
        record = {
            "step": step,
            "total_steps": total_steps,
            "epoch": epoch,
            "loss": self.loss / max(self.batches, 1),
            "acc": [h / max(c, 1) for h, c in zip(self.hits, self.counts, strict=True)],
            "lr": lr,
            "tokens_per_s": self.tokens / max(time.time() - self.t0, 1e-9),
        }
        if queue is not None:  # served online features: the prefetch queue since the last line
            record["queue"] = queue
        self._reset()
        return record


def report(run: Run, record: dict, progress: Callable[[dict], None] | None) -> None:
    """A log window's record, alike on every process (all-reduced sums): a line of
    metrics.jsonl (rank 0), a log line and `progress` (where the worker shows them)."""
    if run.rank == 0:
        with run.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
    # a queue that stays empty while the trainer waits: the capture servers bound the run
    queue, fill = record.get("queue"), ""
    if queue:
        fill = f" queue {queue['fill']:.1f}/{queue['size']}, waited {queue['wait_s']:.1f} s"
    log.info(
        "step %d/%d loss %.4f acc %s %.0f tok/s ETA %.0f s%s",
        run.step,
        run.stop_at,
        record["loss"],
        [round(a, 3) for a in record["acc"]],
        record["tokens_per_s"],
        record["eta_s"],
        fill,
    )
    if progress is not None:
        progress(record)


def save(run: Run) -> None:
    """The resumable state and the exportable draft (rank 0 only: every process holds the same
    weights)."""
    if run.rank != 0:
        return
    meta = {
        "step": run.step,
        "epoch": run.step // run.steps_per_epoch,
        "total_steps": run.total_steps,
        "steps_per_epoch": run.steps_per_epoch,
        "data_fingerprint": run.fingerprint,
        "settings": run.config.model_dump(),
        "world_size": run.world,
        "heldout_losses": run.heldout_losses,
    }
    save_training_state(run.state_dir, run.draft, run.optimizer, run.vocab, meta)
    run.method.save(run.draft, run.draft_dir, run.aux_layer_ids, run.aux_layer_convention)


def train_loop(run: Run, progress: Callable[[dict], None] | None = None) -> None:
    """The epochs from `run.step` to `run.stop_at`: a log line (metrics.jsonl, `progress`) every
    `log_every` steps and a checkpoint every `save_every` steps (default: each epoch's end)."""
    from eaglet import shutdown

    c = run.config
    meter = Meter(run.positions)
    order, order_epoch = [], -1
    loop_started, first_step = time.time(), run.step
    run.draft.train()
    # SIGINT/SIGTERM (eaglet/shutdown.py) stop the loop between steps, never inside one: a
    # checkpoint of the step reached, then `Interrupted`; the next run resumes from it.
    with shutdown.deferred():
        while run.step < run.stop_at:
            epoch, index = divmod(run.step, run.steps_per_epoch)
            if epoch != order_epoch:
                order, order_epoch = epoch_order(run, epoch), epoch
            lr = run.schedule.get_last_lr()[0]
            step_started = time.time()
            result = train_step(run, order[index])
            run.step_seconds += time.time() - step_started
            run.step += 1
            # a signal to any process: the checkpoint of this step, then every process stops
            mine = result.pop("windows")
            run.trained_windows += len(mine)
            trained, stop = ledger.agree(run.world, mine, shutdown.requested())
            meter.add(result)
            if run.rank == 0:
                ledger.append(run.out_dir, run.step, epoch, trained)

            if run.step % c.log_every == 0 or run.step == run.stop_at:
                queue = run.data.queue_stats() if hasattr(run.data, "queue_stats") else None
                record = meter.flush(run.step, run.total_steps, epoch, lr, queue)
                per_step = (time.time() - loop_started) / (run.step - first_step)
                record |= {"stop_at": run.stop_at, "eta_s": per_step * (run.stop_at - run.step)}
                report(run, record, progress)
            if run.heldout is not None and run.step % run.steps_per_epoch == 0:  # an epoch's end
                keep_if_best(run)
            every = c.save_every or run.steps_per_epoch
            if stop or run.step % every == 0 or run.step == run.stop_at:
                save(run)
            if stop:
                shutdown.raise_if_requested()
                raise shutdown.Interrupted(signal.SIGTERM, "train")  # another process's signal
    finish(run)


def keep_if_best(run: Run) -> None:
    """train.keep_best at an epoch's end: the held-out loss (and, with tau, the held-out tau on
    rank 0), and the draft in `best/` when it is the best so far."""
    record = {"epoch": run.step / run.steps_per_epoch, "step": run.step, "loss": heldout_loss(run)}
    if run.heldout_tau is not None:
        record["tau"] = run.heldout_tau(run.draft)
    previous = run.best
    run.heldout_losses.append(record)
    improved = previous is None or run.best is record
    if run.rank == 0:
        tau = f", tau {record['tau']:.3f}" if "tau" in record else ""
        best = " (best)" if improved else ""
        log.info("held-out loss %.4f%s at step %d%s", record["loss"], tau, run.step, best)
        if improved:
            run.method.save(run.draft, run.best_dir, run.aux_layer_ids, run.aux_layer_convention)


def finish(run: Run) -> None:
    """After the last step: the checkpoint, if no step wrote one (the run was already done);
    with train.keep_best, the best epoch's draft as the exported one (rank 0)."""
    if not (run.draft_dir / "model.safetensors").exists():
        save(run)
    if run.heldout is not None and run.rank == 0 and (run.best_dir / "config.json").exists():
        with atomic_folder(run.draft_dir) as tmp:  # the exported draft: the best epoch's
            for f in run.best_dir.iterdir():
                shutil.copyfile(f, tmp / f.name)


def summarize(run: Run) -> dict:
    """The run's figures for the stage manifest (plots the loss curve on rank 0)."""
    metrics = read_metrics(run.metrics_path) if run.rank == 0 else []
    waited = getattr(run.data, "waited_s", 0.0)  # for served online features
    throughput = ledger.throughput(run.world, {
        "samples": run.trained_windows, "compute_s": run.step_seconds - waited,
        "wait_s": waited, "servers": getattr(run.data, "server_stats", dict)(),
    })  # fmt: skip
    if metrics:
        plot_loss(metrics, run.plot_path, run.heldout_losses, run.method.name)
    return {
        "steps": run.step,
        "total_steps": run.total_steps,
        "resumed_from_step": run.start_step,
        "epochs": run.config.epochs,
        "epochs_completed": run.step / run.steps_per_epoch,
        "initial_loss": metrics[0]["loss"] if metrics else None,  # first log window's mean
        "final_loss": metrics[-1]["loss"] if metrics else None,  # last log window's mean
        "final_acc": metrics[-1]["acc"] if metrics else None,
        "draft_vocab_size": run.vocab.size,
        "vocab_coverage": run.vocab.coverage,
        "train_samples": len(run.data.samples),
        "train_windows": len(run.data),
        "train_tokens": sum(e["length"] for e in run.data.samples),
        "train_loss_tokens": run.vocab.counted_tokens,
        "seconds": time.time() - run.started,
        "step_seconds": run.step_seconds,  # of this run's steps only (no set-up, no saving)
        "device": str(run.device),
        "world_size": run.world,
        "precision": "bfloat16" if run.autocast is not None else "float32",
        "hidden_states": getattr(run.data, "mode", "offline"),
        "throughput": throughput,  # per rank and capture server (global rank 0)
        "draft_dir": str(run.draft_dir),
        "heldout_losses": run.heldout_losses,  # train.keep_best: per epoch's end
        "best_epoch": run.best["epoch"] if run.best else None,  # the exported draft's
        "state_dir": str(run.state_dir),
        "metrics_path": str(run.metrics_path),
        "loss_plot": str(run.plot_path) if metrics else None,
    }


def train_draft(
    hidden_states: Path | Any,
    target: TargetConfig | str | Path,
    out_dir: Path,
    config: TrainConfig,
    aux_layer_ids: list[int],
    aux_layer_convention: str,
    exclude_sample_ids: set[str] | frozenset[str] = frozenset(),
    progress: Callable[[dict], None] | None = None,
    resume: bool = True,
) -> dict:
    """Train (or resume training) a draft; return `summarize`'s figures.

    `hidden_states` is a hidden-states folder (offline) or a dataset that computes features as
    it goes (eaglet/draft/online.py); `target` the target's settings (a bare path or hub id means
    default settings)."""
    if not isinstance(target, TargetConfig):
        target = TargetConfig(model=str(target))
    data, heldout = hidden_states, None
    if isinstance(hidden_states, str | Path):
        data = HiddenStatesData(Path(hidden_states), exclude_sample_ids, config.max_seq_len)
    if config.keep_best != "off":
        if not isinstance(hidden_states, str | Path):
            raise ValueError("train.keep_best reads the held-out features from offline shards")
        heldout = HiddenStatesData(
            Path(hidden_states), max_seq_len=config.max_seq_len,
            only_sample_ids=frozenset(exclude_sample_ids),
        )  # fmt: skip
        if len(heldout) == 0:
            raise ValueError(
                f"train.keep_best: no held-out samples in {hidden_states} (all {len(data)} "
                "windows train); raise train.holdout_fraction"
            )
    run = setup(data, target, out_dir, config, aux_layer_ids, aux_layer_convention, resume, heldout)
    if config.keep_best == "tau" and run.rank == 0:
        run.heldout_tau = HeldoutTau(
            target, heldout, config.keep_best_prompts, run.positions,
            config.keep_best_max_new_tokens, aux_layer_ids,
        )  # fmt: skip
    if hasattr(data, "start_prefetch"):  # a served online source streams features ahead
        data.start_prefetch(plan(run))
    try:
        train_loop(run, progress)
    finally:
        if hasattr(data, "stop_prefetch"):
            data.stop_prefetch()
    _barrier(run.world)  # the last checkpoint is in place before any process returns
    return summarize(run)
