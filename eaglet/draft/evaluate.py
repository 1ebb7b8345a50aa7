"""Offline evaluation of a draft: acceptance length tau under speculation, greedy or sampled.

Owns `evaluate_draft` (a trained draft, and beside it a freshly initialised draft with the same
config and vocab for the trained-vs-untrained comparison, tau for every k = 1..K) and
`plot_acceptance`. The untrained draft's pass is the costliest (it accepts almost nothing, so a
round emits one token) and the same for every draft of one shape on one target and prompt set:
with `untrained_cache` it is run once and read back (`untrained_key`).

One round, batch 1: the target's forward over the sequence x_0..x_{L-1} gives its aux features
and its greedy next token x_L; the draft's method proposes k tokens after x_L as vLLM does for
it (`DraftMethod.drafter`: EAGLE-3's chain, P-EAGLE's mask slots, a block drafter's block); the
target checks the k drafted tokens greedily and the round emits x_L plus the n accepted ones.
tau = mean over rounds of n + 1, which is vLLM's 1 + accepted / drafts; like vLLM it credits
drafts accepted past the stop token in a request's last round, and runs no round once the
target's own token is the stop. `emitted_tau` is the output tokens per round, which speed
follows (the same figure served: `serving.emitted_tau`).
Speculation must reproduce plain greedy decoding; `outputs_match_greedy` records that it did.

With `use_cache` (the default) both models keep a KV cache: the target reads only the k + 1
tokens of a round (its cache cropped back to the accepted prefix afterwards) and the draft
computes step 0 only for positions it has not seen (the positions of earlier rounds keep their
keys: their inputs x_{t+1} and aux features never change). Without it every round re-reads the
whole sequence; both give the same tokens (tests/test_evaluate.py). The target runs where
`TargetConfig.device` says (the GPU when there is one, with `auto`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

from eaglet.config.evaluate import EvaluateConfig
from eaglet.config.target import TargetConfig
from eaglet.cpu_threads import apply_threads
from eaglet.draft import rejection
from eaglet.draft.methods import DEFAULT_METHOD, draft_method, method_of_draft
from eaglet.draft.rejection import Sampling
from eaglet.draft.sampled import DRAFT_SAMPLING
from eaglet.draft.segments import segment_rounds, segment_stats, token_segments
from eaglet.draft.serving import check_gap, emitted_tau, measure_served
from eaglet.errors import NonFiniteError
from eaglet.reasoning import ReasoningFormat
from eaglet.stages import ACCEPTANCE_PLOT_FILE, REPORT_FILE
from eaglet.storage import write_json_atomic
from eaglet.target import load_model


def load_target(target: TargetConfig | Path | str, device: str | None = None):
    """The target model for evaluation, through `eaglet.target.load_model` (a bare model folder
    means float32 on `device`, default auto)."""
    if not isinstance(target, TargetConfig):
        return load_model(TargetConfig(model=str(target), dtype="float32", device=device or "auto"))
    return load_model(target if device is None else target.model_copy(update={"device": device}))


def default_eos_ids(target) -> list[int]:
    for cfg in (getattr(target, "generation_config", None), target.config):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


def resolve_aux_ids(
    draft_config: dict, aux_layer_ids: list[int] | None, where: Path | str = "config.json"
) -> list[int]:
    """HF hidden_states indices to feed the draft: the given ids, else the draft's own (any
    export: its method reads them, in the convention its config names)."""
    if aux_layer_ids is not None:
        return list(aux_layer_ids)
    return method_of_draft(draft_config).draft_layer_ids(draft_config, where)


def finite(logits: torch.Tensor, position: int) -> torch.Tensor:
    """`logits` [n, V], refused when any is NaN or inf: argmax would read them as token 0
    everywhere, target and draft would agree, and tau would be perfect."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteError(
            f"the target's logits are not finite (NaN or inf) near token {position}: its "
            "weights or dtype are broken (check target.model's safetensors and target.dtype)"
        )
    return logits


@torch.no_grad()
def target_logits(target, ids: list[int], aux_layer_ids: list[int]):
    """The target's logits after every prefix [L, V] and aux features [L, 3H] of the sequence."""
    x = torch.tensor([ids], device=target.device)
    out = target(input_ids=x, output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[i][0] for i in aux_layer_ids], dim=-1)  # [L, 3H]
    return finite(out.logits[0], len(ids)), aux


