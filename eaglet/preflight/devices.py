"""`target.device`, `train.device`, `target.dtype`, `train.precision`: a CUDA device asked
for where torch sees none is a problem; a dtype the device computes slowly (bfloat16 on a
CPU without bfloat16 units, read from /proc/cpuinfo) a warning, float16 on the CPU a
problem.
"""

from __future__ import annotations

from pathlib import Path

from eaglet.config.pipeline import PipelineConfig
from eaglet.preflight.report import PreflightReport

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bf16 units


def cpu_has_bf16_units(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether the CPU computes in bfloat16 natively (Linux's CPU flags); None when unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), None)  # fmt: skip
    return None if flags is None else any(flag in flags for flag in CPU_BF16_FLAGS)


def check_devices(
    config: PipelineConfig, report: PreflightReport, bf16_units: bool | None = None
) -> None:
    """A CUDA device asked for where torch sees none fails now, not at the stage that uses it;
    a dtype the device computes slowly is a warning (`bf16_units`: whether the CPU has
    bfloat16 units, read from /proc/cpuinfo when not given)."""
    import torch

    settings = {"target.device": config.target.device, "train.device": config.train.device}
    for setting, device in settings.items():
        if device.startswith("cuda") and not torch.cuda.is_available():
            report.problems.append(
                f"{setting}={device}: torch sees no CUDA device on this machine "
                f"(torch {torch.__version__}); use cpu, or auto for the GPU when there is one"
            )
    on_cpu = {
        setting: device == "cpu" or device == "auto" and not torch.cuda.is_available()
        for setting, device in settings.items()
    }
    bf16_units = cpu_has_bf16_units() if bf16_units is None else bf16_units
    slow_bf16 = (
        "this CPU has no bfloat16 units (no avx512_bf16 or amx_bf16 among its flags): torch "
        "emulates bfloat16 on it, often a hundred times slower than float32"
    )
    from eaglet.target import target_dtype

    dtype = target_dtype(config.target)  # what auto picks never warns
    if on_cpu["target.device"] and dtype == "bfloat16" and bf16_units is False:
        report.warnings.append(f"target.dtype=bfloat16 on the CPU: {slow_bf16}; use float32")
    if on_cpu["target.device"] and dtype == "float16":
        report.problems.append(
            "target.dtype=float16 on the CPU: the CPU has no float16 arithmetic (slow, "
            "float16's range overflows, and evaluate's float32 draft cannot read float16 "
            "states); use float32 (or auto), or bfloat16 on a CPU with bfloat16 units"
        )
    if on_cpu["train.device"] and config.train.precision == "bfloat16" and bf16_units is False:
        report.warnings.append(f"train.precision=bfloat16 on the CPU: {slow_bf16}; use float32")
