"""What it costs to fingerprint a large dataset file by every byte (`eaglet.fingerprints`), and
that a one-byte edit in its middle, size and mtime kept, re-keys `download`.

    python benchmarks/fingerprint.py --gib 10

Writes a JSONL file of GIB GiB (random rows) in a temporary folder, then times: the first
fingerprint (every byte hashed), a second one (the recorded hash taken), and the one after a
same-length edit in the middle with the mtime set back (hashed again). Prints each figure with
the load average, the hashing rate against the raw read rate of the same file (`cat` to
/dev/null, the floor any full hash stands on), and whether the download key moved.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

from eaglet.cache import stage_key
from eaglet.config import load_config
from eaglet.fingerprints import HASH_CACHE_ENV, file_fingerprint


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def write_rows(path: Path, size: int) -> None:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)]
    block = []
    for i in range(2000):
        text = " ".join(rng.choice(words) for _ in range(200))
        block.append(json.dumps({"messages": [{"role": "user", "content": f"{i}: {text}"}]}))
    chunk = ("\n".join(block) + "\n").encode()
    with open(path, "wb") as out:
        written = 0
        while written < size:
            out.write(chunk)
            written += len(chunk)


def timed(what: str, call) -> tuple[float, object]:
    started = time.perf_counter()
    value = call()
    seconds = time.perf_counter() - started
    print(f"{what:<44} {seconds:8.2f} s   (load {loadavg()})")
    return seconds, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        os.environ[HASH_CACHE_ENV] = str(Path(tmp) / "records")
        data = Path(tmp) / "big.jsonl"
        write_rows(data, int(args.gib * 2**30))
        size = data.stat().st_size
        print(f"{data.name}: {size / 2**30:.2f} GiB")
        config = load_config(
            None, [f"work_dir={Path(tmp) / 'work'}", f"datasets=[{{source: big, path: {data}}}]"]
        )
        read_s, _ = timed("raw read (cat > /dev/null)", lambda: subprocess.run(
            ["cat", str(data)], stdout=subprocess.DEVNULL, check=True))  # fmt: skip
        cold_s, before = timed("first fingerprint (every byte)", lambda: file_fingerprint(data))
        key_before = stage_key("download", config, [])
        warm_s, again = timed("second fingerprint (recorded hash)", lambda: file_fingerprint(data))
        assert again == before
        stat = data.stat()
        with open(data, "r+b") as handle:  # one byte in the middle, same length
            handle.seek(size // 2)
            byte = handle.read(1)
            handle.seek(size // 2)
            handle.write(b"#" if byte != b"#" else b"$")
        os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        edit_s, after = timed("after a middle edit, mtime set back", lambda: file_fingerprint(data))
        key_after = stage_key("download", config, [])
        print(
            f"hashing {size / 2**20 / cold_s:.0f} MiB/s against a raw read of "
            f"{size / 2**20 / read_s:.0f} MiB/s (ratio {read_s / cold_s:.2f}); the recorded "
            f"hash {cold_s / max(warm_s, 1e-9):.0f}x faster than hashing"
        )
        moved = "moved" if key_after != key_before and after != before else "DID NOT MOVE"
        print(f"download key {key_before} -> {key_after}: {moved} ({edit_s:.1f} s)")


if __name__ == "__main__":
    main()
