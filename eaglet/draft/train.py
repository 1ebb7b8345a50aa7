"""Train an EAGLE-3 draft model on the target's hidden states.

Reads top to bottom, nanoGPT-style: data (hidden-state shards -> padded batches, one training
window per row), the target's labels (from the borrowed `lm_head`), the training-time-test unroll
(`ttt_unroll`) and loss (`ttt_loss`), then the run itself: `setup` (data, the borrowed target
head, vocab, model, optimizer, schedule, resume), `train_step` (one optimizer step over one global
batch), `train_loop` (the epochs, with logging and checkpoints) and `summarize`. `train_draft`
calls the four in order. `TrainConfig` (eaglet/config.py) is the one settings type.

Data parallel: under `torchrun` (see eaglet/draft/launch.py) every process takes its share of
each global batch (rows rank, rank + world, ...), the loss of each TTT step is normalized by the
count over the whole global batch, and gradients are summed across processes before the step, so
N processes follow one process's loss curve. Only rank 0 writes checkpoints and metrics.

It writes, under `out_dir`: `draft/` (the checkpoint vLLM loads), `state/` (resumable state),
`metrics.jsonl`, `loss.png`.

Indexing used throughout, for one sample x_0..x_{n-1} with target features g_t = fc(aux_t):
TTT step i at index t feeds embed(x_{t+1+i}) and (step 0) g_t or (step i > 0) the draft's own
step-(i-1) output at t, sits at RoPE position t + i, and predicts x_{t+2+i}, whose target
distribution is softmax(lm_head(final_{t+1+i})) restricted to the draft vocab.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open

from eaglet.config import TargetConfig, TrainConfig
from eaglet.cpu_threads import apply_threads
from eaglet.draft.checkpoint import load_training_state, save_draft, save_training_state
from eaglet.draft.model import TTT, Eagle3Config, Eagle3Draft
from eaglet.draft.optimizer import make_optimizer
from eaglet.draft.schedule import warmup_cosine
from eaglet.draft.target_head import TargetHead, load_target_head
from eaglet.draft.vocab import DraftVocab, build_draft_vocab, count_tokens
from eaglet.errors import NonFiniteError
from eaglet.hidden_states.shards import read_window
from eaglet.storage import atomic_folder
from eaglet.target import resolve_device

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------- data

MIN_SAMPLE_TOKENS = 3  # t + 2 < n: shorter windows have nothing to predict


class HiddenStatesData:
    """The shards of one hidden-states folder, read lazily (safetensors mmap), one item per
    training window (a sample, or a max_seq_len piece of a longer one)."""

    def __init__(
        self,
        root: Path,
        exclude_sample_ids=frozenset(),
        max_seq_len: int = 1024,
        only_sample_ids: frozenset[str] | None = None,
    ):
        self.root = Path(root)
        lines = (self.root / "index.jsonl").read_text().splitlines()
        entries = [json.loads(line) for line in lines if line.strip()]
        self.samples = [
            e
            for e in entries
            if e["sample_id"] not in exclude_sample_ids
            and (only_sample_ids is None or e["sample_id"] in only_sample_ids)
        ]
        self.windows: list[tuple[str, int, int]] = []  # (shard, offset, length)
        self.window_sample_ids: list[str] = []  # the sample each window is cut from
        for e in self.samples:
            for start, length in window_starts(e["length"], max_seq_len):
                self.windows.append((e["shard"], e["offset"] + start, length))
                self.window_sample_ids.append(e["sample_id"])
        self._files: dict = {}

    def _file(self, shard: str):
        if shard not in self._files:
            self._files[shard] = safe_open(str(self.root / shard), framework="pt")
        return self._files[shard]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard, offset, length = self.windows[i]
        # input_ids [n], loss_mask [n], aux_hidden_states [n, 3H], final_hidden_states [n, H]
        return read_window(self._file(shard), offset, length)  # float, whatever the storage

    def aux_width(self) -> int:
        return self._file(self.samples[0]["shard"]).get_slice("aux_hidden_states").get_shape()[1]

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Occurrences of each id among loss-masked tokens of the (non-excluded) samples: [V]."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for e in self.samples:
            window = read_window(
                self._file(e["shard"]), e["offset"], e["length"], keys=("input_ids", "loss_mask")
            )
            counts += count_tokens(window["input_ids"], window["loss_mask"], vocab_size)
        return counts

    def fingerprint(self, batch_size: int, max_seq_len: int) -> str:
        return data_fingerprint([e["sample_id"] for e in self.samples], batch_size, max_seq_len)


def window_starts(length: int, max_seq_len: int) -> list[tuple[int, int]]:
    """(start, length) of the training windows of a sample of `length` tokens."""
    spans = [(s, min(max_seq_len, length - s)) for s in range(0, length, max_seq_len)]
    return [(s, n) for s, n in spans if n >= MIN_SAMPLE_TOKENS]


def data_fingerprint(sample_ids: list[str], batch_size: int, max_seq_len: int) -> str:
    """What decides the order of batches (with the seed): a resume checks it is unchanged."""
    key = json.dumps([sorted(sample_ids), batch_size, max_seq_len])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One sample per row, right-padded with zeros; `lengths` [B] says where each row ends."""
    lengths = torch.tensor([len(it["input_ids"]) for it in items])
    T = int(lengths.max())
    batch = {
        key: torch.stack(
            [F.pad(it[key], (0, 0) * (it[key].dim() - 1) + (0, T - len(it[key]))) for it in items]
        )
        for key in items[0]
    }  # input_ids [B,T], loss_mask [B,T], aux [B,T,3H], final [B,T,H]
    batch["lengths"] = lengths
    return batch


