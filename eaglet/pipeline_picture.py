"""The README's picture of the pipeline, drawn from the stage list (`eaglet.stages`) and the
engine registry as an SVG, so the picture cannot drift from the code.

    python -m eaglet.pipeline_picture pipeline.svg

One box per stage, in order, with the files it writes; an arrow for every output a stage reads
(a curve above the row when it skips stages, dashed when only `train.hidden_states: online`
reads it); the engines that plug into generate and the hidden-state backends below their stage.
"""

from __future__ import annotations

import sys
from html import escape
from pathlib import Path

from eaglet.engines.registry import ENGINES
from eaglet.hidden_states.backends import BACKENDS
from eaglet.stages import PRODUCER, STAGE_LIST, STAGES, upstream_names

BOX_W, BOX_H, GAP, TOP, LEFT = 150, 96, 34, 130, 20
FONT = 'font-family="DejaVu Sans, Arial, sans-serif"'
# The registries listed below a stage that plugs them in (`Stage.plug_ins`; the draft methods
# are not pictured).
PICTURED_PLUG_INS = {
    "engine": ("engines", tuple(ENGINES)),
    "backend": ("backends", tuple(BACKENDS)),
}


def _x(index: int) -> int:
    return LEFT + index * (BOX_W + GAP)


def _text(x: float, y: float, text: str, size: int = 12, weight: str = "normal") -> str:
    return (
        f'<text x="{x:.0f}" y="{y:.0f}" {FONT} font-size="{size}" font-weight="{weight}" '
        f'text-anchor="middle">{escape(text)}</text>'
    )


def _stage_box(index: int) -> list[str]:
    spec = STAGE_LIST[index]
    x, middle = _x(index), _x(index) + BOX_W / 2
    parts = [
        f'<rect x="{x}" y="{TOP}" width="{BOX_W}" height="{BOX_H}" rx="8" fill="#eef4ff" '
        'stroke="#3b6fd4" stroke-width="1.5"/>',
        _text(middle, TOP + 20, spec.name, 14, "bold"),
    ]
    files = tuple(spec.files) + spec.shown_files
    for line, name in enumerate(files[:4]):
        parts.append(_text(middle, TOP + 40 + 14 * line, name, 11))
    pictured = [PICTURED_PLUG_INS[kind] for kind in spec.plug_ins if kind in PICTURED_PLUG_INS]
    for row, (label, names) in enumerate(pictured):
        y = TOP + BOX_H + 50 + 14 * row
        parts.append(
            f'<line x1="{middle}" y1="{y - 14}" x2="{middle}" y2="{TOP + BOX_H}" '
            'stroke="#888" stroke-dasharray="3,3"/>'
        )
        parts.append(_text(middle, y, f"{label}: {', '.join(names)}", 11))
    return parts


def _read_arrow(source: int, target: int, online_only: bool) -> str:
    dash = ' stroke-dasharray="6,4"' if online_only else ""
    if target == source + 1:
        x1, x2, y = _x(source) + BOX_W, _x(target), TOP + BOX_H / 2
        return (
            f'<line x1="{x1}" y1="{y}" x2="{x2 - 2}" y2="{y}" stroke="#333" '
            f'stroke-width="1.5" marker-end="url(#arrow)"{dash}/>'
        )
    x1, x2 = _x(source) + BOX_W / 2, _x(target) + BOX_W / 2
    lift = 22 + 14 * (target - source)
    arc = (
        f'<path d="M {x1} {TOP} C {x1} {TOP - lift}, {x2} {TOP - lift}, {x2} {TOP - 2}" '
        f'fill="none" stroke="#333" stroke-width="1.2" marker-end="url(#arrow)"{dash}/>'
    )
    if online_only:  # the apex of the curve is at 3/4 of the lift
        arc += _text((x1 + x2) / 2, TOP - lift * 0.75 - 5, "train.hidden_states: online", 11)
    return arc


def draw() -> str:
    """The SVG text of the pipeline picture."""
    width = _x(len(STAGE_LIST)) - GAP + LEFT
    height = TOP + BOX_H + 95
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto"><path d="M 0 0 L 10 5 L 0 10 z" fill="#333"/></marker>'
        "</defs>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        _text(
            width / 2,
            22,
            "one Prefect flow: each stage a cached task writing WORK_DIR/<stage>/<key>/ "
            "(key: its config, upstream manifests, its code)",
            13,
        ),
    ]
    for index in range(len(STAGE_LIST)):
        parts += _stage_box(index)
    for index, spec in enumerate(STAGE_LIST):
        for output in upstream_names(spec.name):
            online_only = output not in spec.reads
            parts.append(_read_arrow(STAGES.index(PRODUCER[output]), index, online_only))
    parts.append(
        _text(
            width / 2,
            height - 8,
            "before the first stage: the preflight (eaglet doctor); before generating: the "
            "canary; extract ends at its quality gate",
            11,
        )
    )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m eaglet.pipeline_picture OUT.svg", file=sys.stderr)
        return 2
    Path(args[0]).write_text(draw())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
