"""Named evaluation sets (`evaluate.sets`): each format read from a small file the project
writes (never a benchmark's text), MT-Bench's second turn asked after the target's own first
answer, τ per set and category with the exact prompts' hash, and the preflight naming a bad
set file before any stage."""

from __future__ import annotations

import json

import pytest

from eaglet.config import EvalSet, load_config
from eaglet.eval_sets import EvalSetError, read_set
from eaglet.preflight import PreflightReport, check_eval_sets

ROWS = {
    "mt-bench": [{"question_id": 81, "category": "math", "turns": ["What is 2 plus 3?",
                                                                    "Now add 4 to that."]}],
    "gsm8k": [{"question": "What is 7 times 6?", "answer": "7 * 6 = 42.\n#### 42"}],
    "math-500": [{"problem": "What is 9 minus 4?", "answer": "5", "subject": "Algebra"}],
    "humaneval": [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "test": ""}],
    "speed-bench": [{"category": "coding", "turns": ["Write a loop."]}, {"category": "qa",
                                                                         "prompt": "Why?"}],
    "custom": [{"messages": [{"role": "user", "content": "Which is bigger: 3 or 8?"},
                             {"role": "assistant", "content": "8"}]}],
}  # fmt: skip


def write(tmp_path, name, rows):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", sorted(ROWS))
def test_each_format_reads_its_prompt_and_category(tmp_path, name):
    prompts = read_set(EvalSet(name=name, path=str(write(tmp_path, name, ROWS[name]))))
    assert prompts and all(p.turns and all(isinstance(t, str) for t in p.turns) for p in prompts)
    if name == "mt-bench":
        assert prompts[0].turns == ROWS[name][0]["turns"] and prompts[0].category == "math"
        assert prompts[0].prompt_id == "81"
    if name == "speed-bench":
        assert [p.category for p in prompts] == ["coding", "qa"] and prompts[1].turns == ["Why?"]
    if name == "custom":
        assert prompts[0].turns == ["Which is bigger: 3 or 8?"]


def test_a_row_without_its_formats_field_names_file_line_and_field(tmp_path):
    path = write(tmp_path, "gsm8k", [{"question": "a?"}, {"problem": "b?"}])
    with pytest.raises(EvalSetError, match=r"gsm8k\.jsonl:2: no string 'question'"):
        read_set(EvalSet(name="gsm8k", path=str(path)))
    report = PreflightReport()
    config = load_config(None, [f"evaluate.sets=[{{name: gsm8k, path: {path}}}]"])
    check_eval_sets(config, report)
    [problem] = report.problems
    assert problem.startswith("evaluate.sets[0] (gsm8k): ") and ":2: no string" in problem


def test_the_demo_measures_its_two_sets_unless_the_datasets_are_your_own():
    demo = load_config(None, [])
    assert [s.name for s in demo.evaluate.sets] == ["mt-bench", "gsm8k"]
    own = load_config(None, ["datasets=[{source: a, path: a.jsonl}]"])
    assert own.evaluate.sets == []


def untrained_draft(folder, fixture_model_dir):
    """An untrained EAGLE-3 draft of the fixture target, saved as eaglet saves one: it drafts
    (badly), and the figures are counted the same way as a trained one's."""
    import torch

    from eaglet.draft.methods.eagle3_checkpoint import save_draft
    from eaglet.draft.methods.eagle3_model import Eagle3Config, Eagle3Draft

    cfg = json.loads((fixture_model_dir / "config.json").read_text())
    torch.manual_seed(0)
    draft = Eagle3Draft(Eagle3Config(
        hidden_size=cfg["hidden_size"], intermediate_size=64,
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        vocab_size=cfg["vocab_size"], draft_vocab_size=cfg["vocab_size"],
        target_hidden_size=cfg["hidden_size"],
    ))  # fmt: skip
    draft.set_vocab(torch.zeros(cfg["vocab_size"], dtype=torch.int64),
                    torch.ones(cfg["vocab_size"], dtype=torch.bool))  # fmt: skip
    return save_draft(draft, folder, [2, 4, 5], "hf_hidden_states_index")


