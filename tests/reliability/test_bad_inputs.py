"""The bad-input matrix: what a new user feeds eaglet by mistake, and what eaglet must do.

Each case is either a clear error that names the file and line (or the key, or the sample id)
and says what to do, or a skip that is counted in the manifest and listed with its reason in
`rejected.jsonl`. None may lose a record silently or end in a raw traceback. The table in
tests/reliability/README.md ("Bad inputs") lists every case with its test here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaglet.config import ConfigError, DatasetSpec, TokenizeConfig, load_config
from eaglet.datasets import DatasetError, RowSkipped, normalise_row, read_samples, write_samples
from eaglet.prompt_rendering import write_prompts
from eaglet.records.io import RecordFileError, read_jsonl, repair_and_read_ids, write_jsonl
from eaglet.records.samples import Sample

USER = {"role": "user", "content": "What is 2 + 2?"}
ANSWER = {"role": "assistant", "content": "4"}
GOOD = {"messages": [USER, ANSWER]}


def jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def samples(path: Path, source: str = "s") -> list[Sample]:
    return list(read_samples(DatasetSpec(source=source, path=str(path))))


def download(tmp_path: Path, *specs: DatasetSpec) -> tuple[dict, list[dict], list[Sample]]:
    """The download stage's body: (counts, rejected.jsonl entries, samples written)."""
    out, rejected = tmp_path / "samples.jsonl", tmp_path / "rejected.jsonl"
    counts, _ = write_samples(specs, out, rejected)
    entries = [json.loads(line) for line in rejected.read_text().splitlines()]
    return counts, entries, list(read_jsonl(out, Sample))


def spec(path: Path, source: str = "s") -> DatasetSpec:
    return DatasetSpec(source=source, path=str(path))


# --- whole files: a clear error naming the file (and line) -------------------------------------


def test_malformed_json_line_names_file_line_and_column(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + '{"messages": [\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: not valid JSON \(.* at column \d+\)"):
        samples(path)


def test_malformed_json_file_names_file_and_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text("[\n" + json.dumps(GOOD) + ",\n{oops}\n]")
    with pytest.raises(DatasetError, match=r"d\.json:3: not valid JSON"):
        samples(path)


@pytest.mark.parametrize(
    ("name", "content"), [("e.jsonl", ""), ("w.jsonl", "\n  \n"), ("e.json", "[]"), ("z.json", "")]
)
def test_empty_dataset_file_is_an_error_naming_it(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DatasetError, match=rf"{name}: the dataset has no rows \(source 's'\)"):
        samples(path)


def test_invalid_utf8_in_jsonl_names_file_line_and_byte(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"messages": "\xff"}\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: not valid UTF-8 \(byte 0xff at column"):
        samples(path)


def test_invalid_utf8_in_json_names_file_and_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_bytes(b"[\n" + json.dumps(GOOD).encode() + b',\n{"x": "\xc3\x28"}\n]')
    with pytest.raises(DatasetError, match=r"d\.json:3: not valid UTF-8"):
        samples(path)


@pytest.mark.parametrize("name", ["d.csv", "d.txt", "d.tsv"])
def test_unsupported_file_type_is_named_even_when_absent(tmp_path, name):
    # Absent, a .csv used to be taken for a hub dataset id and failed with a hub error.
    with pytest.raises(DatasetError, match=rf"{name}: unsupported file type"):
        samples(tmp_path / name)
    (tmp_path / name).write_text("a,b\n1,2\n")
    with pytest.raises(DatasetError, match=rf"{name}: unsupported file type"):
        samples(tmp_path / name)


def test_parquet_with_unexpected_columns_names_file_and_columns(tmp_path):
    path = tmp_path / "p.parquet"
    pd.DataFrame({"prompt": ["hi"], "response": ["hello"]}).to_parquet(path)
    with pytest.raises(DatasetError, match=r"p\.parquet: Parquet columns \['prompt', 'response'\]"):
        samples(path)


def test_file_that_is_not_parquet_names_the_file(tmp_path):
    path = tmp_path / "p.parquet"
    path.write_text("not parquet at all")
    with pytest.raises(DatasetError, match=r"p\.parquet: cannot read as Parquet"):
        samples(path)


def test_dataset_path_that_is_a_folder_is_named(tmp_path):
    folder = tmp_path / "data.jsonl"
    folder.mkdir()
    with pytest.raises(DatasetError, match=r"data\.jsonl is a folder"):
        samples(folder)


def test_unknown_openai_role_names_line_message_and_role(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [GOOD, {"messages": [{"role": "narrator", "content": "x"}]}])
    expected = r"d\.jsonl:2 message 0: unknown message role 'narrator'"
    with pytest.raises(DatasetError, match=expected):
        samples(path)


def test_unknown_sharegpt_speaker_names_line_turn_and_speaker(tmp_path):
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]}
    path = jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DatasetError, match=r"d\.jsonl:1 turn 1: unknown ShareGPT speaker 'robot'"):
        samples(path)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ([USER], r"d\.jsonl:1: a row must be a JSON object, got list"),
        ({"messages": "hi"}, r"d\.jsonl:1: 'messages' is not a list"),
        ({"messages": ["hi"]}, r"d\.jsonl:1 message 0: a message must be an object"),
        ({"prompt": "hi"}, r"d\.jsonl:1: row has neither .* its keys are \['prompt'\]"),
        ({"messages": [USER], "tools": {"a": 1}}, r"d\.jsonl:1: 'tools' must be a list"),
    ],
)
def test_rows_of_an_unknown_shape_name_file_and_line(tmp_path, row, message):
    with pytest.raises(DatasetError, match=message):
        samples(jsonl(tmp_path / "d.jsonl", [row]))


