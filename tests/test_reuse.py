"""Per-sample reuse across keys (`eaglet.reuse`): a stage that runs again because some of what
it reads changed computes only those samples. hidden_states recomputes the features of the
changed examples only, the rest copied bit for bit and the whole equal to a full recompute;
generate sends a real vLLM server only the prompts that changed (its request counter says so).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from safetensors import safe_open

from eaglet.cache import stage_key
from eaglet.config import load_config
from eaglet.hidden_states.backends.hf import HFBackend
from eaglet.records.examples import Example
from eaglet.stage_bodies.every_stage import run_stage_without_prefect
from eaglet.stage_context import PlainContext
from eaglet.stage_reasons import REUSE_ESTIMATES
from eaglet.stages import EXAMPLES_FILE
from eaglet.storage import StageOutput, run_stage


def examples(n: int, changed: set[int] = frozenset()) -> list[Example]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        ids = [rng.randrange(10, 400) for _ in range(rng.randrange(12, 40))]
        if i in changed:
            ids[3] = (ids[3] + 1) % 400  # a fix that changed this example's tokens
        out.append(
            Example(
                sample_id=f"s{i:02d}",
                source="t",
                reasoning="",
                content="",
                input_ids=ids,
                loss_mask=[0] * 4 + [1] * (len(ids) - 4),
                finish_reason="stop",
            )  # fmt: skip
        )
    return out


def extract_folder(work_dir: Path, rows: list[Example], key: str):
    def body(folder: Path) -> StageOutput:
        text = "".join(e.model_dump_json() + "\n" for e in rows)
        (folder / EXAMPLES_FILE).write_text(text)
        return StageOutput(counts={"records": len(rows)}, info={})

    return run_stage(
        work_dir=work_dir, stage="extract", key=key, code_hash="c", config={}, upstream=[],
        body=body, records_file=EXAMPLES_FILE,
    )  # fmt: skip


def stored(folder: Path) -> dict[str, dict[str, bytes]]:
    """Every sample's stored tensors (storage form) as raw bytes, by sample id."""
    out = {}
    for line in (folder / "index.jsonl").read_text().splitlines():
        row = json.loads(line)
        with safe_open(str(folder / row["shard"]), framework="pt") as handle:
            start, end = row["offset"], row["offset"] + row["length"]
            out[row["sample_id"]] = {
                key: handle.get_slice(key)[start:end].numpy().tobytes() for key in handle.keys()
            }
    return out


def test_a_fix_that_changes_k_examples_recomputes_the_features_of_those_k_only(
    tmp_path, fixture_model_dir, monkeypatch
):
    computed: list[str] = []
    original = HFBackend.features

    def counting(self, rows, on_tokens=None):
        computed.extend(e.sample_id for e in rows)
        return original(self, rows, on_tokens=on_tokens)

    monkeypatch.setattr(HFBackend, "features", counting)
    overrides = [f"target.model={fixture_model_dir}", "hidden_states.shard_tokens=256"]
    config = load_config(None, [f"work_dir={tmp_path / 'work'}", *overrides])
    before = extract_folder(tmp_path / "work", examples(12), "e1")
    first = run_stage_without_prefect("hidden_states", config, {"examples": before}, PlainContext())
    assert len(computed) == 12 and first.info["reused_samples"] == 0

    computed.clear()
    changed = {2, 7, 11}
    after = extract_folder(tmp_path / "work", examples(12, changed), "e2")
    key = stage_key("hidden_states", config, [after])  # what --plan reads before it runs
    folder = tmp_path / "work" / "hidden_states" / key
    estimate = REUSE_ESTIMATES["hidden_states"](config, tmp_path / "work" / after.path, folder)
    assert estimate == (9, 3)
    lines: list[str] = []
    second = run_stage_without_prefect(
        "hidden_states", config, {"examples": after}, PlainContext(lines.append)
    )
    assert second.key != first.key
    assert sorted(computed) == ["s02", "s07", "s11"]
    assert (second.info["reused_samples"], second.info["computed_samples"]) == (9, 3)
    assert any("9 samples' features reused from" in line for line in lines), lines

    # A full recompute of the same examples in a fresh work dir stores the same bytes.
    fresh = load_config(None, [f"work_dir={tmp_path / 'fresh'}", *overrides])
    whole = extract_folder(tmp_path / "fresh", examples(12, changed), "e2")
    full = run_stage_without_prefect("hidden_states", fresh, {"examples": whole}, PlainContext())
    assert stored(tmp_path / "work" / second.path) == stored(tmp_path / "fresh" / full.path)
    assert second.files == full.files  # every shard byte-equal: later stages stay Cached
    assert second.output_hash() == full.output_hash()


