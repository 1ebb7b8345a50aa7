"""Every stage of the pipeline, declared once: its name, what it reads, the files it writes,
what in the configuration keys it, and what the run report and the picture say about it.

Everything else derives from `STAGES`: the stage order and the `StageName` choices (CLI,
flow form), the upstream manifests in each cache key and the key's config subset
(`eaglet.cache`), the order of the flow's tasks (`flows/pipeline.py`), `eaglet inspect`'s
status. A stage's work is its body, `run` in `eaglet/stage_bodies/<stage>.py`, which runs
without Prefect (`eaglet.stage_context`); `tasks/<stage>.py` imports it and adapts it to a
task, and the flow imports the tasks: flow → task → body is three imports a reader (or an
IDE's "go to definition") follows. The body is keyed as part of its task module's import
closure (`eaglet.cache`).

Output file names are constants here, beside the stage that writes them; a later stage reads
them from here, never as a loose string.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pathlib import Path

    from eaglet.config import PipelineConfig
    from eaglet.stage_context import StageContext
    from eaglet.storage import StageOutput

# The record files each stage writes (in its folder `WORK_DIR/<stage>/<key>/`).
SAMPLES_FILE = "samples.jsonl"  # download
REJECTED_FILE = "rejected.jsonl"  # download, tokenize: rows skipped, with why
PROMPTS_FILE = "prompts.jsonl"  # tokenize
GENERATIONS_FILE = "generations.jsonl"  # generate
FAILED_FILE = "failed.jsonl"  # generate: samples the server refused
TURN_PROMPTS_FILE = "turn_prompts.jsonl"  # generate with tokenize.regenerate=all
EXAMPLES_FILE = "examples.jsonl"  # extract
QUALITY_FILE = "quality.json"  # extract
TEMPLATE_MISMATCHES_FILE = "template_mismatches.jsonl"  # extract: template-mismatched turns
SERVER_DISAGREEMENTS_FILE = "server_disagreements.jsonl"  # extract: a server's text vs the split
DRAFT_FOLDER = "draft"  # train: the vLLM export, what evaluate loads
REPORT_FILE = "report.json"  # evaluate
# Beside the record files, read by other modules than the one writing them.
TRAIN_STATE_FOLDER = "state"  # train: the checkpoint a rerun resumes from
LOSS_PLOT_FILE = "loss.png"  # train
ACCEPTANCE_PLOT_FILE = "acceptance.png"  # evaluate
# A keyed value that is no config field: the target layers the run's draft method reads
# (`eaglet.hidden_states.layers.layer_ids_of`), so a method's default keys what it extracts.
LAYER_IDS = "hidden_states.layer_ids"
# Keyed values that are no config field either: the parts of the target's folder a stage
# reads, each by its files' content (`eaglet.fingerprints.target_parts`), so a file no stage
# reads (a README) keys nothing and a template edit leaves generate's settings as they were
# (its per-sample reuse holds).
TARGET_WEIGHTS = "target.weights"  # the weights, config.json, the model's code
TARGET_TOKENIZER = "target.tokenizer"  # vocabulary and special tokens
TARGET_TEMPLATE = "target.chat_template"
TARGET_GENERATION = "target.generation_config"  # end tokens, sampling defaults
TARGET_PART_OF = {
    TARGET_WEIGHTS: "weights",
    TARGET_TOKENIZER: "tokenizer",
    TARGET_TEMPLATE: "chat_template",
    TARGET_GENERATION: "generation_config",
}
# The registries a stage can plug an entry of into its work, the one the config chooses:
# "engine" (`generation.engine`, eaglet.engines.registry), "backend" (`hidden_states.backend`,
# eaglet.hidden_states.backends), "method" (`train.method`, eaglet.draft.methods).
PlugIn = Literal["engine", "backend", "method"]


@dataclass(frozen=True)
class Stage:
    """One stage. `reads` names the outputs of earlier stages it takes (each stage's output is
    called `output`); `keyed_by` the config values that can change what it writes (dotted
    paths; a section's fields marked cache-neutral are left out, see `eaglet.config`)."""

    name: str
    output: str  # what later stages call this stage's output (a task parameter name)
    reads: tuple[str, ...]
    files: tuple[str, ...]  # the record files it writes; `records` counts the first
    keyed_by: tuple[str, ...]
    resumes: bool = False  # a rerun continues its `.partial` folder instead of starting over
    # With `resumes`: what a rerun does with the `.partial` folder, in the run report's words
    # ("this stage <resume_note>"); a stage that resumes cannot be declared without one.
    resume_note: str = ""
    # The setting the run's advice names when the stage failed a passing fault and its error
    # names none (the one a user typed that such faults most often come from).
    retry_setting: str = ""
    shown_files: tuple[str, ...] = ()  # what the pipeline picture lists beside `files`
    # The files later stages read (globs in its folder): its output hash, which keys them,
    # covers only these (`Manifest.output_hash`), so a rerun that wrote the same of them but
    # other timings or plots leaves them Cached. Empty: every file. Kept in its manifest.
    read_later: tuple[str, ...] = ()
    reads_online: tuple[str, ...] | None = None  # `reads` with train.hidden_states=online
    keyed_by_online: tuple[str, ...] = ()  # keyed besides with train.hidden_states=online
    skipped_online: bool = False  # not run with train.hidden_states=online
    holds_device: bool = False  # loads a model on target.device / train.device while it runs
    # The registries whose chosen entry does part of its work: that entry's module is part of
    # its code and so of its key (`eaglet.cache`), and the pipeline picture lists engines and
    # backends below it.
    plug_ins: tuple[PlugIn, ...] = ()
    plug_ins_online: tuple[PlugIn, ...] = ()  # besides, with train.hidden_states=online
    # With tokenize.regenerate=all it regenerates later turns itself (`eaglet.turns`, and
    # through it the reasoning split): only then does that code decide, and key, its output.
    regenerates_turns: bool = False
    # It measures the draft on held-out prompts and `evaluate.sets`: the preflight checks
    # those only for a run that reaches it.
    evaluates: bool = False
    # Its work is shards, each a task a Dask task runner maps (`execution.task_runner: dask`)
    # before the stage's own task gathers them.
    sharded: bool = False
    # A run's `retry_failed` reaches it: it sends the samples it recorded as failed again.
    retries_failed: bool = False

    def __post_init__(self) -> None:
        if self.resumes != bool(self.resume_note):
            raise ValueError(
                f"stage {self.name}: `resume_note` says what a rerun keeps of its .partial "
                "folder; declare it exactly when the stage `resumes`"
            )

    @property
    def records_file(self) -> str | None:
        """The record file `records` counts (one line per sample id): the first file, when it
        is JSONL; checked before the stage is sealed and by `eaglet inspect --verify`."""
        return self.files[0] if self.files and self.files[0].endswith(".jsonl") else None

    def inputs(self, config: PipelineConfig) -> tuple[str, ...]:
        """The outputs this stage reads under `config`."""
        if _online(config) and self.reads_online is not None:
            return self.reads_online
        return self.reads

    def key_paths(self, config: PipelineConfig) -> tuple[str, ...]:
        """The config values this stage's key holds under `config`."""
        paths = self.keyed_by + (self.keyed_by_online if _online(config) else ())
        if self.regenerates_turns and config.tokenize.regenerate == "all":
            paths += (TARGET_TEMPLATE,)  # it renders the later turns itself
        return paths

    def runs(self, config: PipelineConfig) -> bool:
        return not (self.skipped_online and _online(config))

    def code_plug_ins(self, config: PipelineConfig | None) -> tuple[PlugIn, ...]:
        """The registries whose chosen entry's module keys this stage under `config` (None:
        the stage's code for any config, as `eaglet.cache.code_hash` takes it)."""
        online = config is not None and _online(config)
        return self.plug_ins + (self.plug_ins_online if online else ())


def writers_of(name: str) -> tuple[str, ...]:
    """The stages whose declared `files` hold `name`, in pipeline order."""
    return tuple(stage.name for stage in STAGE_LIST if name in stage.files)


def writer_of(name: str) -> str:
    """The stage that writes the file `name` (the first, where several do)."""
    return writers_of(name)[0]


def _online(config: PipelineConfig) -> bool:
    return config.train.hidden_states == "online"


# The work of a stage: writes its files into `folder` (its `.partial` folder) from the folders
# of the stages it reads, and returns its counts and figures for the manifest.
StageBody = Callable[["StageContext", "PipelineConfig", "dict[str, Path]", "Path"], "StageOutput"]

STAGE_LIST: tuple[Stage, ...] = (
    Stage(
        name="download",
        output="samples",
        reads=(),
        files=(SAMPLES_FILE, REJECTED_FILE),
        keyed_by=("datasets",),
    ),
    Stage(
        name="tokenize",
        output="prompts",
        reads=("samples",),
        files=(PROMPTS_FILE, REJECTED_FILE),
        # the sampling plan is chosen per row here (its reasoning effort is in the prompt)
        keyed_by=(
            "tokenize",
            TARGET_TOKENIZER,
            TARGET_TEMPLATE,
            TARGET_WEIGHTS,  # config.json: the context a prompt must fit
            "generation.sampling_plan",
            "generation.sampling_plan_mode",
            "generation.seed",
        ),  # fmt: skip
    ),
    Stage(
        name="generate",
        output="generations",
        reads=("prompts",),
        files=(GENERATIONS_FILE, FAILED_FILE, TURN_PROMPTS_FILE),
        keyed_by=("generation", TARGET_WEIGHTS, TARGET_TOKENIZER, TARGET_GENERATION),
        resumes=True,  # appends records as they arrive; a rerun sends only the missing ones
        resume_note=f"keeps the records already in {GENERATIONS_FILE} and sends only the "
        "prompts not written yet (failed samples are tried again)",
        retry_setting="generation.endpoints",  # a server that is down or busy
        retries_failed=True,
        plug_ins=("engine",),
        regenerates_turns=True,
    ),
    Stage(
        name="extract",
        output="examples",
        reads=("generations", "prompts"),
        files=(EXAMPLES_FILE, QUALITY_FILE),
        keyed_by=("reasoning", TARGET_TOKENIZER, TARGET_TEMPLATE, TARGET_GENERATION),
    ),
    Stage(
        name="hidden_states",
        output="features",
        reads=("examples",),
        files=(),  # safetensors shards and index.jsonl (eaglet.hidden_states.shards)
        keyed_by=("hidden_states", LAYER_IDS, TARGET_WEIGHTS, "target.dtype"),
        resumes=True,
        resume_note="keeps every finished shard and computes only the samples not in one",
        shown_files=("shard-*.safetensors", "index.jsonl"),
        skipped_online=True,  # online, train computes the features itself
        holds_device=True,  # the target, in-process with the hf backend
        sharded=True,
        plug_ins=("backend",),
    ),
    Stage(
        name="train",
        output="draft",
        reads=("features",),
        files=(),  # the draft folders (eaglet.draft.export) and the training state
        keyed_by=(
            "train",
            TARGET_WEIGHTS,
            TARGET_TOKENIZER,
            TARGET_GENERATION,
        ),  # end tokens: keep_best=tau
        resumes=True,
        resume_note=f"resumes training from the last checkpoint in {TRAIN_STATE_FOLDER}/",
        shown_files=(f"{DRAFT_FOLDER}/ (+ sglang,", "speculators exports)", LOSS_PLOT_FILE),
        read_later=(f"{DRAFT_FOLDER}/*",),  # not the timings, plot, state or other exports
        reads_online=("examples",),
        # Online, train computes the features itself: what decides them is keyed here.
        keyed_by_online=(LAYER_IDS, "target.dtype"),
        holds_device=True,
        plug_ins=("method",),  # the draft's network, objective and exports
        plug_ins_online=("backend",),  # online, train computes the features itself
    ),
    Stage(
        name="evaluate",
        output="report",
        reads=("draft", "prompts"),
        files=(REPORT_FILE,),
        keyed_by=("evaluate", *TARGET_PART_OF),
        shown_files=(ACCEPTANCE_PLOT_FILE,),
        holds_device=True,  # the target and the draft
        plug_ins=("method",),  # how the draft proposes tokens
        evaluates=True,
    ),
)

STAGES: tuple[str, ...] = tuple(stage.name for stage in STAGE_LIST)
StageName = Literal[STAGES]  # type: ignore[valid-type]  # the same names, for forms and CLIs
# A form's "refresh from" choice: a stage, or "" (blank) for none, so the form needs no toggle.
RefreshFrom = Literal[("",) + STAGES]  # type: ignore[valid-type]
STAGE = {stage.name: stage for stage in STAGE_LIST}
PRODUCER = {stage.output: stage.name for stage in STAGE_LIST}  # output name -> stage name


def upstream_names(stage: str) -> tuple[str, ...]:
    """Every output `stage` can read (offline or online), in a fixed order."""
    spec = STAGE[stage]
    return spec.reads + tuple(n for n in spec.reads_online or () if n not in spec.reads)