def test_a_file_whose_every_row_is_skipped_is_an_error(tmp_path):
    only_answers = {"messages": [ANSWER]}
    path = jsonl(tmp_path / "d.jsonl", [only_answers, only_answers])
    with pytest.raises(DatasetError, match=r"d\.jsonl: every one of its 2 rows was skipped"):
        samples(path)


# --- rows: a counted skip, listed with its reason in rejected.jsonl ----------------------------


def test_row_without_a_user_turn_is_skipped_counted_and_listed(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [GOOD, {"messages": [{"role": "system", "content": "x"}]}])
    counts, rejected, written = download(tmp_path, spec(path))
    assert counts["records"] == 1 and counts["skipped"] == counts["skipped_no_user_turn"] == 1
    [entry] = rejected
    assert entry["kind"] == "no_user_turn" and entry["where"].endswith("d.jsonl:2")
    assert entry["source"] == "s" and "no user message" in entry["why"]


def test_a_lone_surrogate_skips_the_row_naming_line_and_message(tmp_path):
    path = tmp_path / "d.jsonl"
    broken = '{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}'
    path.write_text(json.dumps(GOOD) + "\n" + broken + "\n")
    counts, rejected, written = download(tmp_path, spec(path))
    assert counts["records"] == 1 and counts["skipped_lone_surrogate"] == 1
    [entry] = rejected
    assert entry["where"].endswith("d.jsonl:2 message 0") and "U+D800" in entry["why"]
    assert [s.messages[0]["content"] for s in written] == [USER["content"]]


def test_text_parts_of_a_list_content_are_kept_and_the_image_counted(tmp_path):
    parts = [
        {"type": "text", "text": "Describe"},
        {"type": "image_url", "image_url": {"url": "x.png"}},
        {"type": "text", "text": "briefly."},
    ]
    path = jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": parts}]}])
    counts, rejected, [sample] = download(tmp_path, spec(path))
    # Before: the list rendered as an empty user turn, answered and trained on.
    assert sample.messages[0]["content"] == "Describe\nbriefly."
    assert counts["non_text_parts_dropped"] == 1 and rejected == []