def test_other_layers_reuse_nothing(tmp_path, fixture_model_dir):
    overrides = [f"work_dir={tmp_path / 'work'}", f"target.model={fixture_model_dir}"]
    config = load_config(None, overrides)
    rows = extract_folder(tmp_path / "work", examples(4), "e1")
    run_stage_without_prefect("hidden_states", config, {"examples": rows}, PlainContext())
    other = load_config(None, [*overrides, "hidden_states.aux_layer_ids=[0, 1, 2]"])
    again = run_stage_without_prefect("hidden_states", other, {"examples": rows}, PlainContext())
    assert again.info["reused_samples"] == 0 and again.info["computed_samples"] == 4


# --- generate against a real vLLM server ---------------------------------------------------------


def requests_served(url: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_a_change_to_one_sources_prompts_regenerates_only_that_source(tmp_path, fixture_model_dir):
    from tests.vllm_server import vllm_python, vllm_server

    if vllm_python() is None:
        pytest.skip("no vLLM venv (make vllm-venv)")
    rows = {
        "a": [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(6)],
        "b": [{"messages": [{"role": "user", "content": f"What is {i} * 3?"}]} for i in range(4)],
    }
    for source, items in rows.items():
        (tmp_path / f"{source}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    with vllm_server(fixture_model_dir, tmp_path / "vllm.log") as url:
        config = load_config(
            None,
            [
                f"work_dir={tmp_path / 'work'}",
                f"target.model={fixture_model_dir}",
                f"datasets=[{{source: a, path: {tmp_path / 'a.jsonl'}}}, "
                f"{{source: b, path: {tmp_path / 'b.jsonl'}}}]",
                "generation.engine=vllm",
                f"generation.endpoints=[{url}]",
                "generation.served_model=tiny",
                "generation.max_tokens=160",
                "generation.canary_requests=1",
            ],
        )

        def generate() -> tuple[object, float]:
            outputs = {}
            sent = requests_served(url)
            for stage, output in (("download", "samples"), ("tokenize", "prompts")):
                inputs = {"samples": outputs["samples"]} if stage == "tokenize" else {}
                outputs[output] = run_stage_without_prefect(stage, config, inputs, PlainContext())
            manifest = run_stage_without_prefect(
                "generate", config, {"prompts": outputs["prompts"]}, PlainContext()
            )
            return manifest, requests_served(url) - sent

        first, sent_first = generate()
        assert sent_first >= 10
        # a fix confined to source b: its prompts change, a's stay token for token
        fixed = [{"messages": [{"role": "system", "content": "Be brief."}, *r["messages"]]}
                 for r in rows["b"]]  # fmt: skip
        (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fixed))
        second, sent_second = generate()
    assert second.key != first.key
    # the canary's one request, then b's 4 prompts: none of a's 6
    assert sent_second == 1 + 4, f"the server answered {sent_second} requests, not 1 + b's 4"
    assert second.info["reused"] == 6 and second.counts["records"] == 10
    old_lines = (tmp_path / "work" / first.path / "generations.jsonl").read_text().splitlines()
    old = {json.loads(x)["sample_id"]: x for x in old_lines}
    new = (tmp_path / "work" / second.path / "generations.jsonl").read_text().splitlines()
    kept = [x for x in new if json.loads(x)["source"] == "a"]
    assert len(kept) == 6 and all(old[json.loads(x)["sample_id"]] == x for x in kept)
