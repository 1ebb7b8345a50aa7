"""eaglet/cpu_threads.py: the intra-op thread choice (affinity, cgroup quota, load; explicit
settings win) and that every torch stage applies it in the thread that runs it, a non-main
thread included (a Prefect task's, the sync engine's). No timing is asserted."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from eaglet import cpu_threads
from eaglet.config import HiddenStatesConfig, PipelineConfig, TargetConfig, TrainConfig
from eaglet.cpu_threads import (
    RECHECK_S,
    SPIN_COUNT,
    ThreadChoice,
    apply_threads,
    between_steps,
    cgroup_cpu_limit,
    choose_threads,
    others_load,
    own_runnable,
    quiet_openmp,
    set_by_caller,
    wait_setting,
)
from eaglet.draft.launch import worker_threads
from tests.hidden_states_helpers import tiny_target, write_examples

QUIET = {"OMP_WAIT_POLICY": "PASSIVE"}  # idle threads sleep: load counts as such


def readers(cpus=8, quota=None, busy=0.0, environ=None, spinning=False) -> dict:
    return {
        "environ": QUIET if environ is None else environ,
        "affinity": lambda: cpus,
        "quota": lambda: quota,
        "load": lambda: busy,
        "spinning": spinning,  # None: judged from `environ` and when torch loaded
    }


# --- the choice --------------------------------------------------------------------------------


def test_the_choice_follows_the_affinity_mask():
    assert choose_threads(**readers(cpus=8)) == ThreadChoice(
        8, "8 CPUs in the affinity mask, others keep 0.0 CPUs busy", True
    )
    assert choose_threads(**readers(cpus=3)).threads == 3
    assert choose_threads(**readers(cpus=1)).threads == 1


def test_the_choice_takes_whole_cpus_of_a_cgroup_quota():
    choice = choose_threads(**readers(cpus=8, quota=2.5))
    assert choice.threads == 2 and "cgroup quota 2.5 CPUs" in choice.reason
    assert choose_threads(**readers(cpus=8, quota=0.5)).threads == 1  # never 0
    assert choose_threads(**readers(cpus=2, quota=6.0)).threads == 2  # the mask still binds


def test_the_choice_leaves_the_cpus_others_keep_busy():
    assert choose_threads(**readers(cpus=8, busy=3.0)).threads == 5
    assert choose_threads(**readers(cpus=8, busy=2.6)).threads == 5  # the nearest whole CPU
    assert choose_threads(**readers(cpus=2, busy=1.0)).threads == 1
    assert choose_threads(**readers(cpus=2, busy=7.0)).threads == 1  # at least one
    assert choose_threads(**readers(cpus=4, quota=3.0, busy=1.0)).threads == 2
    assert "others keep 3.0 CPUs busy" in choose_threads(**readers(busy=3.0)).reason


def test_spinning_threads_take_only_the_cpus_others_leave_free(monkeypatch):
    monkeypatch.setattr(cpu_threads, "wait_policy_state", "user")  # judged from the environment
    spin = {"GOMP_SPINCOUNT": "10000"}
    # 2 cores: any load from others (more than SPIN_LOAD_LIMIT) means 1 thread
    assert choose_threads(**readers(cpus=2, busy=0.3, environ=spin, spinning=None)).threads == 1
    assert choose_threads(**readers(cpus=2, busy=1.0, environ=spin, spinning=None)).threads == 1
    assert choose_threads(**readers(cpus=2, busy=0.2, environ=spin, spinning=None)).threads == 2
    assert choose_threads(**readers(cpus=8, busy=1.0, environ=spin, spinning=None)).threads == 7
    busy = choose_threads(**readers(cpus=4, busy=1.4, environ=spin, spinning=None))
    assert busy.threads == 2 and "only CPUs others leave free" in busy.reason
    assert choose_threads(**readers(cpus=4, busy=1.4, environ=QUIET, spinning=None)).threads == 3
    unset = choose_threads(**readers(cpus=4, busy=0.0, environ={}, spinning=None))
    assert unset.threads == 4 and "spin" in unset.reason  # libgomp's default spins
    count = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300k"}  # the count wins
    assert choose_threads(**readers(cpus=2, busy=1.0, environ=count, spinning=None)).threads == 1
    none = {"GOMP_SPINCOUNT": "0"}
    assert choose_threads(**readers(cpus=4, busy=1.4, environ=none, spinning=None)).threads == 3
    monkeypatch.setattr(cpu_threads, "wait_policy_state", "late")  # torch loaded before eaglet
    assert choose_threads(**readers(cpus=4, busy=1.4, environ=none, spinning=None)).threads == 2


def test_the_log_says_how_idle_threads_wait_and_who_chose(monkeypatch):
    monkeypatch.setattr(cpu_threads, "wait_policy_state", "set")
    assert wait_setting({"GOMP_SPINCOUNT": "10000"}) == (
        "idle threads spin 10000 times, then sleep (GOMP_SPINCOUNT=10000, eaglet's)"
    )
    monkeypatch.setattr(cpu_threads, "wait_policy_state", "user")
    assert wait_setting({"OMP_WAIT_POLICY": "PASSIVE"}) == "OMP_WAIT_POLICY=PASSIVE, the user's"
    assert "default" in wait_setting({})
    monkeypatch.setattr(cpu_threads, "wait_policy_state", "late")
    assert "torch loaded before eaglet" in wait_setting({"GOMP_SPINCOUNT": "10000"})


def test_the_override_and_omp_num_threads_win():
    env = {"OMP_NUM_THREADS": "3", **QUIET}
    assert choose_threads(5, **readers(cpus=2, busy=9.0, environ=env)) == ThreadChoice(
        5, "train.threads=5", False
    )
    assert choose_threads(**readers(cpus=8, busy=7.0, environ=env)) == ThreadChoice(
        3, "OMP_NUM_THREADS=3", False
    )
    mkl = choose_threads(**readers(cpus=8, environ={"MKL_NUM_THREADS": "2", **QUIET}))
    assert mkl.threads == 2 and not mkl.chosen
    assert choose_threads(**readers(cpus=8, environ={"OMP_NUM_THREADS": "", **QUIET})).chosen


def test_torchrun_workers_share_the_choice():
    assert worker_threads(None, 2, **readers(cpus=8)) == 4
    assert worker_threads(None, 4, **readers(cpus=2)) == 1
    assert worker_threads(3, 2, **readers(cpus=8)) == 3  # train.threads: per process
    env = {"OMP_NUM_THREADS": "2", **QUIET}
    assert worker_threads(None, 4, **readers(cpus=8, environ=env)) == 2


# --- the readers --------------------------------------------------------------------------------


def cgroup_v2(tmp_path: Path, path: str, limits: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for folder, value in limits.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "cpu.max").write_text(value + "\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::{path}\n")
    return root, proc


def test_cgroup_v2_quota_is_the_smallest_along_the_path(tmp_path):
    root, proc = cgroup_v2(
        tmp_path, "/user/job", {"user/job": "150000 100000", "user": "max 100000"}
    )
    assert cgroup_cpu_limit(root, proc) == 1.5
    (root / "user" / "cpu.max").write_text("100000 100000\n")
    assert cgroup_cpu_limit(root, proc) == 1.0
    choice = choose_threads(**{**readers(cpus=8), "quota": lambda: cgroup_cpu_limit(root, proc)})
    assert choice.threads == 1 and "cgroup quota 1 CPUs" in choice.reason


def test_cgroup_v2_without_a_quota_and_a_container_at_the_mount_root(tmp_path):
    root, proc = cgroup_v2(tmp_path, "/", {"": "max 100000"})
    assert cgroup_cpu_limit(root, proc) is None
    # a container: /proc/self/cgroup names the host's path, the mount holds its own cgroup
    root, proc = cgroup_v2(tmp_path / "c", "/kubepods/pod1/abc", {"": "200000 100000"})
    assert cgroup_cpu_limit(root, proc) == 2.0


def test_cgroup_v1_quota(tmp_path):
    root = tmp_path / "cgroup"
    folder = root / "cpu,cpuacct" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("300000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n")
    assert cgroup_cpu_limit(root, proc) == 3.0
    (folder / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(root, proc) is None
    assert cgroup_cpu_limit(tmp_path / "absent", tmp_path / "absent-proc") is None


def test_the_load_of_others_leaves_out_this_process():
    readings = iter([3, 4, 2])
    assert others_load(lambda: next(readings), lambda: 1, samples=3, interval_s=0) == 2.0
    assert others_load(lambda: 1, lambda: 1, samples=2, interval_s=0) == 0.0  # only the reader
    assert others_load(lambda: 4, lambda: 3, samples=2, interval_s=0) == 1.0  # own threads out
    assert others_load(lambda: None, lambda: 1, samples=2, interval_s=0) == 0.0  # unreadable


def test_own_runnable_threads_are_read_from_their_stat(tmp_path):
    for tid, state in (("10", "R"), ("11", "S"), ("12", "R"), ("13", "D")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "stat").write_text(f"{tid} (a (b) c) {state} 1 2 3\n")
    assert own_runnable(tmp_path) == 2
    assert own_runnable(tmp_path / "absent") == 1
    assert own_runnable() >= 1  # this very thread


def test_the_wait_policy_is_set_only_before_torch_loads_and_only_when_unset():
    env: dict[str, str] = {}
    assert quiet_openmp(env, modules={}) == "set" and env == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert quiet_openmp(env, modules={}) == "user" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"GOMP_SPINCOUNT": "1000"}
    assert quiet_openmp(env, modules={}) == "user" and env == {"GOMP_SPINCOUNT": "1000"}
    env = {}
    assert quiet_openmp(env, modules={"torch": object()}) == "late" and env == {}
    quiet_openmp(dict(os.environ), sys.modules)  # leave the module's state as this process's


def test_importing_eaglet_sets_the_spin_count_before_torch():
    code = "import os, sys, eaglet; print(os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k not in cpu_threads.WAIT_VARS}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == [str(SPIN_COUNT), "False"], out.stderr
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # the user's wait wins
    code = "import os, eaglet; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["None"], out.stderr


def test_a_count_the_caller_set_is_told_from_torchs_default():
    assert not set_by_caller(2, None, {2, 4})  # torch's own default
    assert set_by_caller(1, None, {2, 4})  # the caller's torch.set_num_threads(1)
    assert not set_by_caller(3, 3, {2})  # what this module set last
    assert set_by_caller(1, 3, {2})  # changed since


# --- applied by the stages, in their own thread --------------------------------------------


@pytest.fixture
def fake_machine(monkeypatch):
    """3 usable CPUs, no quota, no load, no explicit setting; torch's count restored after."""
    before = torch.get_num_threads()
    # Also torch's default for threads started later, which an earlier test's worker thread
    # may have changed (a new thread would otherwise see that count as a caller's own).
    torch.set_num_threads(before)
    monkeypatch.setattr(cpu_threads, "affinity_cpus", lambda: 3)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(cpu_threads, "others_load", lambda: 0.0)
    for var in cpu_threads.THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(cpu_threads, "wait_policy_state", "user")  # libgomp read PASSIVE
    monkeypatch.setattr(cpu_threads, "_applied", before)  # the current count is not a caller's
    monkeypatch.setattr(cpu_threads, "_local", threading.local())  # no thread applied yet
    yield
    torch.set_num_threads(before)