def test_a_turn_of_only_an_image_skips_the_row(tmp_path):
    image_only = [{"type": "image_url", "image_url": {"url": "x.png"}}]
    rows = [GOOD, {"messages": [{"role": "user", "content": image_only}, ANSWER]}]
    counts, [entry], written = download(tmp_path, spec(jsonl(tmp_path / "d.jsonl", rows)))
    assert len(written) == 1 and counts["skipped_non_text_content"] == 1
    assert entry["kind"] == "non_text_content" and "image_url" in entry["why"]
    assert entry["where"].endswith("d.jsonl:2 message 0")


def test_a_number_as_content_becomes_its_text_and_is_counted(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": 42}, {"from": "gpt", "value": 1.5}]}]
    counts, rejected, [sample] = download(tmp_path, spec(jsonl(tmp_path / "d.jsonl", rows)))
    assert [m["content"] for m in sample.messages] == ["42", "1.5"]
    assert counts["number_content"] == 2 and rejected == []


@pytest.mark.parametrize(
    "content", [{"text": "hi"}, True, [{"type": "text", "text": 7}]], ids=["dict", "bool", "part"]
)
def test_content_that_is_no_text_skips_the_row(tmp_path, content):
    rows = [GOOD, {"messages": [{"role": "user", "content": content}]}]
    counts, [entry], written = download(tmp_path, spec(jsonl(tmp_path / "d.jsonl", rows)))
    assert len(written) == 1 and entry["kind"] == "content_type"


def test_tool_call_arguments_that_are_not_json_skip_the_row_and_are_counted(tmp_path):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{city: Oslo"}}
    bad = {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [call]}]}
    counts, [entry], written = download(tmp_path, spec(jsonl(tmp_path / "d.jsonl", [GOOD, bad])))
    # Before: the broken string went into the prompt, uncounted.
    assert len(written) == 1 and counts["skipped_tool_arguments"] == 1
    assert "'get_weather'" in entry["why"] and "{city: Oslo" in entry["why"]


def test_duplicate_rows_are_written_once_counted_and_listed_with_their_id(tmp_path):
    first = jsonl(tmp_path / "a.jsonl", [GOOD, GOOD])
    counts, rejected, written = download(tmp_path, spec(first))
    assert len(written) == 1 and counts["duplicates"] == 1
    assert rejected[0]["kind"] == "duplicate" and rejected[0]["sample_id"] == written[0].sample_id
    assert rejected[0]["where"].endswith("a.jsonl:2")


# --- prompts: longer than the context, over the limit, not templatable -------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from eaglet.fixture.tokenizer import build_tokenizer

    return build_tokenizer(seed=0)


