"""Serve eaglet's deployments from one process: the whole pipeline and generation alone.

    python deployments/serve.py        (or: eaglet serve)

Runs started from the Prefect UI or API execute in this process. For a work pool setup use
`deployments/prefect.yaml` instead.
"""

from __future__ import annotations

from prefect import serve

from flows.pipeline import pipeline


def main() -> None:
    serve(
        pipeline.to_deployment(
            name="pipeline",
            description="The whole pipeline: download to evaluate.",
            tags=["eaglet"],
        ),
        pipeline.to_deployment(
            name="generate-only",
            description="Download, tokenize and generate; stops before extraction.",
            parameters={"until": "generate"},
            tags=["eaglet", "generation"],
        ),
    )


if __name__ == "__main__":
    main()
