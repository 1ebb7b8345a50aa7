"""Preflight: every check that needs only the config, the target's `config.json` and its
tokenizer, run before the first stage (the flow) and by `eaglet doctor`.

A run lasts days; an error the config already shows must not wait for its stage. `preflight`
checks, each finding naming the config key or the file and what to do; each check sits in the
module named as the config section it checks:

- `datasets`: not empty; each local file exists, is a file, and is not empty; a hub dataset is
  found (`hub`: one look at the hub, or a cached copy);
- `evaluate` (when the run goes that far): held-out samples, and each `evaluate.sets` file;
- `work_dir`: a folder (or creatable), writable; the disk budget of the hidden_states shards
  (`eaglet.hidden_states.budget`), as an upper bound: every sample at full length;
- `target`: `target.model` a local folder with `config.json` and a tokenizer, or a hub id that
  loads; a path that looks local and is missing is named as a folder, never as a hub-id error;
  each `*.safetensors` file of a local target is as long as its header says (a cut download
  is found here, not at hidden_states), shards of an index exist; the tokenizer against the
  target's vocabulary, and `train.draft_vocab_size`;
- `hidden_states`: `hidden_states.aux_layer_ids` against the target's layer count (a 4-layer
  target's defaults collide: [2, 2, 1]); the chosen hidden-state backend's own checks, owned
  by its module (`eaglet.hidden_states.backends`: the vllm backend's servers and connector
  folder);
- `train`: the draft method's settings; several machines (train.nnodes) read features from
  servers they all reach; `train.init_from`: the starting draft reads this
  target (hidden size, vocabulary) and the layers this run extracts
  (`eaglet.draft.init_from`), and the train settings it overrides;
- `tokenize`: `tokenize.chat_template_kwargs`: the template renders a prompt with them, and
  reads every key (a misspelt `enable_thinkng` is otherwise silently ignored);
  `reasoning.format` fits; lengths: `tokenize.max_prompt_tokens + generation.max_tokens`
  within the target's context;
- `endpoints`: the serving check's vLLM python or server, a Dask scheduler;
- `devices`: a CUDA device torch sees, a dtype the device computes at speed.

`PreflightReport.raise_if_failed()` (`report`) raises `PreflightError` (permanent: a retry
cannot mend it) listing every problem; warnings are printed and left to the run.
"""

from __future__ import annotations

from collections.abc import Callable

from eaglet.config.pipeline import PipelineConfig
from eaglet.preflight.datasets import check_datasets
from eaglet.preflight.devices import check_devices, cpu_has_bf16_units
from eaglet.preflight.endpoints import check_endpoints, check_vllm_python
from eaglet.preflight.evaluate import check_eval_sets, check_holdout
from eaglet.preflight.hidden_states import check_hidden_states_backend, check_layers
from eaglet.preflight.hub import hub_dataset_problem, hub_lookup_problem
from eaglet.preflight.report import PreflightError, PreflightReport
from eaglet.preflight.target import check_safetensors, check_vocab, load_target
from eaglet.preflight.tokenize import check_lengths, check_template
from eaglet.preflight.train import check_init_from, check_mask_token, check_method, check_nodes
from eaglet.preflight.work_dir import check_disk_budget, check_work_dir
from eaglet.progress import say
from eaglet.stages import STAGE, STAGES

__all__ = [
    "PreflightError",
    "PreflightReport",
    "check_devices",
    "check_disk_budget",
    "check_endpoints",
    "check_eval_sets",
    "check_hidden_states_backend",
    "check_holdout",
    "check_init_from",
    "check_layers",
    "check_lengths",
    "check_nodes",
    "check_safetensors",
    "check_template",
    "cpu_has_bf16_units",
    "hub_dataset_problem",
    "hub_lookup_problem",
    "load_target",
    "preflight",
    "run_preflight",
    "run_preflight_ahead",
    "take_passed_ahead",
]


def preflight(config: PipelineConfig, until: str = STAGES[-1]) -> PreflightReport:
    """Every check that needs only the config, the target's config.json and tokenizer; see
    the module docstring. Never raises for a bad config: the report lists the problems.
    `until`: the last stage the run will run (checks of later stages are left out)."""
    report = PreflightReport()
    rows = check_datasets(config, report)
    evaluates = any(STAGE[stage].evaluates for stage in STAGES[: STAGES.index(until) + 1])
    if evaluates:
        check_holdout(config, rows, report)
    check_work_dir(config, report)
    check_vllm_python(config, report)
    check_devices(config, report)
    check_hidden_states_backend(config, report)
    check_nodes(config, report)
    check_endpoints(config, report)
    load_target(config, report)
    model_config, tokenizer = report.model_config, report.tokenizer
    if evaluates:
        check_eval_sets(config, report, model_config)
    if model_config is not None:
        check_layers(config, model_config, report)
        check_method(config, model_config, report)
        check_lengths(config, model_config, report)
        check_init_from(config, model_config, report)
    if tokenizer is not None:
        check_template(config, tokenizer, report)
        if model_config is not None:
            check_vocab(config, model_config, tokenizer, report)
            check_mask_token(config, model_config, tokenizer, report)
    if model_config is not None:
        check_disk_budget(config, model_config, rows, report)
    return report


def run_preflight(
    config: PipelineConfig, log: Callable[[str], None] = say, until: str = STAGES[-1]
) -> None:
    """The flow's one call before its first stage: `preflight(config)`, its report logged, a
    `PreflightError` raised on any problem. It only checks: the flow builds the demo's model
    and data first, in its demo-setup task (`eaglet.fixture.demo.ensure_demo_inputs`)."""
    report = preflight(config, until)
    log(report.render())
    report.raise_if_failed()


# config (as JSON) -> the report lines of a preflight that passed before its flow run existed
_PASSED_AHEAD: dict[str, list[str]] = {}


def run_preflight_ahead(config: PipelineConfig, until: str = STAGES[-1]) -> None:
    """`eaglet run`'s preflight, before Prefect loads and while its temporary server starts:
    a problem raises `PreflightError` in seconds, its report printed first; a pass is kept
    for the flow to log (`take_passed_ahead`) instead of checking again. A config whose demo
    inputs are not built yet is checked by the flow, after its demo-setup task built them, as
    a run from the UI is."""
    from eaglet.fixture.demo import demo_inputs_missing

    if demo_inputs_missing(config):
        return
    lines: list[str] = []
    try:
        run_preflight(config, log=lines.append, until=until)
    except PreflightError:
        print("\n".join(lines))
        raise
    _PASSED_AHEAD[config.model_dump_json()] = lines


def take_passed_ahead(config: PipelineConfig) -> list[str] | None:
    """The report lines of `config`'s preflight when `run_preflight_ahead` passed it, once."""
    return _PASSED_AHEAD.pop(config.model_dump_json(), None)
