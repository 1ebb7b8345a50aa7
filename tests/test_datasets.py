"""Dataset reading: both row shapes, stable ids, and errors that name the file and line."""

import json

import pandas as pd
import pytest

from eaglet.config import DatasetSpec
from eaglet.datasets import DatasetError, read_samples

SHAREGPT = {
    "id": "r1",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "What is 2 + 2?"},
        {"from": "gpt", "value": "4"},
    ],
}
OPENAI = {
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 3}'},
        {"role": "assistant", "content": "It is 3 degrees."},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sharegpt_rows_become_openai_messages(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [SHAREGPT])
    [sample] = read_samples(DatasetSpec(source="a", path=str(path)))
    assert [m["role"] for m in sample.messages] == ["system", "user", "assistant"]
    assert sample.messages[1]["content"] == "What is 2 + 2?"
    assert sample.source == "a"


def test_openai_rows_keep_tools_and_parse_string_arguments(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [OPENAI])
    [sample] = read_samples(DatasetSpec(source="t", path=str(path)))
    assert sample.tools[0]["function"]["name"] == "get_weather"
    call = sample.messages[1]["tool_calls"][0]["function"]
    assert call["arguments"] == {"city": "Oslo"}


def test_sample_id_is_stable_and_independent_of_row_position(tmp_path):
    first = write_jsonl(tmp_path / "1.jsonl", [SHAREGPT, OPENAI])
    second = write_jsonl(tmp_path / "2.jsonl", [OPENAI, SHAREGPT])
    ids_first = [s.sample_id for s in read_samples(DatasetSpec(source="x", path=str(first)))]
    ids_second = [s.sample_id for s in read_samples(DatasetSpec(source="x", path=str(second)))]
    assert ids_first == list(reversed(ids_second))
    other_source = [s.sample_id for s in read_samples(DatasetSpec(source="y", path=str(first)))]
    assert set(other_source).isdisjoint(ids_first)


def test_limit_reads_only_the_first_rows(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [SHAREGPT, OPENAI, SHAREGPT])
    assert len(list(read_samples(DatasetSpec(source="a", path=str(path), limit=2)))) == 2


def test_parquet_files_read_through_datasets(tmp_path):
    path = tmp_path / "m.parquet"
    pd.DataFrame(
        {"messages_json": [json.dumps(OPENAI["messages"])], "tools": [json.dumps(OPENAI["tools"])]}
    ).to_parquet(path)
    [sample] = read_samples(DatasetSpec(source="m", path=str(path)))
    assert sample.messages[-1]["content"] == "It is 3 degrees."
    assert sample.tools[0]["function"]["name"] == "get_weather"


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(SHAREGPT) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: not valid JSON"):
        list(read_samples(DatasetSpec(source="a", path=str(path))))


def test_unknown_row_shape_names_the_line_and_keys(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [SHAREGPT, {"prompt": "hi"}])
    with pytest.raises(DatasetError, match=r"odd.jsonl:2: row has neither.*\['prompt'\]"):
        list(read_samples(DatasetSpec(source="a", path=str(path))))


def test_unknown_sharegpt_speaker_is_an_error(tmp_path):
    row = {"conversations": [{"from": "narrator", "value": "x"}]}
    path = write_jsonl(tmp_path / "s.jsonl", [row])
    with pytest.raises(DatasetError, match="unknown ShareGPT speaker 'narrator'"):
        list(read_samples(DatasetSpec(source="a", path=str(path))))


def test_missing_local_file_is_named(tmp_path):
    with pytest.raises(DatasetError, match="dataset file not found"):
        list(read_samples(DatasetSpec(source="a", path=str(tmp_path / "none.jsonl"))))