BUCKET_BATCHES = 32  # length buckets: batches whose rows are sorted by length together


def epoch_batches(
    num_items: int, batch_size: int, seed: int, epoch: int, lengths: list[int] | None = None
) -> list[list[int]]:
    """The batches of one epoch: a permutation that depends only on (seed, epoch).

    With `lengths` (train.length_buckets), each run of BUCKET_BATCHES batches of that
    permutation is sorted by length before it is cut into batches, and the batches are then
    shuffled: the rows of a batch have about the same length, so little of a padded batch is
    padding, and every bucket still draws from the whole epoch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(num_items, generator=g).tolist()
    if lengths is None:
        return [order[i : i + batch_size] for i in range(0, num_items, batch_size)]
    bucket = batch_size * BUCKET_BATCHES
    batches = []
    for first in range(0, num_items, bucket):
        rows = sorted(order[first : first + bucket], key=lambda i: lengths[i])
        batches += [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    shuffled = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in shuffled]


# ---------------------------------------------------------------------------- target labels


def draft_config(target: TargetHead, config: TrainConfig, draft_vocab_size: int) -> Eagle3Config:
    c = target.config
    return Eagle3Config(
        hidden_size=c["hidden_size"],
        intermediate_size=config.intermediate_size or c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        vocab_size=c["vocab_size"],
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=c["hidden_size"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"],
        max_position_embeddings=c["max_position_embeddings"],
        norm_before_fc=config.norm_before_fc,
        norm_before_residual=config.norm_before_residual,
        norm_output=config.norm_output,
    )


@torch.no_grad()
def target_in_vocab(
    final_hidden: torch.Tensor,  # [B, T, H], after the target's final norm
    lm_head: torch.Tensor,  # [V, H]
    t2d: torch.Tensor,  # bool [V]
    chunk: int = 2048,
) -> torch.Tensor:
    """Whether the target's argmax is in the draft vocab, bool [B, T]; `chunk` tokens at a time
    bound the [., V] logits."""
    B, T, H = final_hidden.shape
    parts = [
        t2d[(part @ lm_head.T).argmax(-1)] for part in final_hidden.reshape(B * T, H).split(chunk)
    ]
    return torch.cat(parts).view(B, T)


@torch.no_grad()
def target_probs(
    final_hidden: torch.Tensor,  # [B, T, H]
    draft_lm_head: torch.Tensor,  # [Vd, H], lm_head rows of the draft vocab's target ids
) -> torch.Tensor:
    """The target's distribution restricted to the draft vocab, [B, T, Vd]."""
    return (final_hidden @ draft_lm_head.T).softmax(-1)