def target_forward(target, ids: list[int], aux_layer_ids: list[int]):
    """Greedy choice after every prefix [L] and aux features [L, 3H] of the sequence."""
    logits, aux = target_logits(target, ids, aux_layer_ids)
    return logits.argmax(-1), aux  # greedy[p]: after x_0..x_p


class TargetRunner:
    """The target over a growing sequence: `extend` appends tokens and returns the logits after,
    and the aux features [n, 3H] of, each appended position; `truncate` drops a rejected tail.
    With `use_cache` only the appended tokens are computed."""

    def __init__(self, target, aux_layer_ids: list[int], use_cache: bool):
        self.target, self.aux_layer_ids, self.use_cache = target, aux_layer_ids, use_cache
        self.seq: list[int] = []
        self.cache = None

    @torch.no_grad()
    def extend(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_cache:
            logits, aux = target_logits(self.target, self.seq + tokens, self.aux_layer_ids)
            self.seq += tokens
            return logits[-len(tokens) :], aux[-len(tokens) :]
        if self.cache is None:
            from transformers import DynamicCache

            self.cache = DynamicCache()
        x = torch.tensor([tokens], device=self.target.device)
        out = self.target(
            input_ids=x, past_key_values=self.cache, output_hidden_states=True, use_cache=True
        )
        self.cache = out.past_key_values
        self.seq += tokens
        aux = torch.cat([out.hidden_states[i][0] for i in self.aux_layer_ids], dim=-1)
        return finite(out.logits[0], len(self.seq)), aux  # [n, V], [n, 3H]

    def truncate(self, length: int) -> None:
        del self.seq[length:]
        if self.cache is not None and self.cache.get_seq_length() > length:
            self.cache.crop(length - self.cache.get_seq_length())  # negative: drop that many


@torch.no_grad()
def greedy_generate(
    target, prompt: list[int], max_new_tokens: int, eos: set[int], use_cache: bool = True
) -> list[int]:
    """Plain greedy decoding, the reference output."""
    seq, fed, cache = list(prompt), 0, None
    if use_cache:
        from transformers import DynamicCache

        cache = DynamicCache()
    for _ in range(max_new_tokens):
        x = torch.tensor([seq[fed:]], device=target.device)
        out = target(input_ids=x, past_key_values=cache, use_cache=use_cache)
        if use_cache:
            cache, fed = out.past_key_values, len(seq)
        token = int(finite(out.logits[0, -1:], len(seq) - len(prompt)).argmax())
        seq.append(token)
        if token in eos:
            break
    return seq[len(prompt) :]


class Speculation(NamedTuple):
    """One prompt's speculative decoding: its new tokens, and per round the accepted count and
    the accepted count in expectation over the target's draws (the same count when greedy)."""

    tokens: list[int]
    accepted: list[int]
    expected: list[float]


class Verifier:
    """How the target checks a round's drafts: greedily (the longest prefix equal to its argmax,
    then its argmax), or with `sampling` by vLLM's rejection rule (`eaglet.draft.rejection`),
    its draws from `generator`."""

    def __init__(self, sampling: Sampling | None = None, generator: torch.Generator | None = None):
        self.sampling, self.generator = sampling, generator

    def first(self, logits: torch.Tensor) -> int:
        """The target's token after the prompt, from its logits [V] there."""
        if self.sampling is None:
            return int(logits.argmax())
        probs = rejection.target_probs(logits[None], self.sampling)[0]  # [V]
        return rejection.sample(probs, self.generator)

    def check(self, logits: torch.Tensor, drafts: list[int]) -> tuple[int, int, float]:
        """(accepted n, the target's next token, expected n) from its logits [k + 1, V] after
        the pending token and each draft."""
        if self.sampling is not None:
            probs = rejection.target_probs(logits, self.sampling)  # [k + 1, V]
            return rejection.verify(probs, drafts, self.generator)
        greedy = logits.argmax(-1)  # greedy[j]: the target's token after next_token, d_1..d_j
        n = 0
        while n < len(drafts) and drafts[n] == int(greedy[n]):
            n += 1
        return n, int(greedy[n]), float(n)


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
    use_cache: bool = True,
    verifier: Verifier | None = None,  # None: greedy
) -> Speculation:
    """Chain speculation, greedy unless `verifier` samples.

    The rounds are the ones vLLM runs: the target's token after the prompt, and each round's
    bonus token, count as emitted as soon as the target chose them, so no round is run once one
    of them is a stop token or reaches max_new_tokens. n is what the target accepted, also in a
    last round cut short by eos or max_new_tokens (as vLLM counts it), so tau may credit a few
    tokens past the stop; `emitted_tau` (see `evaluate_loaded`) does not."""
    verifier = verifier or Verifier()
    runner = TargetRunner(target, aux_layer_ids, use_cache)
    drafter = draft_method(draft.method_name).drafter(draft, target, use_cache)
    seq, new, accepted, expected = list(prompt), [], [], []
    logits, aux = runner.extend(seq)
    next_token = verifier.first(logits[-1])  # emitted already, in vLLM's count
    while next_token not in eos and len(new) + 1 < max_new_tokens:
        drafts = drafter.propose(seq, aux, next_token, k)
        logits, aux_new = runner.extend([next_token] + drafts)
        n, after, mean = verifier.check(logits, drafts)
        accepted.append(n)
        expected.append(mean)
        emitted = [next_token] + drafts[:n]
        for token in emitted:
            new.append(token)
            if token in eos or len(new) >= max_new_tokens:
                return Speculation(new, accepted, expected)
        seq += emitted
        runner.truncate(len(seq))
        aux = torch.cat([aux, aux_new[: n + 1]])  # causal: valid for the accepted prefix
        next_token = after
    new.append(next_token)  # the last bonus token (or the first token, when it stops alone)
    return Speculation(new, accepted, expected)


