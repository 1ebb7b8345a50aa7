"""`datasets`: the list is not empty; each local file exists, is a file, is not empty and
holds rows (counted where cheap: a JSONL's lines, a Parquet file's metadata); each hub
dataset is found (`eaglet.preflight.hub`).
"""

from __future__ import annotations

from pathlib import Path

from eaglet.config.pipeline import PipelineConfig
from eaglet.local_paths import is_hub_dataset
from eaglet.preflight.hub import hub_dataset_problem
from eaglet.preflight.report import PreflightReport, first_line


def count_rows(path: Path) -> int | None:
    """Rows of a local dataset file, cheaply (lines of a JSONL, Parquet metadata); None when
    not cheap to know."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return None


def check_datasets(config: PipelineConfig, report: PreflightReport) -> list[int | None]:
    """Rows per dataset (its limit, or counted; None unknown)."""
    if not config.datasets:
        report.problems.append(
            "datasets: the list is empty: add at least one {source, path} to regenerate"
        )
        return []
    rows: list[int | None] = []
    for i, spec in enumerate(config.datasets):
        key = f"datasets[{i}] (source {spec.source!r})"
        if is_hub_dataset(spec.path):
            problem = hub_dataset_problem(key, spec.path, spec.revision)
            if problem:
                report.problems.append(problem)
            else:
                report.passed.append(f"{key}: hub dataset {spec.path} (read by the download stage)")
            rows.append(spec.limit)
            continue
        path = Path(spec.path)
        if not path.exists():
            report.problems.append(
                f"{key}: file {path} not found (resolved: {path.resolve()}): fix datasets[{i}].path"
            )
        elif path.is_dir():
            report.problems.append(
                f"{key}: {path} is a folder; datasets[{i}].path must name a .json, .jsonl or "
                ".parquet file"
            )
        elif not path.is_file():  # a named pipe or device: read once, by the download stage
            report.passed.append(f"{key}: {path} (not a regular file; not read here)")
        elif path.stat().st_size == 0 or (
            path.suffix.lower() in (".json", ".jsonl") and not _has_text(path)
        ):
            report.problems.append(
                f"{key}: file {path} is empty: it gives 0 samples; fill it or remove datasets[{i}]"
            )
        else:
            try:
                counted = count_rows(path)
            except Exception as exc:  # a damaged Parquet footer, unreadable file
                report.problems.append(f"{key}: file {path} cannot be read ({first_line(exc)})")
                rows.append(None)
                continue
            if counted == 0:
                report.problems.append(f"{key}: file {path} holds no rows: fill it or remove it")
            n = counted if spec.limit is None or counted is None else min(counted, spec.limit)
            rows.append(n)
            report.passed.append(f"{key}: {path} ({'?' if n is None else n} rows)")
            continue
        rows.append(None)
    return rows


def _has_text(path: Path) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return True
    return False
