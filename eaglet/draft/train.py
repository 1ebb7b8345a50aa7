"""Train an EAGLE-3 draft model on the target's saved hidden states.

Owns the training run, nanoGPT-style, top to bottom: settings, data (hidden-state shards ->
padded batches, one sample per row), target pieces (frozen `embed_tokens` and `lm_head`), the
training-time-test unroll (`ttt_unroll`), the loss (`ttt_loss`), the learning-rate schedule, and
the loop with logging, checkpointing and resume (`train_draft`). It writes, under `out_dir`:
`draft/` (the checkpoint vLLM loads), `state/` (resumable state), `metrics.jsonl`, `loss.png`.

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
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from eaglet.draft.checkpoint import load_training_state, save_draft, save_training_state
from eaglet.draft.model import Eagle3Config, Eagle3Draft, ttt_attention_mask
from eaglet.draft.vocab import DraftVocab, build_draft_vocab, count_tokens
from eaglet.hidden_states.shards import read_window

log = logging.getLogger(__name__)


@dataclass
class TrainSettings:
    epochs: int = 8
    lr: float = 1e-3
    batch_size: int = 8
    ttt_length: int = 4
    draft_vocab_size: int = 32000
    max_seq_len: int = 1024  # longer samples are cut into consecutive windows of this length
    seed: int = 0
    intermediate_size: int | None = None  # None: the target's MLP width, as published drafts do
    warmup_steps: int = 10
    grad_clip: float = 1.0
    log_every: int = 10
    ttt_step_weight: float = 0.8  # loss weight of TTT step i is ttt_step_weight ** i
    save_every: int = 0  # optimizer steps between state saves; 0 = at the end of every epoch
    max_steps: int | None = None  # stop (and save) after this many steps in total
    device: str = "auto"  # "auto" = cuda when available, else cpu


# ----------------------------------------------------------------------------------------- data

MIN_SAMPLE_TOKENS = 3  # t + 2 < n: shorter windows have nothing to predict


class HiddenStatesData:
    """The shards of one hidden-states folder, read lazily (safetensors mmap), one item per
    training window (a sample, or a max_seq_len piece of a longer one)."""

    def __init__(self, root: Path, exclude_sample_ids=frozenset(), max_seq_len: int = 1024):
        self.root = Path(root)
        lines = (self.root / "index.jsonl").read_text().splitlines()
        entries = [json.loads(line) for line in lines if line.strip()]
        self.samples = [e for e in entries if e["sample_id"] not in exclude_sample_ids]
        self.windows: list[tuple[str, int, int]] = []  # (shard, offset, length)
        for e in self.samples:
            for start in range(0, e["length"], max_seq_len):
                length = min(max_seq_len, e["length"] - start)
                if length >= MIN_SAMPLE_TOKENS:
                    self.windows.append((e["shard"], e["offset"] + start, length))
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
        ids = sorted(e["sample_id"] for e in self.samples)
        key = json.dumps([ids, batch_size, max_seq_len])
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


def epoch_batches(num_items: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch: a permutation that depends only on (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(num_items, generator=g).tolist()
    return [order[i : i + batch_size] for i in range(0, num_items, batch_size)]


# --------------------------------------------------------------------------------------- target


@dataclass
class TargetHead:
    """What the draft borrows from the target: frozen embeddings, lm_head and config numbers."""

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    config: dict


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    params = params.get("full_attention", params)  # per-layer-type dicts (transformers 5)
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


def load_target_head(target_model_dir: Path, trust_remote_code: bool = False) -> TargetHead:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(target_model_dir), dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    config = {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(cfg),
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", 32768),
        "vocab_size": cfg.vocab_size,
    }
    embed = model.get_input_embeddings().weight.detach().clone()
    lm_head = model.get_output_embeddings().weight.detach().clone()
    del model
    return TargetHead(embed=embed, lm_head=lm_head, config=config)


def draft_config(target: TargetHead, settings: TrainSettings, draft_vocab_size: int):
    c = target.config
    return Eagle3Config(
        hidden_size=c["hidden_size"],
        intermediate_size=settings.intermediate_size or c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        vocab_size=c["vocab_size"],
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=c["hidden_size"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"],
        max_position_embeddings=c["max_position_embeddings"],
    )


@torch.no_grad()
def target_labels(
    final_hidden: torch.Tensor,  # [B, T, H], after the target's final norm
    lm_head: torch.Tensor,  # [V, H]
    vocab_ids: torch.Tensor,  # [Vd], target ids of the draft vocab
    t2d: torch.Tensor,  # bool [V]
    chunk: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target distribution over the draft vocab [B, T, Vd] and whether the target's argmax is in
    the draft vocab [B, T], computed `chunk` tokens at a time to bound the [., V] logits."""
    B, T, H = final_hidden.shape
    probs, in_vocab = [], []
    for part in final_hidden.reshape(B * T, H).split(chunk):
        logits = part @ lm_head.T  # [n, V]
        in_vocab.append(t2d[logits.argmax(-1)])
        probs.append(logits[:, vocab_ids].softmax(-1))  # [n, Vd]
    return torch.cat(probs).view(B, T, -1), torch.cat(in_vocab).view(B, T)


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
) -> list[torch.Tensor]:
    """Training-time test: `ttt_length` draft steps over all T positions at once.

    Step i at index t reads embed(x_{t+1+i}) and the step-(i-1) output at t (g_t at step 0), sits
    at position t + i, attends to step-0 keys <= t and steps 1..i keys at t. Returns the logits of
    every step, each [B, T, Vd]."""
    B, T, _ = hidden.shape
    positions = torch.arange(T, device=hidden.device).expand(B, T)  # [B, T]
    cache, step_logits = [], []
    for i in range(ttt_length):
        ids = shift_left(input_ids, 1 + i, T)  # [B, T], the token after the one step i predicts
        mask = ttt_attention_mask(T, i, hidden.device)  # [T, (i+1)T]
        hidden, cache = draft(F.embedding(ids, embed), hidden, positions + i, cache, mask)
        step_logits.append(draft.compute_logits(hidden))  # [B, T, Vd]
    return step_logits