def tokenize(tmp_path: Path, tokenizer, rows: list[Sample], context: int | None, **settings):
    source = tmp_path / "samples.jsonl"
    write_jsonl(source, rows)
    config = TokenizeConfig(**settings)
    counts, warning = write_prompts(source, tmp_path, tokenizer, config, context)
    rejected = [json.loads(line) for line in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    kept = [json.loads(line)["sample_id"] for line in (tmp_path / "prompts.jsonl").open()]
    return counts, warning, rejected, kept


def sample(sample_id: str, words: int, first: str = "user") -> Sample:
    text = " ".join(["two plus two"] * words)
    return Sample(sample_id=sample_id, source="s", messages=[{"role": first, "content": text}])


def test_a_prompt_longer_than_the_models_context_is_skipped_never_generated(tmp_path, tokenizer):
    rows = [sample("short", 1), sample("long", 200)]
    counts, warning, [entry], kept = tokenize(tmp_path, tokenizer, rows, context=64)
    assert kept == ["short"] and counts["over_context"] == 1
    assert entry["sample_id"] == "long" and entry["kind"] == "over_context"
    assert "model's context is 64 (max_position_embeddings)" in entry["why"]
    assert "longer than the model's context (64 tokens)" in warning


def test_a_prompt_over_max_prompt_tokens_is_skipped_with_its_length(tmp_path, tokenizer):
    rows = [sample("short", 1), sample("long", 40)]
    counts, _, [entry], kept = tokenize(tmp_path, tokenizer, rows, None, max_prompt_tokens=32)
    assert kept == ["short"] and counts["too_long"] == 1
    assert "over tokenize.max_prompt_tokens=32" in entry["why"]


def test_a_20_mb_message_is_rejected_without_tokenizing_naming_the_finished_folder(
    tmp_path, tokenizer, monkeypatch
):
    import eaglet.prompt_rendering

    huge = Sample(
        sample_id="huge", source="s", messages=[{"role": "user", "content": "x" * 20_000_000}]
    )
    rendered = []
    original = eaglet.prompt_rendering.render_prompt
    monkeypatch.setattr(
        eaglet.prompt_rendering,
        "render_prompt",
        lambda s, *a: rendered.append(s.sample_id) or original(s, *a),
    )
    partial = tmp_path / "k1.partial"
    partial.mkdir()
    source = tmp_path / "samples.jsonl"
    write_jsonl(source, [sample("short", 1), huge])
    counts, warning = write_prompts(source, partial, tokenizer, TokenizeConfig(), None)
    assert rendered == ["short"] and counts["too_long"] == 1  # the huge one never tokenized
    [entry] = [json.loads(line) for line in (partial / "rejected.jsonl").read_text().splitlines()]
    assert entry["sample_id"] == "huge" and "20000000 characters" in entry["why"]
    assert "over tokenize.max_prompt_tokens=768" in entry["why"]
    assert str(tmp_path / "k1" / "rejected.jsonl") in warning and ".partial" not in warning


def test_a_sample_that_cannot_be_templated_is_rejected_with_its_id(tmp_path, tokenizer):
    counts, _, [entry], kept = tokenize(tmp_path, tokenizer, [sample("sys", 1, "system")], None)
    assert kept == [] and counts["rejected"] == 1 and entry["kind"] == "template"
    assert "sample sys (s)" in entry["why"]


# --- record files ------------------------------------------------------------------------------


def test_a_bad_record_line_names_file_line_and_sample(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"sample_id": "a1", "source": "s"}\n')
    with pytest.raises(RecordFileError, match=r"samples\.jsonl:1: sample a1 is not a valid Sample"):
        list(read_jsonl(path, Sample))


def test_a_bad_middle_line_of_an_append_only_file_is_set_aside_not_dropped(tmp_path):
    path = tmp_path / "generations.jsonl"
    path.write_text('{"sample_id": "a"}\nnot json\n{"sample_id": "b"}\n{"sample_id": "c"')
    assert repair_and_read_ids(path) == {"a", "b"}  # b, after the bad line, is kept
    assert path.read_text() == '{"sample_id": "a"}\n{"sample_id": "b"}\n'
    [aside] = [json.loads(x) for x in (tmp_path / "generations.rejected-lines.jsonl").open()]
    assert aside["line"] == 2 and aside["text"] == "not json"


# --- fuzzing the row parsers -------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
ROLE = st.sampled_from(["user", "assistant", "system", "tool", "developer", "narrator", None])
MESSAGE = st.fixed_dictionaries(
    {"role": ROLE, "content": JSON},
    optional={"tool_calls": JSON, "reasoning": JSON, "name": JSON},
)
ROW = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4)}, optional={"tools": JSON}),
    st.fixed_dictionaries(
        {
            "conversations": st.lists(
                st.fixed_dictionaries(
                    {"from": st.sampled_from(["human", "gpt", "system", "x"]), "value": JSON}
                ),
                max_size=4,
            )
        }
    ),
    st.dictionaries(st.text(max_size=8), JSON, max_size=3),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row=ROW)
