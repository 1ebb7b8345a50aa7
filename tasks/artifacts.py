"""What the stage tasks show in the Prefect UI besides logs: plots as markdown artifacts that
embed the picture (an image artifact also prints its whole data: URL below it, an overflowing
line of base64), described with the path they will have once the stage finishes."""

from __future__ import annotations

import base64
from pathlib import Path

from prefect.artifacts import create_markdown_artifact

from eaglet.storage import final_path

# A plot is sent inline (a data: URL): the browser showing the UI may not reach the machine
# that holds the work dir. Larger plots are named by path only.
MAX_INLINE_BYTES = 2 << 20


def publish_plot(path: Path, key: str, description: str) -> None:
    """The PNG at `path` (in a stage's `.partial` folder) as a markdown artifact that shows it;
    it and its description name the file where it will be once the stage finishes."""
    final = final_path(path)
    if not path.is_file() or path.stat().st_size > MAX_INLINE_BYTES:
        return
    data = base64.b64encode(path.read_bytes()).decode()
    create_markdown_artifact(
        f"![{description}](data:image/png;base64,{data})\n\nFile: `{final}`\n",
        key=key,
        description=f"{description} ({final})",
    )