# ------------------------------------------------------------------------------ TTT and loss


def shift_left(x: torch.Tensor, k: int, length: int | None = None) -> torch.Tensor:
    """y[:, t] = x[:, t + k], zero past the end; `length` columns (default x's)."""
    length = x.shape[1] if length is None else length
    y = x[:, k : k + length]
    return F.pad(y, (0, 0) * (x.dim() - 2) + (0, length - y.shape[1]))


def ttt_unroll(
    draft: Eagle3Draft,
    embed: torch.Tensor,  # [V, H], the target's frozen embed_tokens
    input_ids: torch.Tensor,  # [B, T_ids >= T]
    hidden: torch.Tensor,  # [B, T, H], draft.fuse(aux)
    ttt_length: int,
    start: int = 0,
) -> list[torch.Tensor]:
    """Training-time test: `ttt_length` draft steps over all T positions at once.

    Step i at index t reads embed(x_{t+1+i}) and the step-(i-1) output at t (g_t at step 0), sits
    at position t + i, attends to step-0 keys <= t and steps 1..i keys at t (the `TTT` pattern,
    which skips the masked scores). Steps after the first run over indices start..T-1 only
    (`ttt_start`: below it none of them can count; step 0 runs everywhere, its keys are every
    later step's context). Returns the logits of every step: step 0 [B, T, Vd], later steps
    [B, T - start, Vd]."""
    B, T, _ = hidden.shape
    positions = torch.arange(T, device=hidden.device).expand(B, T)  # [B, T]
    cache, step_logits = [], []
    for i in range(ttt_length):
        if i == 1:  # the later steps' indices: start..T-1
            hidden, positions = hidden[:, start:], positions[:, start:]
        first = T - hidden.shape[1]  # 0 at step 0, start after
        ids = shift_left(input_ids, 1 + i, T)[:, first:]  # the token after the one step i predicts
        hidden, cache = draft(F.embedding(ids, embed), hidden, positions + i, cache, TTT)
        step_logits.append(draft.compute_logits(hidden))  # [B, T - first, Vd]
    return step_logits


def ttt_start(loss_mask: torch.Tensor, ttt_length: int) -> int:
    """The first index where a TTT step after the first can count, over a batch (bool [B, T]
    loss_mask): step i >= 1 at index t predicts x_{t+2+i}, which counts only if it is model
    output, so t >= a - 2 - i for a row whose first model-output token is at a. Below it the
    later steps compute nothing the loss reads: on a prompt-heavy batch (the fixture's answers
    are a quarter of its tokens) that is most of their work."""
    B, T = loss_mask.shape
    if ttt_length < 2 or B == 0:
        return 0
    any_output = loss_mask.any(dim=1)  # [B]
    first_output = torch.where(any_output, loss_mask.int().argmax(dim=1), T)  # [B]
    return max(0, min(int(first_output.min()) - ttt_length - 1, T - 1))


def counted_positions(
    step: int,
    target_in_vocab: torch.Tensor,  # bool [B, T]
    loss_mask: torch.Tensor,  # bool [B, T], 1 = token produced by the model
    lengths: torch.Tensor,  # [B]
) -> torch.Tensor:
    """bool [B, T]: TTT step `step` at index t predicts x_{t+2+step} (target distribution at
    t+1+step); it counts when that token is model output, exists, and the target's argmax there
    is in the draft vocab."""
    t = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    return (
        (t + 2 + step < lengths[:, None].to(t.device))
        & shift_left(loss_mask, 2 + step)
        & shift_left(target_in_vocab, 1 + step)
    )


LOSSES = ("kl", "tv", "kl_tv")


