"""The tiny training world of the trainer's tests (tests/test_train_eval.py and the modules that
train or evaluate a draft on it): a random `Qwen3ForCausalLM` whose embeddings dominate its
residual stream and whose lm_head maps token v's embedding to the row of perm[v], so its greedy
continuation follows a fixed permutation and a draft learns it in seconds; random prompts, the
target's greedy answers as extract-stage records, and their hidden-state shards written by the
pipeline's own `extract_hidden_states`. Its fixtures (`one_thread`, `world`, `trained`) are in
tests/conftest.py.
"""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from eaglet.config import HiddenStatesConfig, PipelineConfig, TargetConfig, TrainConfig
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION
from eaglet.hidden_states.stage import stage_body
from eaglet.records.examples import Example
from eaglet.records.io import write_jsonl

HIDDEN, VOCAB, LAYERS, PROMPT_LEN, ANSWER_LEN = 64, 300, 6, 12, 40
AUX_IDS = [1, 3, 5]  # HF hidden_states indices (vLLM convention)
CONVENTION = AUX_LAYER_CONVENTION  # what the pipeline writes


def make_target(path, seed: int = 0) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)  # std 1: dominates the 0.02-init layers
    perm = torch.randperm(VOCAB, generator=g)
    lm_head = torch.zeros(VOCAB, HIDDEN)
    lm_head[perm] = embed / HIDDEN**0.5  # token v -> greedy perm[v], margin ~ sqrt(HIDDEN)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm_head)
    model.save_pretrained(path)
    return model


def random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n, PROMPT_LEN), generator=g).tolist()


@torch.no_grad()
def greedy_examples(model, prompts, answer_len) -> list[Example]:
    """The target's greedy answers to `prompts` as extract-stage records (answer = model output)."""
    sequences = model.generate(
        torch.tensor(prompts), do_sample=False, max_new_tokens=answer_len, min_new_tokens=answer_len
    )
    return [
        Example(
            sample_id=f"s{row}",
            source="random",
            reasoning="",
            content="",
            input_ids=seq.tolist(),
            loss_mask=[0] * len(prompt) + [1] * (len(seq) - len(prompt)),
            finish_reason="length",
        )
        for row, (prompt, seq) in enumerate(zip(prompts, sequences, strict=True))
    ]


def write_hidden_state_shards(target_dir, out_dir, examples, aux_ids) -> dict:
    """Shards + index.jsonl written by the pipeline's own hidden_states stage body (hf backend,
    float32 storage), from an examples.jsonl as the extract stage writes it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    examples_path = out_dir.parent / f"{out_dir.name}-examples.jsonl"
    write_jsonl(examples_path, examples)
    config = PipelineConfig(
        work_dir=str(out_dir.parent),
        target=TargetConfig(model=str(target_dir), device="cpu"),
        hidden_states=HiddenStatesConfig(
            aux_layer_ids=aux_ids, shard_tokens=16 * 52, storage="float32"
        ),
    )
    return stage_body(config, examples_path, report=lambda line: None)(out_dir).info


def make_world(root, prompts: int):
    """The training world under `root`: the tiny target in `root / "target"` and the
    hidden-state shards of its greedy answers to `prompts` random prompts in `root / "hs"`;
    returns the examples."""
    model = make_target(root / "target")
    examples = greedy_examples(model, random_prompts(prompts, seed=1), ANSWER_LEN)
    write_hidden_state_shards(root / "target", root / "hs", examples, AUX_IDS)
    return examples


def settings(**overrides) -> TrainConfig:
    kw = dict(
        epochs=20,
        lr=1e-2,
        batch_size=8,
        draft_vocab_size=256,
        warmup_steps=5,
        log_every=5,
        intermediate_size=128,
        seed=0,
    )
    return TrainConfig(**(kw | overrides))