@pytest.mark.slow  # decodes with the fixture target
def test_tau_per_set_and_category_with_the_prompts_hash(tmp_path, fixture_model_dir):
    from eaglet.config import EvaluateConfig, TargetConfig
    from eaglet.draft.set_evaluation import evaluate_sets
    from eaglet.fixture.sample_data import gsm8k_rows, mt_bench_rows
    from eaglet.target import end_token_ids, load_tokenizer

    target = TargetConfig(model=str(fixture_model_dir))
    tokenizer = load_tokenizer(target)
    untrained_draft(tmp_path / "draft", fixture_model_dir)
    sets = [
        EvalSet(name="mt-bench", path=str(write(tmp_path, "mt-bench", mt_bench_rows(0, 2)))),
        EvalSet(name="gsm8k", path=str(write(tmp_path, "gsm8k", gsm8k_rows(0, 3)))),
    ]
    settings = EvaluateConfig(max_new_tokens=24, num_speculative_tokens=2)
    eos = end_token_ids(target, tokenizer)
    kwargs = {"enable_thinking": True}
    first = evaluate_sets(sets, tmp_path / "draft", target, tokenizer, settings, kwargs, eos)
    again = evaluate_sets(sets, tmp_path / "draft", target, tokenizer, settings, kwargs, eos)
    mt, gsm = first["mt-bench"], first["gsm8k"]
    assert mt["prompts"] == 2 and mt["turns"] == 2 and gsm["prompts"] == 3
    assert set(mt["categories"]) == {"math", "reasoning"} and "categories" not in gsm
    assert mt["rounds"] == sum(c["rounds"] for c in mt["categories"].values())
    assert 1.0 <= mt["tau"] <= 3.0 and mt["num_speculative_tokens"] == 2
    assert mt["thinking"] is True and mt["engine"].startswith("eaglet offline")
    assert mt["prompts_sha256"] == again["mt-bench"]["prompts_sha256"]  # the same prompts
    assert mt["prompts_sha256"] != gsm["prompts_sha256"]