def evaluate_loaded(
    draft: torch.nn.Module,  # moved to the target's device and dtype: pass a copy to keep it
    target,
    prompts: list[list[int]],
    references: list[list[int]] | None,  # plain greedy output per prompt; None when sampled
    k: int,
    max_new_tokens: int,
    eos: set[int],
    aux_layer_ids: list[int],
    progress: Callable[[dict], None] | None,
    use_cache: bool = True,
    segment_labels: Callable[[list[int]], list[str]] | None = None,  # output ids -> segments
    verifier: Verifier | None = None,  # None: greedy
) -> dict:
    t0 = time.time()
    embed = target.get_input_embeddings().weight
    draft = draft.to(device=target.device, dtype=embed.dtype).eval()
    rounds: list[int] = []
    expected: list[float] = []
    by_segment: list[tuple[str, int, int]] = []  # (segment, accepted, emitted) per round
    new_tokens, mismatched = 0, []
    for p, prompt in enumerate(prompts):
        try:
            out, accepted, means = speculative_generate(
                target, draft, embed, prompt, k, max_new_tokens, eos, aux_layer_ids, use_cache,
                verifier,
            )  # fmt: skip
        except NonFiniteError as exc:
            raise NonFiniteError(f"held-out prompt {p} of {len(prompts)}: {exc}") from None
        if references is not None and out != references[p]:
            mismatched.append(p)
        rounds += accepted
        expected += means
        new_tokens += len(out)
        if segment_labels is not None and out:
            by_segment += segment_rounds(out, accepted, segment_labels(out))
        if progress is not None:
            progress({"tau": 1 + sum(rounds) / max(len(rounds), 1)})
    reached = [sum(n >= j for n in rounds) for j in range(k + 1)]  # reached[0] = rounds
    return {
        "tau": 1 + sum(rounds) / max(len(rounds), 1),
        # the same rounds' accepted counts in expectation over the target's draws (sampled:
        # less noisy than tau; greedy: tau)
        "expected_tau": 1 + sum(expected) / max(len(expected), 1),
        "emitted_tau": emitted_tau(new_tokens, len(prompts), len(rounds)),
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
        # sampled: the output is a draw, not the greedy answer (None: not compared)
        "outputs_match_greedy": None if references is None else not mismatched,
        "mismatched_prompts": mismatched,
        "max_new_tokens": max_new_tokens,
        "aux_layer_ids": list(aux_layer_ids),
        **({"segments": segment_stats(by_segment, k)} if segment_labels is not None else {}),
        "seconds": time.time() - t0,
    }


