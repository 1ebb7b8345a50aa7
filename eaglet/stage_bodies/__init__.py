"""The work of each stage, written against `eaglet.stage_context.StageContext` so that it runs
and is tested without Prefect: one module per stage (so a stage's cache key covers its own body
only), each a `run(ctx, config, inputs, folder)` declared in `eaglet.stages`."""