def position_loss(
    p: torch.Tensor,  # [N, Vd], target distribution
    log_q: torch.Tensor,  # [N, Vd], draft log-probabilities
    loss: str,
) -> torch.Tensor:
    """The summed loss of N positions (see `ttt_loss`)."""
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; one of {LOSSES}")
    total = log_q.new_zeros(())
    if loss in ("kl", "kl_tv"):
        total = total - (p * log_q).sum()
    if loss in ("tv", "kl_tv"):
        total = total + 0.5 * (p - log_q.exp()).abs().sum()
    return total


def ttt_loss(
    step_logits: list[torch.Tensor],  # per step [B, T, Vd]
    target_probs: torch.Tensor,  # [B, T, Vd], target distribution for the token after t
    target_in_vocab: torch.Tensor,  # bool [B, T]
    loss_mask: torch.Tensor,  # bool [B, T]
    lengths: torch.Tensor,  # [B]
    step_weight: float = 0.8,
    denominators: list[int] | None = None,
    loss: str = "kl",
    start: int = 0,
) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """Sum over steps of step_weight**i * the per-position loss, each step averaged over its
    counted positions (`counted_positions`) — or divided by `denominators[i]`, the count over a
    whole global batch of which this is one piece (micro-batches, data-parallel shares).

    `loss` per position: `kl`, the soft cross-entropy -sum p log q (forward KL up to the
    target's entropy); `tv`, the total variation 1/2 sum |p - q|, which is 1 - the chance a
    sampled draft token is accepted; `kl_tv`, their sum. The logits of steps after the first
    cover indices start..T-1 (`ttt_unroll`).

    Stats per step: `loss` and `acc` (means over this piece), `count`, and the sums `loss_sum`
    and `hits` that add up across pieces."""
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    stats: dict[str, list[float]] = {"loss": [], "acc": [], "count": [], "loss_sum": [], "hits": []}
    for i, logits in enumerate(step_logits):
        b, tt = counted_positions(i, target_in_vocab, loss_mask, lengths).nonzero(as_tuple=True)
        offset = start if i else 0  # index of the logits' first column
        if len(tt) and int(tt.min()) < offset:
            raise ValueError(f"TTT step {i} counts index {int(tt.min())}, before start {start}")
        log_q = logits[b, tt - offset].float().log_softmax(-1)  # [N, Vd]
        p = target_probs[b, tt + 1 + i]  # [N, Vd]
        n = len(b)
        step_sum = position_loss(p, log_q, loss)
        denominator = max(n if denominators is None else denominators[i], 1)
        total = total + step_weight**i * step_sum / denominator
        hits = (log_q.argmax(-1) == p.argmax(-1)).sum().item()
        stats["loss"].append(step_sum.item() / max(n, 1))
        stats["acc"].append(hits / max(n, 1))
        stats["count"].append(n)
        stats["loss_sum"].append(step_sum.item())
        stats["hits"].append(hits)
    return total, stats