@pytest.mark.slow  # decodes with the fixture target
def test_eaglet_eval_measures_a_published_format_draft_without_training(
    tmp_path, fixture_model_dir
):
    """A draft in speculators' layout (as a speculators user publishes one) and eaglet's own
    folder of the same weights give the same figures on the same prompts."""
    from eaglet.draft.methods.eagle3_exports import SPECULATORS_FOLDER, write_speculators_export
    from eaglet.fixture.sample_data import gsm8k_rows
    from tests.conftest import run_cli

    ours = untrained_draft(tmp_path / "draft", fixture_model_dir)
    published = write_speculators_export(
        ours, tmp_path / SPECULATORS_FOLDER, str(fixture_model_dir), ["Qwen3ForCausalLM"], 2
    )
    sets = f"evaluate.sets=[{{name: gsm8k, path: {write(tmp_path, 'gsm8k', gsm8k_rows(0, 3))}}}]"
    common = ["--set", f"target.model={fixture_model_dir}", "--set", sets,
              "--set", "evaluate.max_new_tokens=16", "--set", "evaluate.num_speculative_tokens=2",
              "--json"]  # fmt: skip
    figures = {}
    for name, folder in (("ours", ours), ("published", published)):
        result = run_cli(["eval", str(folder), *common], cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        figures[name] = json.loads(result.stdout[result.stdout.index("{") :])["sets"]["gsm8k"]
    assert figures["published"]["prompts_sha256"] == figures["ours"]["prompts_sha256"]
    assert figures["published"]["tau"] == figures["ours"]["tau"]
    assert figures["published"]["rounds"] == figures["ours"]["rounds"] > 0


def test_two_sets_of_one_name_are_refused(tmp_path):
    from eaglet.config import ConfigError

    path = write(tmp_path, "mt-bench", ROWS["mt-bench"])
    sets = f"evaluate.sets=[{{name: mt-bench, path: {path}}}, {{name: mt-bench, path: {path}}}]"
    with pytest.raises(ConfigError, match="names mt-bench more than once"):
        load_config(None, [sets])


def test_a_prompt_over_the_context_is_left_out_and_named_a_huge_one_before_tokenizing(
    tmp_path, fixture_model_dir
):
    """A 2 MB turn is over the hard bound before any tokenizing (it once kept `eaglet eval`
    busy for 300 s); a 5,000-token prompt over the 1,024-token context is counted by its
    tokens; the others are measured. The preflight says so too."""
    from eaglet.draft.set_evaluation import measurable
    from eaglet.eval_sets import EvalPrompt
    from eaglet.target import load_tokenizer

    config = load_config(None, [f"target.model={fixture_model_dir}"])
    tokenizer = load_tokenizer(config.target)
    huge = EvalPrompt("huge", ["9 " * 1_000_000])
    long = EvalPrompt("long", ["seven plus " * 1300])
    short = EvalPrompt("short", ["What is 2 plus 3?"])

    def counting(*args, **kwargs):
        counting.calls.append(len(str(args[0])))
        return original(*args, **kwargs)

    counting.calls, original = [], tokenizer.apply_chat_template
    tokenizer.apply_chat_template = counting
    kept, skipped = measurable([huge, long, short], tokenizer, {}, 1024, 128)
    assert kept == [short]
    assert [s["prompt_id"] for s in skipped] == ["huge", "long"]
    assert "characters" in skipped[0]["why"] and "prompt tokens" in skipped[1]["why"]
    assert len(counting.calls) == 2  # the huge one was never rendered nor tokenized

    rows = [{"question": "9 " * 1_000_000}, {"question": "What is 2 plus 3?"}]
    path = write(tmp_path, "gsm8k", rows)
    report = PreflightReport()
    config = load_config(None, [f"target.model={fixture_model_dir}",
                                f"evaluate.sets=[{{name: gsm8k, path: {path}}}]"])  # fmt: skip
    from eaglet.target import load_config as target_config

    check_eval_sets(config, report, target_config(config.target))
    assert (
        report.problems == []
        and "1 prompt(s) over the target's 1024-token context" in (report.warnings[0])
    )


@pytest.mark.slow  # a CLI subprocess for each refusal
def test_eaglet_eval_refuses_what_it_cannot_score_in_one_line(tmp_path, fixture_model_dir):
    """NaN in a draft's weights, weights cut short or of random bytes, the target's own folder
    given as the draft, and no --config outside the demo: each one `error:` line, exit 2,
    no traceback."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from tests.conftest import run_cli

    draft = untrained_draft(tmp_path / "draft", fixture_model_dir)
    sets = f"evaluate.sets=[{{name: gsm8k, path: {write(tmp_path, 'gsm8k', ROWS['gsm8k'])}}}]"
    common = ["--set", f"target.model={fixture_model_dir}", "--set", sets]

    def refused(folder, *args: str) -> str:
        result = run_cli(["eval", str(folder), *args], cwd=tmp_path)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stderr and result.stderr.startswith("error: ")
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        return result.stderr

    nan = tmp_path / "nan"
    shutil.copytree(draft, nan)
    tensors = load_file(str(nan / "model.safetensors"))
    tensors["fc.weight"][0, 0] = float("nan")
    save_file(tensors, str(nan / "model.safetensors"))
    assert "fc.weight holds 1 NaN or infinite" in refused(nan, *common)

    cut = tmp_path / "cut"
    shutil.copytree(draft, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "cut short" in refused(cut, *common)

    noise = tmp_path / "noise"
    shutil.copytree(draft, noise)
    (noise / "model.safetensors").write_bytes(
        torch.randint(0, 256, (4096,)).byte().numpy().tobytes()
    )
    assert "model.safetensors" in refused(noise, *common)

    assert "is not a draft" in refused(fixture_model_dir, *common)
    assert "no --config" in refused(draft)  # tmp_path holds no demo


@pytest.mark.slow  # decodes with the fixture target
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_eaglet_eval_reads_a_block_drafters_speculators_layout(method, tmp_path, fixture_model_dir):
    """A DFlash or DSpark draft's speculators layout (speculators 0.9.0's `dflash`, `dspark`;
    no eaglet label in it) and its vLLM export give the same figures in `eaglet eval`."""
    from eaglet.config import TargetConfig, load_config
    from eaglet.draft.methods import draft_method
    from eaglet.draft.target_head import load_target_head
    from eaglet.fixture.sample_data import gsm8k_rows
    from tests.conftest import run_cli

    target = TargetConfig(model=str(fixture_model_dir))
    block = {"dflash": 3, "dspark": 2}[method]  # two drafts a round either way
    train = load_config(None, [f"train.method={method}", f"train.{method}.block_size={block}"])
    chosen = draft_method(method)
    draft = chosen.build(load_target_head(target), train.train, None, [2, 4, 5])
    chosen.save(draft, tmp_path / "draft", [2, 4, 5], "hf_hidden_states_index")
    exports = chosen.exports(tmp_path / "draft", target, 2)
    sets = f"evaluate.sets=[{{name: gsm8k, path: {write(tmp_path, 'gsm8k', gsm8k_rows(0, 3))}}}]"
    common = ["--set", f"target.model={fixture_model_dir}", "--set", sets,
              "--set", "evaluate.max_new_tokens=16", "--set", "evaluate.num_speculative_tokens=2",
              "--json"]  # fmt: skip
    figures = {}
    for engine, folder in exports.items():
        result = run_cli(["eval", str(tmp_path / folder), *common], cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        figures[engine] = json.loads(result.stdout[result.stdout.index("{") :])["sets"]["gsm8k"]
    assert figures["speculators"]["method"] == figures["vllm"]["method"] == method
    assert figures["speculators"]["prompts_sha256"] == figures["vllm"]["prompts_sha256"]
    assert figures["speculators"]["tau"] == figures["vllm"]["tau"]
    assert figures["speculators"]["rounds"] == figures["vllm"]["rounds"] > 0
    assert (
        figures["speculators"]["per_position_acceptance"]
        == figures["vllm"]["per_position_acceptance"]
    )