def ttt_loss(
    step_logits: list[torch.Tensor],  # per step [B, T, Vd]
    target_probs: torch.Tensor,  # [B, T, Vd], target distribution for the token after t
    target_in_vocab: torch.Tensor,  # bool [B, T]
    loss_mask: torch.Tensor,  # bool [B, T], 1 = token produced by the model
    lengths: torch.Tensor,  # [B]
    step_weight: float = 0.8,
) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """Sum over steps of step_weight**i * soft cross-entropy, each step averaged over its counted
    positions. Step i at index t predicts x_{t+2+i} (target distribution at t+1+i); it counts
    when that token is model output, exists, and the target's argmax is in the draft vocab."""
    T = loss_mask.shape[1]
    t = torch.arange(T, device=loss_mask.device)
    total = step_logits[0].new_zeros(())
    stats: dict[str, list[float]] = {"loss": [], "acc": [], "count": []}
    for i, logits in enumerate(step_logits):
        valid = (
            (t + 2 + i < lengths[:, None].to(t.device))
            & shift_left(loss_mask, 2 + i)
            & shift_left(target_in_vocab, 1 + i)
        )  # [B, T]
        b, tt = valid.nonzero(as_tuple=True)
        log_q = logits[b, tt].float().log_softmax(-1)  # [N, Vd]
        p = target_probs[b, tt + 1 + i]  # [N, Vd]
        n = max(len(b), 1)
        step_loss = -(p * log_q).sum() / n
        total = total + step_weight**i * step_loss
        stats["loss"].append(step_loss.item())
        stats["acc"].append((log_q.argmax(-1) == p.argmax(-1)).sum().item() / n)
        stats["count"].append(len(b))
    return total, stats


