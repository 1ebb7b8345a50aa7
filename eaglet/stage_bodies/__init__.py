"""The work of each stage, written against `eaglet.stage_context.StageContext` so that it runs
and is tested without Prefect: one module per stage (so a stage's cache key covers its own body
only), each a `run(ctx, config, inputs, folder)` that its task module `tasks/<stage>.py`
imports (`every_stage` imports them all, for runs without Prefect)."""