def test_row_parser_fuzz_gives_text_messages_or_a_dataset_error(row):
    """Whatever a row holds, normalise_row returns messages whose content is text (so the
    chat template never sees a list, a number or None), or raises a DatasetError (RowSkipped
    included) with a message naming the row; never another exception."""
    try:
        messages, tools = normalise_row(json.loads(json.dumps(row)), "f.jsonl:1")
    except RowSkipped as exc:
        assert str(exc).startswith("f.jsonl:1") and exc.kind
        return
    except DatasetError as exc:
        assert str(exc).startswith("f.jsonl:1")
        return
    assert any(m["role"] == "user" for m in messages)
    assert all(isinstance(m["content"], str) for m in messages)
    assert tools is None or isinstance(tools, list)


# --- config and command line: a ConfigError naming the override, never a traceback ------------


@pytest.mark.parametrize(
    "override",
    [
        "datasets.9.limit=3",  # index out of range
        "datasets.first.limit=3",  # not an index
        "generation.stop=[unclosed",  # not YAML
        "generation.max_tokens",  # no value
        "generation.max_tokens=-5",  # out of bounds
        "generation.max_tokn=5",  # unknown key
    ],
)
def test_bad_set_value_exits_2_naming_it_without_traceback(override, tmp_path, capsys):
    from eaglet_prefect.flows.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(f"work_dir: {tmp_path / 'work'}\n")
    code = main(["run", str(config), "--set", override])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "error:" in err and override.split("=")[0] in err
    # Nothing ran, so nothing claims finished stages were kept.
    assert "finished stages are kept" not in err


def test_config_file_that_is_not_yaml_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"run\.yaml: not valid YAML"):
        load_config(path)


def test_config_file_that_is_a_list_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"run\.yaml: the top level must be a mapping"):
        load_config(path)


def test_a_source_tag_with_dotdot_cannot_name_a_path(tmp_path):
    with pytest.raises(ConfigError, match=r"datasets\.0\.source"):
        load_config(None, [f"datasets=[{{source: ../../etc, path: {tmp_path / 'a.jsonl'}}}]"])


# --- state on disk: manifests that are not JSON, edited, or folders that lost files ------------


def finished_stage(work_dir: Path, stage: str = "generate", key: str = "k1") -> Path:
    from eaglet.storage import StageOutput, run_stage

    def body(folder: Path) -> StageOutput:
        (folder / "generations.jsonl").write_text('{"sample_id": "a"}\n{"sample_id": "b"}\n')
        (folder / "shard-000.bin").write_bytes(b"\0" * 64)
        return StageOutput(counts={"records": 2}, info={})

    run_stage(
        work_dir=work_dir,
        stage=stage,
        key=key,
        code_hash="c",
        config={},
        upstream=[],
        body=body,
    )
    return work_dir / stage / key


def rerun(work_dir: Path, stage: str = "generate", key: str = "k1"):
    from eaglet.storage import StageOutput, run_stage

    return run_stage(
        work_dir=work_dir,
        stage=stage,
        key=key,
        code_hash="c",
        config={},
        upstream=[],
        body=lambda folder: StageOutput(counts={}, info={}),
    )


def test_a_manifest_that_is_not_json_is_an_error_naming_its_path_and_stage(tmp_path):
    from eaglet.errors import is_transient
    from eaglet.storage import ManifestError

    folder = finished_stage(tmp_path)
    (folder / "manifest.json").write_text('{"stage": "generate", "key": ')
    with pytest.raises(ManifestError, match=r"k1/manifest\.json: not valid JSON") as raised:
        rerun(tmp_path)
    assert "--refresh-from generate" in str(raised.value)
    assert not is_transient(raised.value)  # never retried


def test_a_hand_edited_manifest_is_detected(tmp_path):
    from eaglet.storage import ManifestError

    folder = finished_stage(tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["counts"]["records"] = 2000
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="edited since the stage wrote it"):
        rerun(tmp_path)