def learning_rate(step: int, settings: TrainSettings, total_steps: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


# ----------------------------------------------------------------------------------- plotting


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss(metrics: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2)
    steps = [m["step"] for m in metrics]
    ax_loss.plot(steps, [m["loss"] for m in metrics])
    ax_loss.set(xlabel="step", ylabel="loss", title="TTT loss")
    for i in range(len(metrics[0]["acc"]) if metrics else 0):
        ax_acc.plot(steps, [m["acc"][i] for m in metrics], label=f"step {i}")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="draft argmax = target argmax", ylim=(0, 1))
    if metrics:
        ax_acc.legend()
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)


# ----------------------------------------------------------------------------------- the loop


class Meter:
    """Averages of loss, per-step accuracy and throughput since the last log line."""

    def __init__(self, ttt_length: int):
        self.ttt_length = ttt_length
        self._reset()

    def _reset(self) -> None:
        self.loss, self.batches, self.tokens, self.t0 = 0.0, 0, 0, time.time()
        self.hits, self.counts = [0.0] * self.ttt_length, [0] * self.ttt_length

    def add(self, loss: float, stats: dict[str, list[float]], tokens: int) -> None:
        self.loss += loss
        self.batches += 1
        self.tokens += tokens
        for i, (acc, count) in enumerate(zip(stats["acc"], stats["count"], strict=True)):
            self.hits[i] += acc * count
            self.counts[i] += count

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


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def train_draft(
    hidden_states_dir: Path,
    target_model_dir: Path,
    out_dir: Path,
    settings: TrainSettings,
    aux_layer_ids: list[int],
    aux_layer_convention: str,
    exclude_sample_ids: set[str] | frozenset[str] = frozenset(),
    progress: Callable[[dict], None] | None = None,
    resume: bool = True,
    trust_remote_code: bool = False,
) -> dict:
    """Train (or resume training) a draft; return a summary dict (see the end)."""
    t_start = time.time()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft_dir, state_dir = out_dir / "draft", out_dir / "state"
    metrics_path, plot_path = out_dir / "metrics.jsonl", out_dir / "loss.png"
    if len(aux_layer_ids) != 3:
        raise ValueError(f"EAGLE-3 fuses three target layers, got {aux_layer_ids}")
    device = _device(settings.device)

    # data
    data = HiddenStatesData(hidden_states_dir, exclude_sample_ids, settings.max_seq_len)
    if len(data) == 0:
        raise ValueError(f"no training samples in {hidden_states_dir}")
    steps_per_epoch = math.ceil(len(data) / settings.batch_size)
    total_steps = settings.epochs * steps_per_epoch
    stop_at = min(total_steps, settings.max_steps or total_steps)
    fingerprint = data.fingerprint(settings.batch_size, settings.max_seq_len)

    # target pieces
    target = load_target_head(Path(target_model_dir), trust_remote_code)
    H, V = target.config["hidden_size"], target.config["vocab_size"]
    if data.aux_width() != 3 * H:
        raise ValueError(f"aux_hidden_states are {data.aux_width()} wide, expected 3 * {H}")

    # vocab: computed once; a resumed run reuses the saved one
    resuming = resume and (state_dir / "state.json").exists()
    if not resuming:
        shutil.rmtree(state_dir, ignore_errors=True)
        metrics_path.unlink(missing_ok=True)
        vocab = build_draft_vocab(data.token_counts(V), settings.draft_vocab_size)
    else:
        vocab = DraftVocab.load(state_dir / "vocab.json")

    # model and optimizer
    torch.manual_seed(settings.seed)
    draft = Eagle3Draft(draft_config(target, settings, vocab.size))
    draft.set_vocab(vocab.d2t, vocab.t2d)
    draft.to(device)
    optimizer = torch.optim.AdamW(
        draft.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    step = 0
    if resuming:
        meta, vocab = load_training_state(state_dir, draft, optimizer)
        if meta["data_fingerprint"] != fingerprint:
            raise ValueError(
                f"{state_dir} was trained on other data or batch settings; use resume=False"
            )
        step = meta["step"]
        kept = [m for m in read_metrics(metrics_path) if m["step"] <= step]
        metrics_path.write_text("".join(json.dumps(m) + "\n" for m in kept))
        log.info("resuming at step %d of %d", step, total_steps)
    start_step = step
    log.info("draft vocab %d ids, coverage %.4f", vocab.size, vocab.coverage)

    embed, lm_head = target.embed.to(device), target.lm_head.to(device)
    vocab_ids, t2d = vocab.ids.to(device), vocab.t2d.to(device)

    def save(step: int) -> None:
        meta = {
            "step": step,
            "epoch": step // steps_per_epoch,
            "total_steps": total_steps,
            "steps_per_epoch": steps_per_epoch,
            "data_fingerprint": fingerprint,
            "settings": asdict(settings),
        }
        save_training_state(state_dir, draft, optimizer, vocab, meta)
        save_draft(draft, draft_dir, aux_layer_ids, aux_layer_convention)

    # the loop
    meter = Meter(settings.ttt_length)
    batches, batches_epoch = [], -1
    draft.train()
    while step < stop_at:
        epoch, index = divmod(step, steps_per_epoch)
        if epoch != batches_epoch:
            batches = epoch_batches(len(data), settings.batch_size, settings.seed, epoch)
            batches_epoch = epoch
        batch = {k: v.to(device) for k, v in collate([data[j] for j in batches[index]]).items()}
        lr = learning_rate(step, settings, total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr

        probs, in_vocab = target_labels(batch["final_hidden_states"], lm_head, vocab_ids, t2d)
        hidden = draft.fuse(batch["aux_hidden_states"])  # [B, T, H]
        step_logits = ttt_unroll(draft, embed, batch["input_ids"], hidden, settings.ttt_length)
        mask, lengths = batch["loss_mask"], batch["lengths"]
        loss, stats = ttt_loss(
            step_logits, probs, in_vocab, mask, lengths, settings.ttt_step_weight
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), settings.grad_clip)
        optimizer.step()
        step += 1

        meter.add(loss.item(), stats, int(lengths.sum()))
        if step % settings.log_every == 0 or step == stop_at:
            record = meter.flush(step, total_steps, (step - 1) // steps_per_epoch, lr)
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if progress is not None:
                progress(record)
        if step % (settings.save_every or steps_per_epoch) == 0 or step == stop_at:
            save(step)

    if not (draft_dir / "model.safetensors").exists():
        save(step)
    metrics = read_metrics(metrics_path)
    if metrics:
        plot_loss(metrics, plot_path)
    total_tokens = sum(e["length"] for e in data.samples)
    return {
        "steps": step,
        "total_steps": total_steps,
        "resumed_from_step": start_step,
        "epochs": settings.epochs,
        "epochs_completed": step / steps_per_epoch,
        "initial_loss": metrics[0]["loss"] if metrics else None,  # first log window's mean
        "final_loss": metrics[-1]["loss"] if metrics else None,  # last log window's mean
        "final_acc": metrics[-1]["acc"] if metrics else None,
        "draft_vocab_size": vocab.size,
        "vocab_coverage": vocab.coverage,
        "train_samples": len(data.samples),
        "train_windows": len(data),
        "train_tokens": total_tokens,
        "train_loss_tokens": vocab.counted_tokens,
        "seconds": time.time() - t_start,
        "device": str(device),
        "draft_dir": str(draft_dir),
        "state_dir": str(state_dir),
        "metrics_path": str(metrics_path),
        "loss_plot": str(plot_path) if metrics else None,
    }