def in_thread(fn):
    """fn() in a fresh non-main thread, as Prefect's and the sync engine's workers run; returns
    (its result, torch's thread count seen in that thread after it)."""
    out: dict = {}

    def work():
        try:
            out["result"] = fn()
            out["threads"] = torch.get_num_threads()
        except BaseException as exc:  # re-raised in the test's thread
            out["error"] = exc

    worker = threading.Thread(target=work, name="stage-worker")
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out.get("result"), out["threads"]


def test_apply_sets_the_count_in_a_non_main_thread(fake_machine, caplog):
    caplog.set_level(logging.INFO, logger="eaglet.cpu_threads")
    lines: list[str] = []
    choice, seen = in_thread(lambda: apply_threads("train", report=lines.append))
    assert choice.threads == 3 and seen == 3
    assert lines == [caplog.records[-1].getMessage()]
    assert lines[0].startswith("train: 3 intra-op threads (3 CPUs in the affinity mask")
    assert "thread stage-worker" in lines[0]
    _, seen = in_thread(lambda: apply_threads("train", override=1))
    assert seen == 1


def test_a_callers_torch_setting_is_kept(fake_machine, monkeypatch):
    monkeypatch.setattr(cpu_threads, "_applied", None)
    monkeypatch.setattr(cpu_threads, "_torch_defaults", lambda: {4})
    torch.set_num_threads(2)
    choice = apply_threads("evaluate")
    assert (choice.threads, choice.chosen) == (2, False) and "by the caller" in choice.reason
    assert torch.get_num_threads() == 2
    assert apply_threads("generate").threads == 2  # still the caller's, at every stage
    assert apply_threads("train", override=1).threads == 1  # the override still wins
    assert apply_threads("evaluate").threads == 3  # the override's count was this module's


