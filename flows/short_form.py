"""The short form of the pipeline for the Prefect UI: the few settings most runs change, over a
base config (`eaglet.short_form`), then the same stages as the `pipeline` flow."""

from __future__ import annotations

from typing import Annotated

from prefect import flow
from prefect.states import State
from pydantic import Field

from eaglet.config import load_config
from eaglet.failure_advice import RunOrigin
from eaglet.short_form import EngineChoice, ShortFormDataset, short_form_overrides
from eaglet.stages import STAGES, RefreshFrom, StageName
from eaglet_prefect.flows.crashes import report_crash
from eaglet_prefect.flows.pipeline import publish_plan, run_name, run_stages, start_run
from eaglet_prefect.flows.refusals import REFUSALS, refusals_reported, refused_state


@flow(
    name="eaglet-pipeline-short-form",
    flow_run_name=run_name,  # `pipeline[<config name>]`, as the pipeline's runs
    log_prints=True,
    on_crashed=[report_crash],
)
def short_form(
    target_model: str = "",
    datasets: list[ShortFormDataset] = [],  # noqa: B006 - a form default, never mutated
    engine: EngineChoice = "",
    endpoints: list[str] = [],  # noqa: B006
    served_model: str = "",
    epochs: Annotated[int, Field(ge=0, le=1000)] = 0,
    work_dir: str = "",
    until: StageName = STAGES[-1],
    refresh_from: RefreshFrom = "",
    config_path: str = "",
    plan_only: bool = False,
) -> State:
    """The pipeline with the settings most runs change; blank keeps the base config's.

    Args:
        target_model: Hugging Face id or local folder of the target model. Blank: the base
            config's (the demo's fixture model).
        datasets: The prompt datasets (source tag, path or hub id, row limit). Empty: the base
            config's (the demo's three sample files).
        engine: How answers are generated: local (in this process), vllm, sglang or openai
            (an OpenAI-compatible server). Blank: the base config's (local).
        endpoints: Base URLs of the inference servers for vllm, sglang and openai, such as
            http://10.0.0.5:8000. Empty: the base config's.
        served_model: The model name the server expects (HTTP engines). Blank: the base
            config's.
        epochs: Training epochs. 0: the base config's. Range: 0 to 1000.
        work_dir: The folder of every stage's output and cache; a rerun into the same folder
            reuses each finished stage. Blank: the base config's (runs/demo).
        until: The last stage to run (download, tokenize, generate, extract, hidden_states,
            train, evaluate).
        refresh_from: Run this stage and every one after it again even when their inputs and
            code are unchanged. Blank: reuse every finished stage.
        config_path: A YAML config file on the machine that runs the flow, the base the fields
            above change. Blank: the demo's defaults. Every setting is also in the form of
            the `pipeline` deployment.
        plan_only: Run nothing: say per stage whether it is Cached or why it would run, in
            the log and the `run-plan` artifact; the run ends Planned.
    """
    start_run()
    overrides = short_form_overrides(
        target_model, datasets, engine, endpoints, served_model, epochs, work_dir
    )
    set_keys = frozenset(override.split("=", 1)[0] for override in overrides)
    origin = RunOrigin("short form", config_path or None, set_keys)
    try:
        with refusals_reported(origin):
            config = load_config(config_path or None, overrides)
        base = config_path or "the demo's defaults"
        print(f"short form over {base}: {' '.join(overrides)}")
        if plan_only:
            return publish_plan(config, until, refresh_from or None)
        # the run's own WORK_DIR/config.yaml is its config file once the form changed the base
        config_file = None if overrides else (config_path or None)
        return run_stages(config, config_file, until, refresh_from or None, False, origin)
    except REFUSALS as exc:
        return refused_state(exc, origin)
