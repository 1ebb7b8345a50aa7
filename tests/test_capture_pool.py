"""Many capture servers behind one process's hidden-state requests (the vllm backend's
`CapturePool`), against small ASGI servers that answer as vLLM's hidden-states connector does
(a safetensors file per request in the connector folder, named in `kv_transfer_params`): the
requests are shared by load, a dead, failing (5xx) or hung server's requests are sent again
to the others with every sample answered once with its own states (also a server that
answered and died writing the file), and when no server answers the run fails in bounded time
with each server's error, as a fault that may pass; a live server's file that this machine
cannot see fails at once."""

from __future__ import annotations

import pytest
import torch

from eaglet.config import HiddenStatesConfig, TargetConfig
from eaglet.errors import is_transient
from eaglet.hidden_states.backends.base import Window
from eaglet.hidden_states.backends.vllm import VllmBackend
from eaglet.hidden_states.capture_pool import CaptureFailed
from tests.fake_servers import CaptureServer, capture_states, serve, silent_server
from tests.vllm_server import free_port


def backend(fixture_model_dir, urls, connector, timeout_s=30.0) -> VllmBackend:
    settings = HiddenStatesConfig(
        backend="vllm",
        vllm={"endpoints": urls, "connector_path": str(connector), "concurrency": 4,
              "request_timeout_s": timeout_s},
    )  # fmt: skip
    source = VllmBackend(TargetConfig(model=str(fixture_model_dir)), settings, [2, 4, 6])
    source.pool.first_down_s = 0.05  # a test's patience: the policy, faster
    return source


def samples(n: int) -> list[Window]:
    return [Window(f"s{i}", [1 + i, 2 + i, 3 + i, 4 + (i % 5)]) for i in range(n)]


def check_answers(items, asked):
    """One answer per sample, and each its own sample's states."""
    assert len(items) == len(asked)
    for item, sample in zip(items, asked, strict=True):
        expected = capture_states(sample.input_ids)[:, :3].reshape(len(sample.input_ids), -1)
        torch.testing.assert_close(item["aux_hidden_states"], expected)


def test_requests_are_shared_by_load(fixture_model_dir, tmp_path):
    fast, slow = CaptureServer(tmp_path), CaptureServer(tmp_path, delay_s=0.05)
    with serve(fast) as a, serve(slow) as b:
        source = backend(fixture_model_dir, [a, b], tmp_path)
        asked = samples(40)
        check_answers(source.features(asked), asked)
    stats = source.server_stats()
    assert stats[a]["samples"] + stats[b]["samples"] == 40
    assert stats[a]["samples"] > stats[b]["samples"] > 0  # the slow one holds its requests longer
    assert not list(tmp_path.glob("*.safetensors"))  # every file read and removed


@pytest.mark.parametrize("fault", ["dead", "5xx", "hung", "killed mid-write"])
def test_a_failing_servers_requests_go_to_the_other_once_each(fixture_model_dir, tmp_path, fault):
    good = CaptureServer(tmp_path)
    with serve(good) as url:
        if fault == "dead":
            bad_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            run = lambda: backend(fixture_model_dir, [bad_url, url], tmp_path)  # noqa: E731
            context = None
        elif fault == "5xx":
            context = serve(CaptureServer(tmp_path, failures=10**6, status=502))
        elif fault == "killed mid-write":  # a 200, then a truncated file (CI's two-node run)
            context = serve(CaptureServer(tmp_path, truncated=True))
        else:
            context = silent_server()
        if context is None:
            source = run()
            asked = samples(12)
            items = source.features(asked)
        else:
            with context as bad_url:
                source = backend(fixture_model_dir, [bad_url, url], tmp_path, timeout_s=0.5)
                asked = samples(12)
                items = source.features(asked)
    check_answers(items, asked)
    stats = source.server_stats()
    assert stats[url]["samples"] == 12 and stats[bad_url]["samples"] == 0
    assert stats[bad_url]["retries"] >= 1  # sent again elsewhere, not skipped
    assert len(good.served) == 12  # each sample asked of the good server once


def test_when_no_server_answers_the_run_fails_in_bounded_tries(fixture_model_dir, tmp_path):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    source = backend(fixture_model_dir, dead, tmp_path)
    with pytest.raises(CaptureFailed) as failed:
        source.features(samples(1))
    assert all(url in str(failed.value) for url in dead)
    assert is_transient(failed.value)  # a retry, or the next run, resumes
    assert sum(s["retries"] for s in source.server_stats().values()) == source.pool.tries


def test_a_4xx_is_the_server_saying_no_and_is_not_sent_again(fixture_model_dir, tmp_path):
    refusing = CaptureServer(tmp_path, failures=10**6, status=400)
    with serve(refusing) as url:
        source = backend(fixture_model_dir, [url], tmp_path)
        with pytest.raises(RuntimeError, match="answered 400"):
            source.features(samples(1))
    assert source.server_stats()[url]["retries"] == 0


def test_a_live_servers_file_this_machine_cannot_see_fails_at_once(fixture_model_dir, tmp_path):
    elsewhere = tmp_path / "the-servers-folder"
    elsewhere.mkdir()
    with serve(CaptureServer(elsewhere)) as url:  # writes where the backend does not look
        source = backend(fixture_model_dir, [url], tmp_path / "connector")
        with pytest.raises(RuntimeError, match="could not be read.*connector_path") as failed:
            source.features(samples(1))
    assert not is_transient(failed.value)  # the same on every try: no retry, no rerun
    assert source.server_stats()[url]["retries"] == 0
