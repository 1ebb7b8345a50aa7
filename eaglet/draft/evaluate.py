"""Offline evaluation of a draft: acceptance length tau under greedy chain speculation.

Owns `evaluate_draft` (a trained draft, and beside it a freshly initialised draft with the same
config and vocab for the trained-vs-untrained comparison) and `plot_acceptance`.

One round, batch 1, no KV cache (the target re-reads the whole sequence; fine for the small
models this runs on): the target's forward over the sequence x_0..x_{L-1} gives its aux features
and its greedy next token x_L; the draft runs step 0 over every index (feeding x_{t+1}, x_L at the
last) and k-1 more steps at the last index with its own hidden state and its own tokens - the
same `Eagle3Draft.forward` that training unrolls; the target checks the k drafted tokens greedily
and the round emits x_L plus the n accepted ones. tau = mean over rounds of n + 1, which is vLLM's
1 + accepted / drafts. Speculation must reproduce plain greedy decoding; `outputs_match_greedy`
records that it did.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from eaglet.draft.checkpoint import config_from_json, load_draft
from eaglet.draft.model import Eagle3Draft, ttt_attention_mask

HF_INDEX = "hf_hidden_states_index"  # id i = HF hidden_states[i] = input of layer i (vLLM)


def load_target(target_model_dir: Path, device: str = "cpu", trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(target_model_dir), dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    return model.to(device).eval()


def default_eos_ids(target) -> list[int]:
    for cfg in (getattr(target, "generation_config", None), target.config):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


def resolve_aux_ids(draft_config: dict, aux_layer_ids: list[int] | None) -> list[int]:
    if aux_layer_ids is not None:
        return list(aux_layer_ids)
    convention = draft_config.get("eaglet", {}).get("aux_layer_convention", HF_INDEX)
    if convention != HF_INDEX:
        raise ValueError(f"draft aux ids are in {convention!r}; pass aux_layer_ids ({HF_INDEX})")
    return list(draft_config["eagle_aux_hidden_state_layer_ids"])


@torch.no_grad()
def target_forward(target, ids: list[int], aux_layer_ids: list[int]):
    """Greedy choice after every prefix [L] and aux features [L, 3H] of the sequence."""
    x = torch.tensor([ids], device=target.device)
    out = target(input_ids=x, output_hidden_states=True, use_cache=False)
    greedy = out.logits[0].argmax(-1)  # [L], greedy[p] = target's token after x_0..x_p
    aux = torch.cat([out.hidden_states[i][0] for i in aux_layer_ids], dim=-1)  # [L, 3H]
    return greedy, aux


@torch.no_grad()
def propose(
    draft: Eagle3Draft,
    embed: torch.Tensor,  # [V, H]
    ids: list[int],  # x_0..x_{L-1}
    aux: torch.Tensor,  # [L, 3H]
    next_token: int,  # x_L, the target's greedy token
    k: int,
) -> list[int]:
    """k drafted target token ids following x_L."""
    L, device = len(ids), aux.device
    inputs = torch.tensor([ids[1:] + [next_token]], device=device)  # [1, L], x_{t+1} at index t
    positions = torch.arange(L, device=device)[None]  # [1, L]
    mask = ttt_attention_mask(L, 0, device)  # [L, L], causal
    hidden, cache = draft(F.embedding(inputs, embed), draft.fuse(aux[None]), positions, None, mask)
    hidden = hidden[:, -1:]  # [1, 1, H]; from here on only the last index drafts
    tokens: list[int] = []
    for i in range(1, k + 1):
        draft_id = draft.compute_logits(hidden)[0, -1].argmax()
        tokens.append(int(draft.to_target_ids(draft_id)))
        if i == k:
            break
        token = torch.tensor([[tokens[-1]]], device=device)  # [1, 1]
        position = torch.tensor([[L - 1 + i]], device=device)  # step i sits at t + i
        # the last index sees every step-0 key and its own keys of steps 1..i: nothing masked
        hidden, cache = draft(F.embedding(token, embed), hidden, position, cache, None)
    return tokens


@torch.no_grad()
def greedy_generate(target, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding with the same full-sequence forward, the reference output."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        x = torch.tensor([seq], device=target.device)
        token = int(target(input_ids=x, use_cache=False).logits[0, -1].argmax())
        seq.append(token)
        if token in eos:
            break
    return seq[len(prompt) :]


@torch.no_grad()
def speculative_generate(
    target,
    draft,
    embed,
    prompt: list[int],
    k: int,
    max_new_tokens: int,
    eos: set[int],
    aux_layer_ids: list[int],
) -> tuple[list[int], list[int]]:
    """Greedy chain speculation; returns (new tokens, accepted count n of every round).

    n is what the target accepted, also in a last round cut short by eos or max_new_tokens (as
    vLLM counts it), so tau may credit a few tokens past the stop."""
    seq, new, accepted = list(prompt), [], []
    greedy, aux = target_forward(target, seq, aux_layer_ids)
    next_token = int(greedy[-1])
    while len(new) < max_new_tokens:
        drafts = propose(draft, embed, seq, aux, next_token, k)
        greedy, aux_all = target_forward(target, seq + [next_token] + drafts, aux_layer_ids)
        L = len(seq)
        n = 0  # greedy[L + j]: the target's token after next_token, d_1..d_j
        while n < k and drafts[n] == int(greedy[L + n]):
            n += 1
        accepted.append(n)
        emitted = [next_token] + drafts[:n]
        for token in emitted:
            new.append(token)
            if token in eos or len(new) >= max_new_tokens:
                return new, accepted
        seq += emitted
        aux = aux_all[: len(seq)]  # causal: valid for the accepted prefix
        next_token = int(greedy[len(seq) - 1])
    return new, accepted


def _evaluate(
    draft: Eagle3Draft,
    target,
    prompts: list[list[int]],
    references: list[list[int]],  # plain greedy output per prompt
    k: int,
    max_new_tokens: int,
    eos: set[int],
    aux_layer_ids: list[int],
    progress: Callable[[dict], None] | None,
) -> dict:
    t0 = time.time()
    embed = target.get_input_embeddings().weight
    draft = draft.to(target.device).eval()
    rounds: list[int] = []
    new_tokens, mismatched = 0, []
    for p, (prompt, reference) in enumerate(zip(prompts, references, strict=True)):
        out, accepted = speculative_generate(
            target, draft, embed, prompt, k, max_new_tokens, eos, aux_layer_ids
        )
        if out != reference:
            mismatched.append(p)
        rounds += accepted
        new_tokens += len(out)
        if progress is not None:
            progress(
                {
                    "prompt": p + 1,
                    "num_prompts": len(prompts),
                    "tau": 1 + sum(rounds) / max(len(rounds), 1),
                }
            )
    reached = [sum(n >= j for n in rounds) for j in range(k + 1)]  # reached[0] = rounds
    return {
        "tau": 1 + sum(rounds) / max(len(rounds), 1),
        "num_speculative_tokens": k,
        "num_prompts": len(prompts),
        "num_rounds": len(rounds),
        "new_tokens": new_tokens,
        "drafted_tokens": k * len(rounds),
        "accepted_tokens": sum(rounds),
        "acceptance_rate": sum(rounds) / max(k * len(rounds), 1),
        # position j (1-based) accepted, over all rounds / given position j-1 was accepted
        "per_position_acceptance": [reached[j] / max(reached[0], 1) for j in range(1, k + 1)],
        "per_position_conditional_acceptance": [
            reached[j] / reached[j - 1] if reached[j - 1] else 0.0 for j in range(1, k + 1)
        ],
        "outputs_match_greedy": not mismatched,
        "mismatched_prompts": mismatched,
        "max_new_tokens": max_new_tokens,
        "aux_layer_ids": list(aux_layer_ids),
        "seconds": time.time() - t0,
    }


def evaluate_draft(
    draft_dir: Path,
    target_model_dir: Path,
    prompts: list[list[int]],
    num_speculative_tokens: int = 4,
    max_new_tokens: int = 128,
    eos_token_ids: list[int] | None = None,  # None: the target's generation config
    aux_layer_ids: list[int] | None = None,  # HF hidden_states indices; None: the draft's config
    progress: Callable[[dict], None] | None = None,
    device: str = "cpu",
    trust_remote_code: bool = False,
    untrained_seed: int | None = 0,
) -> dict:
    """tau and per-position acceptance of the draft in `draft_dir` on `prompts` (token ids).

    With `untrained_seed`, the same evaluation of a fresh draft (the same config and vocab,
    weights drawn from the seed) is the baseline under `"untrained"`; the target is loaded,
    and its plain greedy reference decoded, once for both."""
    trained, config = load_draft(Path(draft_dir))
    target = load_target(Path(target_model_dir), device, trust_remote_code)
    aux_ids = resolve_aux_ids(config, aux_layer_ids)
    eos = set(default_eos_ids(target) if eos_token_ids is None else eos_token_ids)
    references = [greedy_generate(target, prompt, max_new_tokens, eos) for prompt in prompts]
    settings = (num_speculative_tokens, max_new_tokens, eos, aux_ids)
    report = _evaluate(trained, target, prompts, references, *settings, progress)
    report.update(draft="trained", draft_dir=str(draft_dir))
    if untrained_seed is not None:
        torch.manual_seed(untrained_seed)
        fresh = Eagle3Draft(config_from_json(config))
        fresh.set_vocab(trained.d2t, trained.t2d)
        baseline = _evaluate(fresh, target, prompts, references, *settings, None)
        report["untrained"] = dict(baseline, draft=f"untrained (seed {untrained_seed})")
    return report


def plot_acceptance(report: dict, path: Path) -> None:
    """Bar chart of per-position acceptance (unconditional and conditional), tau in the title."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    k = report["num_speculative_tokens"]
    xs = list(range(1, k + 1))
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    width = 0.4
    ax.bar(
        [x - width / 2 for x in xs],
        report["per_position_acceptance"],
        width,
        label="accepted (all rounds)",
    )
    ax.bar(
        [x + width / 2 for x in xs],
        report["per_position_conditional_acceptance"],
        width,
        label="accepted | previous accepted",
    )
    ax.set(
        xlabel="draft position",
        ylabel="acceptance rate",
        ylim=(0, 1),
        xticks=xs,
        title=f"tau = {report['tau']:.2f} over {report['num_rounds']} rounds",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