class EvaluationProgress:
    """Counts the prompts done across every pass of `evaluate_draft` and reports each to
    `report` (None: nothing) as {"pass", "done", "total", "elapsed_s", "eta_s", "tau"}."""

    def __init__(self, total: int, report: Callable[[dict], None] | None) -> None:
        self.total, self.report = total, report
        self.done = 0
        self.started = time.monotonic()

    def step(self, name: str, tau: float | None = None) -> None:
        self.done += 1
        if self.report is None:
            return
        elapsed = time.monotonic() - self.started
        self.report(
            {
                "pass": name,
                "done": self.done,
                "total": self.total,
                "elapsed_s": elapsed,
                "eta_s": elapsed / self.done * (self.total - self.done),
                "tau": tau,
            }
        )

    def callback(self, name: str) -> Callable[[dict], None]:
        return lambda update: self.step(name, update["tau"])


def _greedy_references(
    model,  # the target (a transformers causal LM)
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: set[int],
    use_cache: bool,
    counter: EvaluationProgress,
) -> list:
    """The target's plain greedy answer to each prompt, the reference every pass compares to."""
    references = []
    for p, prompt in enumerate(prompts):
        try:
            references.append(greedy_generate(model, prompt, max_new_tokens, eos, use_cache))
        except NonFiniteError as exc:
            raise NonFiniteError(f"held-out prompt {p} of {len(prompts)}: {exc}") from None
        counter.step("greedy references")
    return references


