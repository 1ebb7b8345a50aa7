"""Cache keys: what makes a stage's output reusable, and nothing else.

key(stage) = hash(the stage's config subset, what the upstream stages wrote (their files'
content hashes, `Manifest.output_hash`: never their keys, so an edit that re-runs a stage but
changes none of its bytes stops there), the code hash of the stage). The code hash covers
the source of every module of the project (packages `eaglet` and `eaglet_prefect.tasks`) that
the stage's task module imports, directly or through others: the import closure, computed by
parsing the imports (`ast`, function-local and relative imports included, with the package
`__init__` modules they run), never a hand-kept list.
Imports of other packages (torch, transformers, site-packages) are not followed. A module's
file is its name's path under ROOT (`eaglet_prefect/tasks/train.py`: in a clone a symlink's
way to `tasks/train.py`, in the wheel the file itself). Files are hashed by content and module
name, never by path, so an edited file changes the key and the same file reached another way
(through the link or not, a clone or the wheel) does not.

Left out of every closure: modules whose content never decides what a stage writes
(`NOT_OUTPUT`): the config, the parts its sections are made of and the sections declared
beside the backends and methods they configure (a stage is keyed by its config subset,
`stage_config`, instead: a training setting must not re-run generation), the pre-flight
canary and the preflight (they can stop a run, never change a record), the run report, the
error classes, why a stage runs (`stage_reasons`) and this module (the keys themselves).
The generate stage also hashes the closure of the configured engine's module, and only that
engine's (from the engine registry): a fix to the HTTP client does not re-key what the local
engine generated. Likewise the hidden_states stage (and train, online) the chosen hidden-state
backend's module, and train and evaluate the chosen draft method's.

A refactor that moves code without changing what any stage writes declares the new source of
each module it edited keyed as the old (`KEYED_AS`), so every key stays and a user's next run
sends no prompt again; the module's next edit keys as any edit does.
"""

from __future__ import annotations

import ast
import hashlib
import subprocess
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from eaglet.config import (
    FLAT_BACKEND_KEYS,
    EvaluateConfig,
    HiddenStatesConfig,
    PipelineConfig,
    TrainConfig,
)
from eaglet.config_fields import is_cache_neutral
from eaglet.draft.methods import DEFAULT_METHOD, METHODS
from eaglet.engines.registry import engine_spec
from eaglet.fingerprints import file_fingerprint, model_fingerprint, target_parts
from eaglet.hidden_states.backends import BACKENDS
from eaglet.stages import LAYER_IDS, STAGE, STAGES, TARGET_PART_OF, PlugIn
from eaglet.storage import Manifest, canonical_json, sha256_file

ROOT = Path(__file__).resolve().parents[1]
# The packages whose source keys a stage, each in the folder its name spells under ROOT.
PROJECT_PACKAGES = ("eaglet", "eaglet_prefect.tasks")
NOT_OUTPUT = frozenset(
    {
        "eaglet.config",
        "eaglet.config_fields",  # what config sections are made of (a backend's too)
        # the settings of the backends and of the block drafters, sections of the config
        "eaglet.hidden_states.backends.settings",
        "eaglet.draft.methods.settings",
        "eaglet.cache",
        "eaglet.canary",
        "eaglet.preflight",  # checks before a run (a backend's call it): they never write
        "eaglet.run_report",
        "eaglet.errors",
        "eaglet.fingerprints",  # what a stage reads from outside, fingerprinted for its key
        "eaglet.stage_reasons",  # says why a stage runs, never what it writes
        "eaglet.report_figures",  # the run report's figures and formats
    }
)  # a package's name stands for its modules too (eaglet.config.train): `is_not_output`


def is_not_output(module: str) -> bool:
    """Whether `module` is left out of every closure: a `NOT_OUTPUT` module or package, or a
    module of such a package (`eaglet.config.train`, `eaglet.preflight.target`)."""
    return any(module == name or module.startswith(name + ".") for name in NOT_OUTPUT)


