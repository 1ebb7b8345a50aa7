"""Time the demo from nothing, then again (every stage Cached), and print the ratio.

    python benchmarks/demo_rerun.py [--work-dir DIR]

Both runs are measured in this one process tree on the same machine, so the ratio holds even
when the machine is shared and slow. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed_demo(work_dir: Path) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "eaglet_prefect.flows.cli", "demo", "--work-dir", str(work_dir)],
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"demo failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return seconds, result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="eaglet-bench-")) / "demo"
    if work_dir.exists():
        shutil.rmtree(work_dir)
    first, first_out = timed_demo(work_dir)
    second, _ = timed_demo(work_dir)
    states = json.loads((work_dir / "run.json").read_text())["stages"]
    print(first_out)
    print(f"first run (fixture build + all stages): {first:.1f} s")
    print(f"second run:                             {second:.1f} s")
    print(f"rerun / first run:                      {second / first:.1%}")
    print("second run states: " + ", ".join(f"{s}={v['state']}" for s, v in states.items()))


if __name__ == "__main__":
    main()