def untrained_key(fresh: torch.nn.Module, prompts: list[list[int]], settings: dict) -> str:
    """What decides the untrained draft's pass besides the target and the code (which the
    caller's cache folder is keyed by): the fresh draft's every weight and buffer (its shape,
    seed and vocab), the prompts and the settings of the pass."""
    digest = hashlib.sha256(json.dumps([prompts, settings], sort_keys=True).encode())
    for name, tensor in sorted(fresh.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


def evaluate_draft(
    draft_dir: Path,
    target: TargetConfig | Path | str,
    prompts: list[list[int]],
    num_speculative_tokens: int = 4,
    max_new_tokens: int = 128,
    eos_token_ids: list[int] | None = None,  # None: the target's generation config
    aux_layer_ids: list[int] | None = None,  # HF hidden_states indices; None: the draft's config
    progress: Callable[[dict], None] | None = None,
    device: str | None = None,  # None: the TargetConfig's (auto for a bare folder)
    untrained_seed: int | None = 0,
    every_k: bool = False,
    use_cache: bool = True,
    reasoning_format: ReasoningFormat | None = None,
    sampling: Sampling | None = None,
    sampling_seed: int = 0,
    untrained_cache: Path | None = None,
) -> dict:
    """tau and per-position acceptance of the draft in `draft_dir` (any export) on `prompts`
    (token ids), with k = `num_speculative_tokens`; with `every_k`, also tau for each k = 1..K
    under `"tau_by_k"` (a run per k: rounds start elsewhere, so a shorter chain is not a prefix
    of a longer one's statistics).

    With `untrained_seed`, the same evaluation of a fresh draft (the same config and vocab,
    weights drawn from the seed) is the baseline under `"untrained"`; the target is loaded,
    and its plain greedy reference decoded, once for both.

    With `reasoning_format`, each pass also reports τ per segment (thinking, answer, tool)
    under `"segments"` (`eaglet.draft.segments`), split from the output ids as extract does.

    With `untrained_cache` (a folder the caller keys by the target and the code), the untrained
    pass is read from `<untrained_key>.json` there when an earlier evaluation wrote it, and
    written there otherwise.

    With `sampling`, one more pass samples the target at that temperature and top_p and
    verifies the draft by vLLM's rejection rule (`eaglet.draft.rejection`; draws seeded by
    `sampling_seed`), reported under `"sampled"` beside the greedy figures.

    `progress` is called after each prompt of each pass (the greedy references, the draft at
    k, at every other k, the untrained draft) with the pass's name, the prompts done of all
    passes, their total, the seconds so far and an ETA (`EvaluationProgress`)."""
    apply_threads("evaluate")
    method = method_of_draft(json.loads((Path(draft_dir) / "config.json").read_text()))
    trained, config = method.load(Path(draft_dir))
    num_speculative_tokens = method.evaluation_k(config, num_speculative_tokens)
    longest = max(len(p) for p in prompts) + max_new_tokens + num_speculative_tokens
    window = getattr(trained.config, "sliding_window", None)
    if window is not None and longest > window:
        raise ValueError(
            f"{draft_dir}: the draft attends within a sliding window of {window} tokens, which "
            f"eaglet's evaluator does not apply, and the evaluation reaches {longest} tokens"
        )
    model = load_target(target, device)
    aux_ids = resolve_aux_ids(config, aux_layer_ids, Path(draft_dir) / "config.json")
    eos = set(default_eos_ids(model) if eos_token_ids is None else eos_token_ids)
    fresh, baseline, baseline_file = None, None, None
    if untrained_seed is not None:
        with torch.random.fork_rng():  # its seed leaves the caller's random state alone
            fresh = method.fresh_like(trained, untrained_seed)
        if untrained_cache is not None:
            settings = {"k": num_speculative_tokens, "max_new_tokens": max_new_tokens,
                        "eos": sorted(eos), "aux": aux_ids, "cache": use_cache,
                        "segments": type(reasoning_format).__name__}  # fmt: skip
            key = untrained_key(fresh, prompts, settings)
            baseline_file = Path(untrained_cache) / f"{key}.json"
            if baseline_file.is_file():
                baseline = json.loads(baseline_file.read_text())
    passes = 2 + (num_speculative_tokens - 1 if every_k else 0)
    passes += fresh is not None and baseline is None
    passes += sampling is not None
    counter = EvaluationProgress(len(prompts) * passes, progress)
    references = _greedy_references(model, prompts, max_new_tokens, eos, use_cache, counter)
    labels = None
    if reasoning_format is not None:
        labels = partial(token_segments, reasoning_format=reasoning_format, end_ids=eos)
    common = dict(
        target=model, prompts=prompts, references=references, max_new_tokens=max_new_tokens,
        eos=eos, aux_layer_ids=aux_ids, use_cache=use_cache, segment_labels=labels,
    )  # fmt: skip
    k = num_speculative_tokens
    report = evaluate_loaded(trained, k=k, progress=counter.callback(f"draft at k={k}"), **common)
    report.update(
        draft="trained", draft_dir=str(draft_dir), device=str(model.device), method=method.name
    )
    if every_k:  # k's own tau is the pass above
        report["tau_by_k"] = {
            str(j): report["tau"] if j == k else evaluate_loaded(
                trained, k=j, progress=counter.callback(f"draft at k={j}"), **common
            )["tau"]
            for j in range(1, k + 1)
        }  # fmt: skip
    if sampling is not None:
        name = f"draft at k={k}, T={sampling.temperature:g}"
        generator = torch.Generator(device=model.device).manual_seed(sampling_seed)
        sampled = evaluate_loaded(
            trained, k=k, progress=counter.callback(name), verifier=Verifier(sampling, generator),
            **dict(common, references=None),
        )  # fmt: skip
        report["sampled"] = dict(
            sampled, temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling_seed,
            draft_sampling=DRAFT_SAMPLING,
        )  # fmt: skip
    if fresh is not None:
        if baseline is None:  # not evaluated before on this target, prompts and shape
            untrained = counter.callback("untrained draft")
            baseline = evaluate_loaded(fresh, k=k, progress=untrained, **common)
            if baseline_file is not None:
                baseline_file.parent.mkdir(parents=True, exist_ok=True)
                write_json_atomic(baseline_file, baseline)
        report["untrained"] = dict(baseline, draft=f"untrained (seed {untrained_seed})")
    return report


def plot_acceptance(report: dict, path: Path, sampled: dict | None = None) -> None:
    """Bar chart of per-position acceptance (unconditional and conditional), tau in the title;
    a line per segment, and one for the sampled evaluation when there is one."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    k = report["num_speculative_tokens"]
    xs = list(range(1, k + 1))
    # The legend sits below the axes: inside, it covered the bars at positions 2 to 4.
    fig = Figure(figsize=(6, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    width = 0.4
    ax.bar(
        [x - width / 2 for x in xs],
        report["per_position_acceptance"],
        width,
        color="0.55",
        label="accepted (all rounds)",
    )
    ax.bar(
        [x + width / 2 for x in xs],
        report["per_position_conditional_acceptance"],
        width,
        color="0.8",
        label="accepted | previous accepted",
    )
    colors = {"thinking": "tab:purple", "answer": "tab:green", "tool": "tab:orange"}
    for segment, stats in report.get("segments", {}).items():
        ax.plot(
            xs,
            stats["per_position_acceptance"],
            marker="o",
            color=colors.get(segment),
            label=f"{segment}: tau {stats['tau']:.2f}, {stats['rounds']} rounds",
        )
    if sampled is not None:
        ax.plot(
            xs,
            sampled["per_position_acceptance"],
            marker="s",
            linestyle="--",
            color="tab:blue",
            label=f"sampled at T={sampled['temperature']:g}: tau {sampled['tau']:.2f}",
        )
    ax.set(
        xlabel="draft position",
        ylabel="acceptance rate",
        ylim=(0, 1),
        xticks=xs,
        title=f"{report.get('method', DEFAULT_METHOD)} draft: tau = {report['tau']:.2f} over "
        f"{report['num_rounds']} rounds",
    )
    fig.legend(loc="outside lower center", ncols=2, fontsize="small", frameon=False)
    fig.savefig(str(path), dpi=100)


def evaluation_report(
    settings: EvaluateConfig,
    target: TargetConfig,
    draft_dir: Path,
    prompts: list[list[int]],
    eos_token_ids: list[int],
    aux_layer_ids: list[int] | None,
    folder: Path,
    progress: Callable[[dict], None] | None = None,
    reasoning_format: ReasoningFormat | None = None,
    untrained_cache: Path | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """The evaluate stage's report, written to `folder/report.json` (with `acceptance.png`):
    offline tau of the draft (k = 1..K) beside an untrained draft's, per segment (thinking,
    answer, tool) where `reasoning_format` is given, sampled at `settings.temperature` when
    above 0 (under `"sampled"`), and with `settings.serving == "vllm"` the tau vLLM's counters
    give for the same draft at the same k and temperature (server logs in `folder`, progress to
    `log`). A gap above `settings.max_serving_gap` raises `ServingGapError` after the report
    is written; sampled, the served tau is compared with the offline expected tau (the same
    mean, less noise)."""
    sampling = Sampling(settings.temperature, settings.top_p) if settings.temperature > 0 else None
    trained = evaluate_draft(
        draft_dir, target, prompts, num_speculative_tokens=settings.num_speculative_tokens,
        max_new_tokens=settings.max_new_tokens, eos_token_ids=eos_token_ids,
        aux_layer_ids=aux_layer_ids, untrained_seed=0, every_k=True, progress=progress,
        reasoning_format=reasoning_format, sampling=sampling,
        sampling_seed=settings.sampling_seed, untrained_cache=untrained_cache,
    )  # fmt: skip
    baseline = trained.pop("untrained")
    sampled = trained.pop("sampled", None)
    report = {
        "draft": trained,
        "untrained": baseline,
        "prompts": len(prompts),
        "tau": trained["tau"],
        "emitted_tau": trained["emitted_tau"],
        "tau_by_k": trained["tau_by_k"],
        "untrained_tau": baseline["tau"],
        "segments": trained.get("segments", {}),
        **({"sampled": sampled} if sampled is not None else {}),
    }
    # what the served tau is compared with: the offline figure at the same temperature
    offline_tau = trained["tau"] if sampled is None else sampled["expected_tau"]
    served = None
    if settings.serving == "vllm":
        served = measure_served(
            settings, target, draft_dir, prompts, eos_token_ids, folder / "vllm_server.log", log
        )
        report.update(
            served=served, served_tau=served["tau"], serving_gap=abs(served["tau"] - offline_tau)
        )
    write_json_atomic(folder / REPORT_FILE, report)
    plot_acceptance(trained, folder / ACCEPTANCE_PLOT_FILE, sampled)
    if served is not None:
        check_gap(served, offline_tau, settings.max_serving_gap, str(folder / REPORT_FILE))
    return report