def test_a_deleted_shard_of_a_cached_stage_names_the_file_and_stage(tmp_path):
    from eaglet.storage import StageCorruptError, reusable_stage

    folder = finished_stage(tmp_path)
    (folder / "shard-000.bin").unlink()
    assert not reusable_stage(tmp_path, "generate", "k1")  # Prefect's cache record is dropped
    with pytest.raises(StageCorruptError, match=r"shard-000\.bin: missing \(the manifest lists 64"):
        rerun(tmp_path)


def test_a_cut_line_in_a_finished_generations_file_names_sizes_and_stage(tmp_path):
    from eaglet.storage import StageCorruptError

    folder = finished_stage(tmp_path)
    path = folder / "generations.jsonl"
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(StageCorruptError) as raised:
        rerun(tmp_path)
    message = str(raised.value)
    assert "generations.jsonl: 33 bytes, the manifest says 38" in message
    assert "--refresh-from generate" in message


def test_same_size_other_content_is_found_by_its_sha256(tmp_path, monkeypatch):
    from eaglet.storage import StageCorruptError

    folder = finished_stage(tmp_path)
    (folder / "shard-000.bin").write_bytes(b"\1" * 64)
    with pytest.raises(StageCorruptError, match=r"shard-000\.bin: sha256 [0-9a-f]{64}, the "):
        rerun(tmp_path)
    monkeypatch.setenv("EAGLET_VERIFY", "size")  # sizes only: the cheap check passes
    assert rerun(tmp_path).counts == {"records": 2}