def module_file(module: str, root: Path = ROOT) -> Path | None:
    """The source file of a project module (`pkg/mod.py` or `pkg/mod/__init__.py`), with
    symlinks resolved (the file a reader edits: `tasks/train.py` in a clone), None for a name
    outside the project or one that is not a module (an attribute)."""
    if not any(module == p or module.startswith(p + ".") for p in PROJECT_PACKAGES):
        return None
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.resolve()
    return None


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute name an `ImportFrom` refers to (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    package = parts if is_package else parts[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _with_parents(name: str) -> list[str]:
    """`a.b.c` and the packages importing it runs first: `a`, `a.b`."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


# Statement lists an import can sit in: module, function and class bodies, if/for/while/with,
# try (its handlers, else and finally) and match cases.
_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


def _import_statements(statements: list[ast.stmt]):
    for node in statements:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        for block in _BLOCKS:
            yield from _import_statements(getattr(node, block, None) or [])


@cache
def _imports_in(path: Path, module: str, root: Path, stamp: tuple[int, int]) -> frozenset[str]:
    """`project_imports` of one file version (`stamp`: its mtime and size): each file is parsed
    once per process until it changes."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in _import_statements(tree.body):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = _absolute(module, node, path.name == "__init__.py")
            # `from pkg import name`: name is a submodule or an attribute of pkg
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            found.update(m for m in _with_parents(name) if module_file(m, root) is not None)
    found.discard(module)
    return frozenset(found)


def project_imports(module: str, root: Path = ROOT) -> set[str]:
    """Project modules `module` imports anywhere in its source (function bodies included),
    with the packages whose `__init__` those imports run."""
    path = module_file(module, root)
    if path is None:
        return set()
    stat = path.stat()
    return set(_imports_in(path, module, root, (stat.st_mtime_ns, stat.st_size)))


def import_closure(
    roots: tuple[str, ...], root: Path = ROOT, skip: frozenset[str] = frozenset()
) -> tuple[str, ...]:
    """The roots and every project module they import, transitively, except `NOT_OUTPUT`
    and `skip` (which are not followed either), sorted."""
    seen: set[str] = set()
    todo = [m for r in roots for m in _with_parents(r) if module_file(m, root) is not None]
    while todo:
        module = todo.pop()
        if module in seen or is_not_output(module) or module in skip:
            continue
        seen.add(module)
        todo.extend(project_imports(module, root) - seen)
    return tuple(sorted(seen))


# A registry a stage plugs into (`Stage.plug_ins`) -> the module of the entry a config chooses:
# the configured engine's (none without a config: `pipeline_code_version`), the hidden-state
# backend's (what computes the features), the draft method's (its layers, network, files).
PLUG_IN_MODULE: dict[PlugIn, Callable[[PipelineConfig | None], str | None]] = {
    "engine": lambda c: engine_spec(c.generation.engine).module if c is not None else None,
    "backend": lambda c: BACKENDS[c.hidden_states.backend if c is not None else "hf"],
    "method": lambda c: METHODS[c.train.method if c is not None else DEFAULT_METHOD],
}


def stage_modules(stage: str, config: PipelineConfig | None = None) -> tuple[str, ...]:
    """The modules whose source decides a stage's output: the import closure of its task
    module `tasks/<stage>.py` (which imports the stage's body, `eaglet/stage_bodies/<stage>.py`)
    and of the entries it plugs in (`Stage.plug_ins`: the configured engine, backend, draft
    method)."""
    spec = STAGE[stage]
    roots: tuple[str, ...] = (task_module(stage),)
    for kind in spec.code_plug_ins(config):
        module = PLUG_IN_MODULE[kind](config)
        roots += (module,) if module is not None else ()
    skip: frozenset[str] = frozenset()
    if spec.regenerates_turns and (config is None or config.tokenize.regenerate != "all"):
        # Turn-by-turn regeneration (and through it the reasoning split) decides the output
        # only with regenerate=all: a fix to extraction must not re-run generation.
        skip = frozenset({"eaglet.turns"})
    if "method" not in spec.code_plug_ins(config):
        # what such a stage reads of a draft method, its layers, keys it by value (LAYER_IDS)
        skip |= method_modules()
    return import_closure(roots, skip=skip)


@cache
def method_modules(root: Path = ROOT) -> frozenset[str]:
    """The draft-method package and its modules (`eaglet.draft.methods`)."""
    package = "eaglet.draft.methods"
    folder = root.joinpath(*package.split("."))
    return frozenset({package} | {f"{package}.{p.stem}" for p in folder.glob("[!_]*.py")})


def task_module(stage: str) -> str:
    """The module of a stage's Prefect task, the root of its code (`tasks/<stage>.py`)."""
    return f"eaglet_prefect.tasks.{stage}"


# The sha256 of a module's source -> the sha256 it is keyed as: a source that writes what an
# earlier one wrote, keyed as that one. Each entry is reviewed with the refactor that adds it
# and holds for that exact source only (a test fails on an entry no module's source has).
KEYED_AS: dict[str, str] = {
    # prefect_secret moved to eaglet_prefect/blocks.py, so that `eaglet doctor` reads a secret
    # without a task module; generation_api_key takes the reading function (issue 50): in
    # order, eaglet_prefect.tasks.context, eaglet.stage_context, eaglet.stage_bodies.generate (and
    # the last group's edits)
    "d4f93467b20ed39cc9c7f8460c404ac4b531bcdf4839cc072e458a57c7930612":
    "f1026f79259dda0228f27db94610d8a5d6e9e32cb31f17bfd3a827c582b03bf7",
    "e20b31724f2d08a747cbe7c3e821480e61ab4049f2e344e2863f7fdd70ee9a21":
    "c34253e53612b4f5fdf98e99242e9f3f5838c22b8f15d23af3ca19bcd7f271bf",
    "025758059bb64761f232cf11e14c1da8c6208cc7cc045e710be0523449025f97":
    "8b5a12abfc9f597bed2fb05bacb95f9e882f68d4c2cabdb137b1d07f7836fd2d",
    # Figures and reuse estimates left the declaration for `FIGURES` and `REUSE_ESTIMATES`, and
    # `percent` moved with the figures, out of the run report (issue 50): eaglet.stages,
    # eaglet.stage_bodies.extract (and the next group's edits)
    "f194e0cf084cf10805e141290cba5b7ad014fbfbf35873dd8fb7d55b7154238a":
    "16cedb8b7d6f70996a04c1af87e16ab41e257a22e06371e3fddbc420ec58f56a",
    "9fec3a0f56be79dcdda9bd6f581ee4f6ca84f7af5b934e3e65ee3b437a4a4229":
    "e7ac3feb7b3a6afd144ce45196e55e17464686d5ce0111d13c8be3274dc2d1d8",
    # Single-use helpers folded into their one caller, unused fields, parameters and properties
    # removed, an import list on one line: the same records, files and messages (issue 50). In
    # order: eaglet.cpu_threads, eaglet.draft.{checkpoint, engine_check, evaluate, heldout_tau,
    # init_from, ledger, methods.block, methods.eagle3_exports, methods.loss, model_card, nodes,
    # serving, train, vocab}, eaglet.engines.http, eaglet.generation, eaglet.hidden_states.stage,
    # eaglet.shutdown, eaglet.stage_bodies.evaluate, eaglet.storage, eaglet.turns
    "acfef8854e161395adf901a21425edefde5df0af7c03acf2bae976e9e45c2cdc":
    "1adc98e86193d32fe35e167f7df2caf72f4be319fc5d612fb079c49d491fe024",
    "3a49f5d169acb19cacacf732407a56704c81b2e6eb2e85ba5e84f84bbc9cae6b":
    "56f2c3503e9ac4b4cabb277c8f8c7a76ba53abd779e7827688430dcddfbdd492",
    "019cf693b14a6ea8fe9869011f6080237296498da10c6c3738693f3de006baf8":
    "3df9d73c0188abf8ca95b219762bd64cc657278afdcccebaae7d6f4494e24362",
    "4532a9cb1ecf20d760985350d1a89b6acd64d41231229a5681e8a6f1ef497b62":
    "1635bee9d220a9ccad4822ad23022ccea2c69f93187b5a5d8858687c726b0ff8",
    "7bd676e16a5efb6541fcbcc5a5afad05419d5e9463577c3c4d631eb4410a5ef8":
    "d21fe7bf4b60a62aef0481094c96343c5cae14931dd887d8d267210890baa757",
    "1dadb3545011c64249d0423c56d8a4dd3795082f0a05789c3166a0ab91d2682b":
    "0f82e9ade6959bec2ac8a111d852b0fe2fb1443dc64c0efdad811200a99a8963",
    "31b3dec804c652f942edcd67e4646e7f878f0b0a4312a516e2f751d2ebfdb497":
    "da63c9ca37c767ff13e553a4753b1ec031487ab8c308ce0df2dba23b4388aa96",
    "570c4c55846a0919991707ca405add5fe5798df5fc84b587613f194d657a39a8":
    "98076a4811e8ad1dd6390e399e381a3cbc90a6bedd9aa4fa89fbd887bd42f246",
    "b87302442842de0878692c7b515271550fb5cbe9b5bad2c885bebf7de9938ea5":
    "af1e5efa0807537943dd1557511d729f6932663449cda29048a4c978a18e8cad",
    "f808c98b472a5d0024a22d62bc9cd631e650b5a4c6c9aa82fded4fe91adca9ea":
    "680fa050c9a6450f36b3102fb1fd55a754310b898468a189e5ecd86bcc9d7c55",
    "4540caaf007ff791c484f110e1b2d302330838bcdf1257e4ae0529618d161dbe":
    "a07fe955a4abafbc1f86b523f3314572bb40ab8a20de50cdb2a5e0aed115882a",
    "104b97c31ddbb662725863f2cbd082494f57ba92058ff1c34cb4a729c39daeab":
    "78f3aa0d217fadd56f97c3e38b7cd424101a742d4156d4163ba31aa1f3094f93",
    "5664fa56e7e5bca50b39204666dad80c0a806daeed04546f0cb8b6201e02a203":
    "fabfd5da631e1ccfaf2aa214d65b80c1d95ab666d6280563763cef6ef7aaba24",
    "5c4f947604777e60f73edfc66f232a7c7386f0119008437fdc71d3eeb444f96d":
    "612aad645458b47b2c599f707e6c028d31b039cc2a060d93b8880f5da0d02fc2",
    "687881942c9f83b3c68ac8b618fd5eda5d777511bc54ed3f1b35aad34e053e32":
    "ad2fb58c63124b77407d4dba8625bdf3c3caffea94371224a50074b6d7aa06e5",
    "ce390a59ddbf597d7e6a6e8f1c7e4c8adad9f3b3a32288efa1ecdb9c23c27299":
    "3dcf2a22f67ddb04302f23d4e536e57e6fcf3e81437b66f549dbbdcd110a7cc4",
    "45e8d3bfbb61fe32561ce341da3b9cc7b4d494b6e2326f836b37fa516e9e94a9":
    "7a6e89055e8626336267ac5839e47bf86c79a540715971ffe24165c0beed1d2e",
    "f213d3d8528cefd0bb9bcee93c8ebf5c3f723618ac4a03f1e5c77986b4195ca0":
    "07edc54d6cf0fc6bdc058233fe8d178ff47806d59531e4e07780a0a9aba74e45",
    "a920ce64c9ea1fe4a7f7b4611e2561b55052c4e2d66abd2960e332bf4ac44d45":
    "ab90a59e4d7ace4804d801367eaf0a4e912038e47081644b1b6f92d6d8f9d49e",
    "17add4d55910a358f1a7ee92be5372f3bf702e141e601372a4b103ea09d9368b":
    "3f5ece773f37277dafb2135e125e9b683273d7401365b9ee6420f68e0e424284",
    "8d3612fef923cff9cfb5aca26c7b5398f4af36c7f8f072a9cb21bcfedc926481":
    "664a0935461341c14248114e3dc606ae217128a77418d18935c6cb7c38409d7d",
    "64e0a4a816200d47dae7b8f04422c494f8ba3b894c524a7efcc2fb79cebdc39f":
    "9244889caf2e9260526d64904718a4d0afaa3caeee18d2451e7f459f697f8bc0",
    # The vLLM server check, once, in the preflight (`check_vllm_server`): the same messages
    # (issue 50): eaglet.hidden_states.backends.vllm
    "2fa4301b4e17db16916255e2bd2113da34aabcc3e664142846e08d453a9223da":
    "c5513991e0943b7b23c697d994644b21eb858e696e1c61450005938d335f85dd",
}  # fmt: skip


def module_source_hash(module: str, root: Path = ROOT) -> str:
    """The sha256 of a module's source, or the one it is keyed as (`KEYED_AS`)."""
    path = module_file(module, root)
    if path is None:
        raise ModuleNotFoundError(f"{module} is not a module of this project: cannot hash it")
    source = sha256_file(path)
    return KEYED_AS.get(source, source)


def code_modules(stage: str, config: PipelineConfig | None = None) -> dict[str, str]:
    """Each module of the stage's code (`stage_modules`) -> the sha256 of its source."""
    return {module: module_source_hash(module) for module in stage_modules(stage, config)}


def code_hash(stage: str, config: PipelineConfig | None = None) -> str:
    digest = hashlib.sha256()
    for module, source in code_modules(stage, config).items():
        digest.update(f"{module}:{source}\n".encode())
    return digest.hexdigest()


def keyed_fields(model: BaseModel) -> dict[str, Any]:
    """A config section's values but its cache-neutral fields (`eaglet.config.cache_neutral`):
    what can change a stage's output."""
    neutral = {name for name, f in type(model).model_fields.items() if is_cache_neutral(f)}
    return model.model_dump(exclude=neutral)


def hidden_states_keyed(settings: HiddenStatesConfig) -> dict[str, Any]:
    """`hidden_states`'s keyed fields as they were keyed before each backend had its section
    (issue 35), so that no key moved with them: the keys older configs wrote in hidden_states
    itself (`eaglet.config.FLAT_BACKEND_KEYS`) flat, for every backend, as then; any other keyed
    field of the chosen backend's section under the section's name (a backend added later
    never re-keys a run of another)."""
    value = keyed_fields(settings)
    for name in BACKENDS:
        del value[name]  # dumped whole; keyed here by its own keyed fields
        section = keyed_fields(getattr(settings, name))
        for key in [k for k in section if FLAT_BACKEND_KEYS.get(k) == name]:
            value[key] = section.pop(key)
        if section and name == settings.backend:
            value[name] = section
    return value


# The method sections `train` keyed whole before each method's section was keyed with its
# method only (issue 49): kept so that no key moved. A section added later is keyed when its
# method is the one trained (a method added later never re-keys a run of another).
KEYED_METHOD_SECTIONS = ("dflash",)


def train_keyed(settings: TrainConfig) -> dict[str, Any]:
    """`train`'s keyed fields, another method's section (but `KEYED_METHOD_SECTIONS`) left out,
    and what only a starting draft reads (`init_from_vocab`) only with one."""
    value = keyed_fields(settings)
    for name in METHODS:
        if name in value and name != settings.method and name not in KEYED_METHOD_SECTIONS:
            del value[name]
    if not settings.init_from:
        value.pop("init_from_vocab", None)
    return value


def keyed_value(config: PipelineConfig, path: str) -> Any:
    """The value a stage key holds for the dotted config path `path` (`eaglet.stages`): model
    folders (the target, train.init_from's draft) and local dataset files by content, config
    sections by their keyed fields."""
    if path in TARGET_PART_OF:  # the part of the target's folder the stage reads
        parts = target_parts(config.target.model, config.target.revision, config.work_dir)
        return parts[TARGET_PART_OF[path]]
    if path == "datasets":
        return [
            {**d.model_dump(exclude={"path"}), "content": file_fingerprint(d.path)}
            for d in config.datasets
        ]
    if path == LAYER_IDS:  # the layers the method reads (its default resolved), not its code
        target_config = Path(config.target.model) / "config.json"
        if not target_config.is_file():  # a hub id, or not there yet: what resolves them
            return {"aux_layer_ids": config.hidden_states.aux_layer_ids,
                    "method": config.train.method}  # fmt: skip
        from eaglet.hidden_states.layers import layer_ids_of
        from eaglet.target import load_config

        return layer_ids_of(config, load_config(config.target).num_hidden_layers)
    if path == "target.dtype":  # what `auto` picks on this machine
        from eaglet.target import target_dtype

        return target_dtype(config.target)
    value: Any = config
    for name in path.split("."):
        value = getattr(value, name)
    if isinstance(value, EvaluateConfig):  # its sets by content, as datasets are
        return {
            **keyed_fields(value),
            "sets": [
                {**s.model_dump(exclude={"path"}), "content": file_fingerprint(s.path)}
                for s in value.sets
            ],
        }
    if isinstance(value, HiddenStatesConfig):  # its backends' sections as before them
        return hidden_states_keyed(value)
    if isinstance(value, TrainConfig):
        keyed = train_keyed(value)
        if value.init_from:  # the draft it starts from, by content
            keyed["init_from"] = model_fingerprint(value.init_from, work_dir=config.work_dir)
        return keyed
    return keyed_fields(value) if isinstance(value, BaseModel) else value


def stage_config(stage: str, config: PipelineConfig) -> dict[str, Any]:
    """The part of the configuration that can change a stage's output (and so its key)."""
    return {path: keyed_value(config, path) for path in STAGE[stage].key_paths(config)}


def stage_key(stage: str, config: PipelineConfig, upstream: list[Manifest]) -> str:
    payload = {
        "stage": stage,
        "config": stage_config(stage, config),
        "upstream": sorted(m.output_hash() for m in upstream),
        "code": code_hash(stage, config),
    }
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:20]


def pipeline_code_version(root: Path = ROOT) -> str:
    """What code a deployment runs: the hash of every stage's modules, and the git commit with
    `+modified` when the project's tracked files differ from it (a deployment's version that
    stayed the commit while edited code ran told nobody)."""
    digest = hashlib.sha256("".join(code_hash(stage) for stage in STAGES).encode())
    version = f"code {digest.hexdigest()[:12]}"
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):  # not a clone (an installed wheel)
        return version
    return f"{head}{'+modified' if dirty else ''} {version}"