# ----------------------------------------------------------------------------------- plotting


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss(metrics: list[dict], path: Path, heldout: list[dict] | None = None) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2)
    steps = [m["step"] for m in metrics]
    ax_loss.plot(steps, [m["loss"] for m in metrics], label="training")
    if heldout:  # train.keep_best: the held-out loss at each epoch's end
        ax_loss.plot(
            [r["step"] for r in heldout], [r["loss"] for r in heldout], "o-", label="held out"
        )
        ax_loss.legend()
    ax_loss.set(xlabel="step", ylabel="loss", title="TTT loss")
    for i in range(len(metrics[0]["acc"]) if metrics else 0):
        ax_acc.plot(steps, [m["acc"][i] for m in metrics], label=f"step {i}")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="draft argmax = target argmax", ylim=(0, 1))
    if metrics:
        ax_acc.legend()
    fig.tight_layout()
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
    draft: Eagle3Draft
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    embed: torch.Tensor  # [V, H], the target's
    lm_head: torch.Tensor  # [V, H], the target's
    draft_lm_head: torch.Tensor  # [Vd, H], lm_head rows of the draft vocab
    t2d: torch.Tensor  # bool [V]
    steps_per_epoch: int
    total_steps: int
    stop_at: int
    step: int
    start_step: int
    fingerprint: str
    heldout: Any = None  # HiddenStatesData of the held-out samples, with train.keep_best
    heldout_losses: list[dict] = field(default_factory=list)  # {"epoch", "step", "loss"}
    started: float = field(default_factory=time.time)
    step_seconds: float = 0.0  # in train_step (data, forward, backward, optimizer), this process

    @property
    def draft_dir(self) -> Path:
        return self.out_dir / "draft"

    @property
    def state_dir(self) -> Path:
        return self.out_dir / "state"

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    @property
    def plot_path(self) -> Path:
        return self.out_dir / "loss.png"

    @property
    def best_dir(self) -> Path:  # train.keep_best: the draft of the lowest held-out loss
        return self.out_dir / "best"

    @property
    def best(self) -> dict | None:
        return min(self.heldout_losses, key=lambda r: r["loss"], default=None)


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


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
    if len(aux_layer_ids) != 3:
        raise ValueError(f"EAGLE-3 fuses three target layers, got {aux_layer_ids}")
    rank, world = distributed()
    device = training_device(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state_dir, metrics_path = out_dir / "state", out_dir / "metrics.jsonl"

    if len(data) == 0:
        raise ValueError(f"no training samples in {data.root}")
    steps_per_epoch = math.ceil(len(data) / config.batch_size)
    total_steps = config.epochs * steps_per_epoch
    stop_at = min(total_steps, config.max_steps or total_steps)
    fingerprint = data.fingerprint(config.batch_size, config.max_seq_len)
    if config.length_buckets:  # another batch order: a resume must not mix the two
        fingerprint += "+length-buckets"

    head = load_target_head(target)
    H, V = head.config["hidden_size"], head.config["vocab_size"]
    if data.aux_width() != 3 * H:
        raise ValueError(f"aux_hidden_states are {data.aux_width()} wide, expected 3 * {H}")

    # vocab: computed once; a resumed run reuses the saved one
    resuming = resume and (state_dir / "state.json").exists()
    _barrier(world)  # every process has looked before rank 0 clears an old state
    if resuming:
        vocab = DraftVocab.load(state_dir / "vocab.json")
    else:
        if rank == 0:
            shutil.rmtree(state_dir, ignore_errors=True)
            shutil.rmtree(out_dir / "best", ignore_errors=True)
            metrics_path.unlink(missing_ok=True)
        vocab = build_draft_vocab(data.token_counts(V), config.draft_vocab_size)

    torch.manual_seed(config.seed)  # the same initial weights in every process
    draft = Eagle3Draft(draft_config(head, config, vocab.size))
    draft.set_vocab(vocab.d2t, vocab.t2d)
    if config.lm_head_init == "target":
        with torch.no_grad():  # [Vd, H]: the target's rows of the draft vocab
            draft.lm_head.weight.copy_(head.lm_head[vocab.ids])
    draft.to(device)
    optimizer = make_optimizer(draft, config.optimizer, config.lr)
    step, heldout_losses = 0, []
    if resuming:
        meta, vocab = load_training_state(state_dir, draft, optimizer)
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
        log.info("resuming at step %d of %d", step, total_steps)
    for group in optimizer.param_groups:  # the schedule scales the configured peak
        group["lr"] = config.lr
        group.pop("initial_lr", None)
    schedule = warmup_cosine(
        optimizer, config.warmup_steps, total_steps, start_step=step, floor=config.lr_floor
    )
    log.info("draft vocab %d ids, coverage %.4f", vocab.size, vocab.coverage)

    embed, lm_head = head.embed.to(device), head.lm_head.to(device)
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
        draft=draft,
        optimizer=optimizer,
        schedule=schedule,
        embed=embed,
        lm_head=lm_head,
        draft_lm_head=lm_head[vocab.ids.to(device)],
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


MAX_PADDING = 0.5  # a micro-batch's padded size is at most 1.5x its rows' tokens


def length_groups(rows: list[int], lengths: list[int], max_padding: float) -> list[list[int]]:
    """`rows` sorted by length and cut into runs whose padded size (rows x the longest) is at
    most (1 + max_padding) x their tokens: a batch of mixed lengths becomes a few micro-batches
    of about one length each, with almost no padding."""
    groups: list[list[int]] = []
    tokens = 0
    for row in sorted(rows, key=lambda r: lengths[r]):
        if groups and (len(groups[-1]) + 1) * lengths[row] <= (1 + max_padding) * (
            tokens + lengths[row]
        ):
            groups[-1].append(row)
            tokens += lengths[row]
        else:
            groups.append([row])
            tokens = lengths[row]
    return groups


def micro_batches(run: Run, indices: list[int], data: Any = None) -> list[list[int]]:
    """This process's share of a global batch (rows rank, rank + world, ...), sorted by length,
    split into `grad_accumulation` pieces and each piece into runs of about one length
    (`length_groups`). The loss of every piece is divided by the whole batch's counts, so the
    step is the same however the rows are split; only the padding computed shrinks."""
    windows = (run.data if data is None else data).windows
    share = sorted(indices[run.rank :: run.world], key=lambda j: windows[j][-1])
    size = max(1, math.ceil(len(share) / run.config.grad_accumulation))
    lengths = {j: windows[j][-1] for j in share}
    return [
        group
        for first in range(0, len(share), size)
        for group in length_groups(share[first : first + size], lengths, MAX_PADDING)
    ]


def epoch_order(run: Run, epoch: int) -> list[list[int]]:
    """The global batches of `epoch` for this run's data and settings."""
    c = run.config
    lengths = [window[-1] for window in run.data.windows] if c.length_buckets else None
    return epoch_batches(len(run.data), c.batch_size, c.seed, epoch, lengths)


def plan(run: Run) -> Iterator[list[int]]:
    """Every micro-batch this process will read, in order, from `run.step` to the end: what an
    online data source prefetches features for."""
    order, order_epoch = [], -1
    for step in range(run.step, run.stop_at):
        epoch, index = divmod(step, run.steps_per_epoch)
        if epoch != order_epoch:
            order, order_epoch = epoch_order(run, epoch), epoch
        yield from micro_batches(run, order[index])


def _load_pieces(run: Run, indices: list[int], data: Any = None) -> list[dict[str, torch.Tensor]]:
    """This process's micro-batches of a global batch of `data` (the training data unless
    given), on the device, with the target's in-vocab flags; an online source computes (or
    hands over prefetched) features here."""
    data = run.data if data is None else data  # not `or`: an empty dataset is falsy
    pieces = []
    for chunk in micro_batches(run, indices, data):
        if hasattr(data, "batch_items"):  # online: features from the target, now
            items = data.batch_items(chunk)
        else:
            items = [data[j] for j in chunk]
        batch = {k: v.to(run.device) for k, v in collate(items).items()}
        batch["in_vocab"] = target_in_vocab(batch["final_hidden_states"], run.lm_head, run.t2d)
        batch["windows"] = torch.tensor(chunk)  # which windows of `data`: named on a NaN loss
        pieces.append(batch)
    return pieces


def first_sample(data: Any, windows: torch.Tensor) -> str:
    """The sample id of the first of `windows` (indices into `data`), or the window index."""
    index = int(windows[0])
    ids = getattr(data, "window_sample_ids", None)
    return ids[index] if ids is not None else f"window {index}"


def piece_loss(
    run: Run, b: dict[str, torch.Tensor], denominators: list[int] | None
) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """`ttt_loss` of one micro-batch `b` (from `_load_pieces`): the draft's unroll over it."""
    c = run.config
    probs = target_probs(b["final_hidden_states"], run.draft_lm_head)
    with torch.autocast(
        run.device.type, dtype=run.autocast or torch.bfloat16, enabled=run.autocast is not None
    ):
        aux = b["aux_hidden_states"]  # [B, T, 3H]
        if c.hidden_noise and run.draft.training:  # train.hidden_noise; never when measuring
            aux = aux + c.hidden_noise * torch.randn_like(aux)
        hidden = run.draft.fuse(aux)  # [B, T, H]
        start = ttt_start(b["loss_mask"], c.ttt_length)
        step_logits = ttt_unroll(run.draft, run.embed, b["input_ids"], hidden, c.ttt_length, start)
    return ttt_loss(
        step_logits,
        probs,
        b["in_vocab"],
        b["loss_mask"],
        b["lengths"],
        c.ttt_step_weight,
        denominators,
        c.loss,
        start,
    )


@torch.no_grad()
def heldout_loss(run: Run) -> float:
    """The training loss over the held-out windows (train.keep_best): per TTT step the summed
    loss over all of them divided by their counted positions, weighted step_weight**i. Each
    process takes rows rank, rank + world, ... of every batch; the sums add across processes."""
    c, data = run.config, run.heldout
    sums = torch.zeros(2, c.ttt_length, dtype=torch.float64, device=run.device)  # loss, count
    run.draft.eval()
    try:
        for first in range(0, len(data), c.batch_size):
            indices = list(range(first, min(first + c.batch_size, len(data))))
            for b in _load_pieces(run, indices, data):
                _, stats = piece_loss(run, b, None)
                sums[0] += torch.tensor(stats["loss_sum"], dtype=torch.float64, device=run.device)
                sums[1] += torch.tensor(stats["count"], dtype=torch.float64, device=run.device)
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
    pieces = _load_pieces(run, indices)
    counts = torch.zeros(c.ttt_length, dtype=torch.int64, device=run.device)
    for b in pieces:
        for i in range(c.ttt_length):
            counts[i] += counted_positions(i, b["in_vocab"], b["loss_mask"], b["lengths"]).sum()
    sums = torch.zeros(
        3, c.ttt_length, dtype=torch.float64, device=run.device
    )  # loss, hits, tokens
    if run.world > 1:
        dist.all_reduce(counts)
    denominators = counts.tolist()

    run.optimizer.zero_grad(set_to_none=True)
    for b in pieces:
        loss, stats = piece_loss(run, b, denominators)
        if not bool(torch.isfinite(loss)):  # checked before any step: the weights stay good
            raise NonFiniteError(
                f"train step {run.step + 1}: the loss is not finite (NaN or inf) on the batch "
                f"whose first sample is {first_sample(run.data, b['windows'])}: lower "
                "train.lr, or check the hidden states (eaglet inspect --verify)"
            )
        loss.backward()
        sums[0] += torch.tensor(stats["loss_sum"], dtype=torch.float64, device=run.device)
        sums[1] += torch.tensor(stats["hits"], dtype=torch.float64, device=run.device)
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

    weights = [c.ttt_step_weight**i for i in range(c.ttt_length)]
    loss_sums, hits = sums[0].tolist(), sums[1].tolist()
    return {
        "loss": sum(
            w * s / max(n, 1) for w, s, n in zip(weights, loss_sums, denominators, strict=True)
        ),
        "loss_sum": loss_sums,
        "hits": hits,
        "count": denominators,
        "tokens": int(sums[2, 0]),
    }


class Meter:
    """Averages of loss, per-step accuracy and throughput since the last log line."""

    def __init__(self, ttt_length: int):
        self.ttt_length = ttt_length
        self._reset()

    def _reset(self) -> None:
        self.loss, self.batches, self.tokens, self.t0 = 0.0, 0, 0, time.time()
        self.hits, self.counts = [0.0] * self.ttt_length, [0] * self.ttt_length

    def add(self, result: dict) -> None:
        self.loss += result["loss"]
        self.batches += 1
        self.tokens += result["tokens"]
        for i in range(self.ttt_length):
            self.hits[i] += result["hits"][i]
            self.counts[i] += result["count"][i]

    def flush(self, step: int, total_steps: int, epoch: int, lr: float) -> dict:
        record = {
            "step": step,
            "total_steps": total_steps,
            "epoch": epoch,
            "loss": self.loss / max(self.batches, 1),
            "acc": [h / max(c, 1) for h, c in zip(self.hits, self.counts, strict=True)],
            "lr": lr,
            "tokens_per_s": self.tokens / max(time.time() - self.t0, 1e-9),
        }
        self._reset()
        return record


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
    save_draft(run.draft, run.draft_dir, run.aux_layer_ids, run.aux_layer_convention)


def train_loop(run: Run, progress: Callable[[dict], None] | None = None) -> None:
    """The epochs from `run.step` to `run.stop_at`: a log line (metrics.jsonl, `progress`) every
    `log_every` steps and a checkpoint every `save_every` steps (default: each epoch's end)."""
    from eaglet import shutdown

    c = run.config
    meter = Meter(c.ttt_length)
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
            meter.add(train_step(run, order[index]))
            run.step_seconds += time.time() - step_started
            run.step += 1

            if run.step % c.log_every == 0 or run.step == run.stop_at:
                record = meter.flush(run.step, run.total_steps, epoch, lr)
                per_step = (time.time() - loop_started) / (run.step - first_step)
                record |= {"stop_at": run.stop_at, "eta_s": per_step * (run.stop_at - run.step)}
                if run.rank == 0:
                    with run.metrics_path.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                    log.info(
                        "step %d/%d loss %.4f acc %s %.0f tok/s ETA %.0f s",
                        run.step,
                        run.stop_at,
                        record["loss"],
                        [round(a, 3) for a in record["acc"]],
                        record["tokens_per_s"],
                        record["eta_s"],
                    )
                    if progress is not None:
                        progress(record)
            if run.heldout is not None and run.step % run.steps_per_epoch == 0:  # an epoch's end
                keep_if_best(run)
            stop = shutdown.requested()  # a signal: the checkpoint of this step, then stop
            every = c.save_every or run.steps_per_epoch
            if stop or run.step % every == 0 or run.step == run.stop_at:
                save(run)
            if stop:
                shutdown.raise_if_requested()
    if not (run.draft_dir / "model.safetensors").exists():
        save(run)
    if run.heldout is not None and run.rank == 0 and (run.best_dir / "config.json").exists():
        with atomic_folder(run.draft_dir) as tmp:  # the exported draft: the best epoch's
            for f in run.best_dir.iterdir():
                shutil.copyfile(f, tmp / f.name)


def keep_if_best(run: Run) -> None:
    """train.keep_best at an epoch's end: the held-out loss, and the draft in `best/` when it
    is the lowest so far."""
    loss = heldout_loss(run)
    improved = run.best is None or loss < run.best["loss"]
    run.heldout_losses.append(
        {"epoch": run.step / run.steps_per_epoch, "step": run.step, "loss": loss}
    )
    if run.rank == 0:
        log.info("held-out loss %.4f at step %d%s", loss, run.step, " (best)" if improved else "")
        if improved:
            save_draft(run.draft, run.best_dir, run.aux_layer_ids, run.aux_layer_convention)


def summarize(run: Run) -> dict:
    """The run's figures for the stage manifest (plots the loss curve on rank 0)."""
    metrics = read_metrics(run.metrics_path) if run.rank == 0 else []
    if metrics:
        plot_loss(metrics, run.plot_path, run.heldout_losses)
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
    if config.keep_best:
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
    if hasattr(data, "start_prefetch"):  # a served online source streams features ahead
        data.start_prefetch(plan(run))
    try:
        train_loop(run, progress)
    finally:
        if hasattr(data, "stop_prefetch"):
            data.stop_prefetch()
    _barrier(run.world)  # the last checkpoint is in place before any process returns
    return summarize(run)