def test_inspect_shows_corrupt_stages_and_an_absolute_path(tmp_path, capsys):
    from eaglet_prefect.flows.cli import main

    work_dir = tmp_path / "work"
    finished_stage(work_dir, "download", "d1")
    finished_stage(work_dir, "tokenize", "t1")
    gen = finished_stage(work_dir, "generate", "g1")
    (work_dir / "tokenize" / "t1" / "manifest.json").write_text("{not json")
    (gen / "generations.jsonl").write_text("")
    assert main(["inspect", str(work_dir), "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert stages["download"]["status"] == "complete"
    assert stages["download"]["path"] == str((work_dir / "download" / "d1").resolve())
    assert stages["tokenize"]["status"] == "corrupt"
    assert "manifest.json: not valid JSON" in stages["tokenize"]["problems"][0]
    assert stages["generate"]["status"] == "corrupt"
    assert main(["inspect", str(work_dir)]) == 0
    out = capsys.readouterr().out
    assert "--refresh-from generate" in out and "--refresh-from tokenize" in out


def test_inspect_verify_hashes_what_sizes_cannot_see(tmp_path, capsys):
    from eaglet_prefect.flows.cli import main

    work_dir = tmp_path / "work"
    folder = finished_stage(work_dir, "download", "d1")
    (folder / "shard-000.bin").write_bytes(b"\1" * 64)
    main(["inspect", str(work_dir), "--json"])
    assert json.loads(capsys.readouterr().out)["stages"]["download"]["status"] == "complete"
    main(["inspect", str(work_dir), "--json", "--verify"])
    assert json.loads(capsys.readouterr().out)["stages"]["download"]["status"] == "corrupt"


def test_inspect_refuses_a_folder_that_is_not_a_work_dir_and_an_empty_sample(tmp_path, capsys):
    from eaglet_prefect.flows.cli import main

    (tmp_path / "notes.txt").write_text("not a work dir")
    assert main(["inspect", str(tmp_path)]) == 2
    assert "is not an eaglet work dir" in capsys.readouterr().err
    work_dir = tmp_path / "work"
    finished_stage(work_dir, "extract", "e1")
    assert main(["inspect", str(work_dir), "--sample", ""]) == 2
    assert "--sample needs a sample id" in capsys.readouterr().err


def test_inspect_shows_the_folder_the_run_used_not_a_newer_stray_partial(tmp_path, capsys):
    from eaglet_prefect.flows.cli import main

    work_dir = tmp_path / "work"
    finished_stage(work_dir, "generate", "g1")
    (work_dir / "run.json").write_text(json.dumps({"stages": {"generate": {"key": "g1"}}}))
    (work_dir / "generate" / "g2.partial").mkdir()  # newer, left by some other try
    main(["inspect", str(work_dir), "--json"])
    generate = json.loads(capsys.readouterr().out)["stages"]["generate"]
    assert generate["status"] == "complete" and generate["key"] == "g1"
    # A run interrupted inside the stage names the partial's key: then it shows partial.
    (work_dir / "run.json").write_text(json.dumps({"stages": {"generate": {"key": "g2"}}}))
    main(["inspect", str(work_dir), "--json"])
    generate = json.loads(capsys.readouterr().out)["stages"]["generate"]
    assert generate["status"] == "partial" and generate["key"] == "g2"


def test_manifests_name_their_folder_relative_to_the_work_dir(tmp_path):
    import shutil

    from eaglet.storage import stage_dir

    folder = finished_stage(tmp_path / "a")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["path"] == "generate/k1"
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    moved = rerun(tmp_path / "b")  # the copy is complete and verified where it is
    assert stage_dir(tmp_path / "b", moved) == tmp_path / "b" / "generate" / "k1"


def test_a_failed_run_says_finished_stages_are_kept_only_when_one_finished(tmp_path):
    import argparse
    import time

    from eaglet_prefect.flows.cli import _after_failure

    config = load_config(None, [f"work_dir={tmp_path}"])
    args = argparse.Namespace(loaded_config=config, run_started=time.time() - 5)
    assert _after_failure(args).startswith("no stage finished")
    run = {"stages": {"download": {"state": "Completed"}, "tokenize": {"state": "Failed"}}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert _after_failure(args).startswith("finished stages are kept (download)")
    assert _after_failure(argparse.Namespace()).startswith("no stage ran")


LINE = st.one_of(
    st.builds(lambda i: json.dumps({"sample_id": f"s{i}"}).encode(), st.integers(0, 10**6)),
    st.binary(max_size=20).map(lambda b: b.replace(b"\n", b"")),
)


@settings(max_examples=200, deadline=None)
@given(lines=st.lists(LINE, max_size=12), torn=st.binary(max_size=12))
def test_repair_fuzz_keeps_every_readable_record_and_sets_aside_the_rest(lines, torn):
    """Whatever an append-only file holds, repair keeps the first readable record of each id
    (and blank lines) in order, moves every other line aside with its number, and cuts only a
    torn last line."""
    import tempfile

    from eaglet.records.io import rejected_lines_path

    def readable(line: bytes) -> bool:
        try:
            return isinstance(json.loads(line).get("sample_id"), str)
        except (ValueError, AttributeError, UnicodeDecodeError):
            return False

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "generations.jsonl"
        torn = torn.replace(b"\n", b"")
        path.write_bytes(b"".join(line + b"\n" for line in lines) + torn)
        ids = repair_and_read_ids(path)
        bad, seen = [], set()
        for n, line in enumerate(lines, 1):
            if line.strip() and not readable(line):
                bad.append(n)
            elif line.strip():  # a second line of an id is set aside too, the first kept
                sample_id = json.loads(line)["sample_id"]
                if sample_id in seen:
                    bad.append(n)
                seen.add(sample_id)
        kept = [line for n, line in enumerate(lines, 1) if n not in bad]
        assert ids == {json.loads(line)["sample_id"] for line in kept if line.strip()}
        assert path.read_bytes() == b"".join(line + b"\n" for line in kept)
        aside = rejected_lines_path(path)
        if bad:
            entries = [json.loads(x) for x in aside.read_text().splitlines()]
            assert [e["line"] for e in entries] == bad
            assert [e["text"].encode("utf-8", "surrogateescape") for e in entries] == [
                lines[n - 1] for n in bad
            ]
        else:
            assert not aside.exists()


def test_the_download_warning_names_rejected_jsonl_in_the_finished_folder(tmp_path):
    first = jsonl(tmp_path / "a.jsonl", [GOOD, GOOD])
    partial = tmp_path / "d1.partial"
    partial.mkdir()
    said: list[str] = []
    write_samples([spec(first)], partial / "samples.jsonl", partial / "rejected.jsonl", said.append)
    [warning] = [line for line in said if "left out" in line]
    assert str(tmp_path / "d1" / "rejected.jsonl") in warning and ".partial" not in warning


def test_inspect_lists_a_stray_partial_beside_the_complete_folder_no_run_names(tmp_path, capsys):
    """Issue 40: with no run naming the stage (a run --until an earlier stage, or killed), a
    newer stray `.partial` hid the complete train folder. It is listed beside it now."""
    from eaglet_prefect.flows.cli import main

    work_dir = tmp_path / "work"
    finished_stage(work_dir, "train", "t1")
    (work_dir / "run.json").write_text(json.dumps({"stages": {}}))
    (work_dir / "train" / "t2.partial").mkdir()
    main(["inspect", str(work_dir), "--json"])
    train = json.loads(capsys.readouterr().out)["stages"]["train"]
    assert train["status"] == "complete" and train["key"] == "t1"
    assert train["partial_folders"] == [str((work_dir / "train" / "t2.partial").resolve())]
    main(["inspect", str(work_dir)])
    assert "also an unfinished folder no finished run used" in capsys.readouterr().out


def _stage_with(work_dir: Path, stage: str, key: str, files: dict[str, list[dict]]) -> None:
    from eaglet.storage import StageOutput, run_stage

    def body(folder: Path) -> StageOutput:
        for name, lines in files.items():
            (folder / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
        return StageOutput(counts={"records": 0}, info={})

    run_stage(work_dir=work_dir, stage=stage, key=key, code_hash="c", config={}, upstream=[],
              body=body)  # fmt: skip


def test_inspect_sample_says_which_stage_left_a_sample_out_and_why(tmp_path, capsys):
    """Issue 40: `--sample ID` on a sample that tokenize rejected or the loop guard dropped said
    only "no example"; `--json` printed text. Each now names the stage and its reason, and
    `--json` prints one JSON object."""
    from eaglet_prefect.flows.cli import main

    work_dir = tmp_path / "work"
    _stage_with(
        work_dir,
        "download",
        "d",
        {
            "rejected.jsonl": [
                {"sample_id": "dup", "kind": "duplicate", "why": "the same conversation as row 3"}
            ]
        },
    )
    _stage_with(
        work_dir,
        "tokenize",
        "t",
        {
            "rejected.jsonl": [
                {"sample_id": "long", "kind": "too_long", "why": "9000 tokens > max_prompt_tokens"}
            ]
        },
    )
    _stage_with(work_dir, "generate", "g", {
        "generations.jsonl": [{"sample_id": "spin", "finish_reason": "loop"}],
        "failed.jsonl": [{"sample_id": "gone", "message": "HTTP 500", "attempts": 3}],
    })  # fmt: skip
    _stage_with(work_dir, "extract", "e", {"examples.jsonl": []})
    expected = {
        "dup": "the download stage left it out (duplicate): the same conversation as row 3",
        "long": "the tokenize stage left it out (too_long): 9000 tokens > max_prompt_tokens",
        "spin": "the loop guard stopped its answer",
        "gone": "the generate stage gave up on it after 3 attempts: HTTP 500",
        "nobody": "no sample with this id reached the generate stage",
    }
    for sample_id, why in expected.items():
        assert main(["inspect", str(work_dir), "--sample", sample_id]) == 2
        assert why in capsys.readouterr().err, sample_id
        assert main(["inspect", str(work_dir), "--sample", sample_id, "--json"]) == 2
        shown = json.loads(capsys.readouterr().out)
        assert shown["found"] is False and why in shown["why"], shown
