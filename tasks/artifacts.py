"""What the stage tasks show in the Prefect UI besides logs: plots as image artifacts the run
page displays, described with the path they will have once the stage finishes."""

from __future__ import annotations

import base64
from pathlib import Path

from prefect.artifacts import create_image_artifact

from eaglet.storage import final_path

# A plot is sent inline (a data: URL): the browser showing the UI may not reach the machine
# that holds the work dir. Larger plots are named by path only.
MAX_INLINE_BYTES = 2 << 20


def publish_plot(path: Path, key: str, description: str) -> None:
    """The PNG at `path` (in a stage's `.partial` folder) as an image artifact; its
    description names the file where it will be once the stage finishes."""
    final = final_path(path)
    if not path.is_file() or path.stat().st_size > MAX_INLINE_BYTES:
        return
    data = base64.b64encode(path.read_bytes()).decode()
    create_image_artifact(
        image_url=f"data:image/png;base64,{data}", key=key, description=f"{description} ({final})"
    )
