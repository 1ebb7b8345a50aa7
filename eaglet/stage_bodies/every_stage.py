"""Every stage's body in pipeline order, to run stages without Prefect (tests, benchmarks,
scripts): `run_stage_without_prefect`.

Under Prefect each task module imports its own body (`tasks/<stage>.py`); this module imports
them all, and no body or task imports it, so it is in no stage's code key: a fix to one body
re-keys that stage alone.
"""

from __future__ import annotations

from eaglet.config import PipelineConfig
from eaglet.stage_bodies import (
    download,
    evaluate,
    extract,
    generate,
    hidden_states,
    tokenize,
    train,
)
from eaglet.stage_context import StageContext
from eaglet.stage_runner import run_stage_body
from eaglet.stages import STAGES, StageBody
from eaglet.storage import Manifest

# Stage name -> its body (`eaglet/stage_bodies/<stage>.py`, named after its stage); the order
# is the stages' (`eaglet.stages.STAGE_LIST`), and `run_stage_body` refuses a body that is not
# its stage's code.
_BODIES = (download, tokenize, generate, extract, hidden_states, train, evaluate)
BODIES: dict[str, StageBody] = {
    stage: {m.__name__.rsplit(".", 1)[1]: m.run for m in _BODIES}[stage] for stage in STAGES
}


def run_stage_without_prefect(
    stage: str, config: PipelineConfig, inputs: dict[str, Manifest], context: StageContext
) -> Manifest:
    """`eaglet.stage_runner.run_stage_body` with the stage's own body."""
    return run_stage_body(stage, BODIES[stage], config, inputs, context)