def test_training_chooses_again_between_its_optimizer_steps(fake_machine, monkeypatch):
    monkeypatch.setattr(cpu_threads, "RECHECK_S", 0.0)  # due at every step
    busy = {"now": 0.0}
    lines: list[str] = []

    def run() -> list[int]:
        param = torch.nn.Parameter(torch.zeros(2))
        mine, other = torch.optim.SGD([param], lr=0.1), torch.optim.SGD([param], lr=0.1)
        apply_threads("train", report=lines.append, load=lambda: busy["now"], spinning=True)
        counts = [torch.get_num_threads()]
        busy["now"] = 1.0
        mine.step()  # the stage's optimizer: 3 CPUs, 1 busy, spinning threads: 2
        counts.append(torch.get_num_threads())
        busy["now"] = 0.0
        other.step()  # another optimizer in the same thread (the fixture build's): not watched
        counts.append(torch.get_num_threads())
        mine.step()  # the load is gone: 3 again
        counts.append(torch.get_num_threads())
        torch.set_num_threads(1)  # someone else's count from now on: the watch ends
        busy["now"] = 2.0
        mine.step()
        counts.append(torch.get_num_threads())
        return counts

    counts, _ = in_thread(run)
    assert counts == [3, 2, 2, 3, 1]
    assert "checked again every 0 s between steps" in lines[0]
    assert lines[1:] == [
        "train: now 2 intra-op threads (3 CPUs in the affinity mask, others keep 1.0 CPUs "
        "busy, idle OpenMP threads spin: only CPUs others leave free)",
        "train: now 3 intra-op threads (3 CPUs in the affinity mask, others keep 0.0 CPUs "
        "busy, idle OpenMP threads spin: only CPUs others leave free)",
    ]


def test_between_steps_reads_the_load_only_when_due_and_only_for_a_chosen_count(fake_machine):
    reads: list[float] = []

    def load() -> float:
        reads.append(1.0)
        return 1.0

    def run() -> list:
        apply_threads("train", load=load)
        seen = [between_steps(), len(reads)]  # RECHECK_S not over yet: nothing read again
        apply_threads("train", override=2, load=load)  # train.threads: never changed
        seen.append(cpu_threads._local.watch)
        apply_threads("evaluate", load=load)  # not a stage that re-checks
        return seen + [cpu_threads._local.watch]

    seen, _ = in_thread(run)
    assert seen == [None, 1, None, None] and RECHECK_S > 0
    assert between_steps() is None  # this thread applied nothing: no watch


def test_a_count_chosen_in_another_thread_is_not_read_as_this_threads_callers(
    fake_machine, monkeypatch
):
    """The engine's worker chose 1 thread under load; the next stage, in the main thread that
    still has torch's default, chooses for itself (it kept the caller's 2 before)."""
    monkeypatch.setattr(cpu_threads, "_torch_defaults", lambda: {torch.get_num_threads()})
    in_thread(lambda: apply_threads("generate", load=lambda: 2.0))
    choice = apply_threads("hidden_states")
    assert choice.chosen and choice.threads == 3


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A tiny target and its hidden-states shards (the stage body, run in a worker thread)."""
    root = tmp_path_factory.mktemp("threads")
    target = tiny_target(root / "target")
    write_examples(root / "examples.jsonl", 8, max_len=24)
    config = PipelineConfig(
        work_dir=str(root),
        target=TargetConfig(model=str(target), device="cpu"),
        hidden_states=HiddenStatesConfig(aux_layer_ids=[1, 3, 5], storage="float32"),
    )
    return root, config


def test_the_hidden_states_stage_applies_the_choice_in_its_thread(shards, fake_machine):
    from eaglet.hidden_states.stage import stage_body

    root, config = shards
    lines: list[str] = []
    folder = root / "hs"
    folder.mkdir(exist_ok=True)
    _, seen = in_thread(lambda: stage_body(config, root / "examples.jsonl", lines.append)(folder))
    assert seen == 3
    assert [ln for ln in lines if "intra-op" in ln][0].startswith("hidden_states: 3 intra-op")


def test_the_trainer_applies_the_choice_and_the_override_in_its_thread(shards, fake_machine):
    from eaglet.draft.job import train_job
    from eaglet.draft.launch import run_training
    from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION
    from eaglet.hidden_states.stage import stage_body

    root, config = shards
    folder = root / "hs-train"
    folder.mkdir()
    stage_body(config, root / "examples.jsonl", lambda _: None)(folder)
    lines: list[str] = []
    for threads, expected in ((None, 3), (1, 1)):
        train = TrainConfig(
            epochs=1, batch_size=4, draft_vocab_size=64, device="cpu", threads=threads,
            holdout_fraction=0.0, intermediate_size=32,
        )  # fmt: skip
        job = train_job(
            root / f"run-{threads}", config.target, train, [1, 3, 5],
            AUX_LAYER_CONVENTION, hidden_states_dir=folder,
        )  # fmt: skip
        _, seen = in_thread(lambda job=job: run_training(job, 1, None, lines.append))
        assert seen == expected
    chosen = [ln for ln in lines if "intra-op" in ln]
    assert chosen[0].startswith("train: 3 intra-op threads (3 CPUs")
    assert chosen[1].startswith("train: 1 intra-op thread (train.threads=1")


def test_evaluation_applies_the_choice_in_its_thread(fake_machine, tmp_path):
    from eaglet.draft import evaluate

    lines: list[str] = []

    def run() -> int:
        with cpu_threads.report_to(lines.append), pytest.raises(OSError):
            evaluate.evaluate_draft(tmp_path, tmp_path, [[1, 2]])  # no draft: fails after
        return torch.get_num_threads()

    seen, _ = in_thread(run)
    assert seen == 3 and lines[0].startswith("evaluate: 3 intra-op threads (3 CPUs")
    assert "checked again" not in lines[0]  # only training re-checks between steps


def test_the_local_engine_applies_the_choice_in_the_consuming_thread(fake_machine, monkeypatch):
    from eaglet.engines.base import SamplingParams
    from eaglet.engines.local import LocalEngine

    engine = LocalEngine.__new__(LocalEngine)  # no model: the batches only record the count
    engine.batch_size, engine.params = 2, SamplingParams()
    seen: list[tuple[str, int]] = []

    def batch(prompts, params):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return prompts

    monkeypatch.setattr(engine, "_generate_batch", batch, raising=False)

    class Prompt:
        prompt_ids = [1, 2, 3]
        sampling = None

    records, _ = in_thread(lambda: list(engine.generate([Prompt(), Prompt(), Prompt()])))
    assert len(records) == 3 and seen == [("stage-worker", 3), ("stage-worker", 3)]
