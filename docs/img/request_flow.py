"""Draws docs/img/request_flow.svg, the request flow through the mesh, with plain Python (no dependencies).

`render()` returns the SVG text; `python docs/img/request_flow.py` writes it next to this file. The committed SVG
is this script's output: tests/unit/deploy/test_request_flow_diagram.py regenerates it and compares.
"""

from __future__ import annotations

from pathlib import Path

WIDTH, HEIGHT = 1000, 490
BOXES = {  # name: (x, y, width, height, title, subtitle)
    "client": (20, 200, 130, 70, "client", "OpenAI SDK / curl"),
    "gateway": (250, 200, 170, 70, "gateway", "REST + gRPC, routing"),
    "prefill": (520, 50, 190, 70, "prefill worker", "engine: prompt pass"),
    "decode": (520, 350, 190, 70, "decode worker", "engine: token loop"),
    "cache": (810, 200, 170, 70, "cache service", "memory or Redis"),
}
# (from, its side, to, its side, shift along the sides, dashed, label x, label y, label lines)
ARROWS = (
    ("client", "right", "gateway", "left", -7, False, 20, 185, ("1  POST /v1/chat/completions",)),
    ("gateway", "left", "client", "right", 7, True, 20, 295, ("7  SSE / JSON reply",)),
    ("gateway", "top", "prefill", "left", 0, False, 270, 120, ("2  Prefill(prompt ids)",)),
    ("prefill", "right", "cache", "top", -7, False, 730, 60, ("3  publish blocks, KDA", "snapshots, the handoff")),
    ("cache", "top", "prefill", "right", 7, True, 615, 165, ("snapshot path: cached prefix", "+ KDA snapshot")),
    ("gateway", "bottom", "decode", "left", -7, False, 445, 300, ("4  Decode(handoff id)",)),
    ("decode", "left", "gateway", "bottom", 7, True, 250, 335, ("6  tokens (stream)",)),
    ("cache", "bottom", "decode", "right", 0, False, 800, 355, ("5  claim handoff", "+ blocks")),
)


def _point(name: str, side: str, shift: int) -> tuple[int, int]:
    """The middle of box `name`'s `side`, moved `shift` along that side (up on a left/right side, right on a
    top/bottom one for a negative shift: the two arrows of a pair then run side by side on a diagonal)."""
    x, y, w, h = BOXES[name][:4]
    if side in ("top", "bottom"):
        return x + w // 2 - shift, y if side == "top" else y + h
    return (x + w if side == "right" else x), y + h // 2 + shift


def _box(name: str) -> str:
    x, y, w, h, title, subtitle = BOXES[name]
    return (f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" class="box"/>'
            f'<text x="{x + w // 2}" y="{y + 30}" class="title">{title}</text>'
            f'<text x="{x + w // 2}" y="{y + 52}" class="sub">{subtitle}</text>')


def _arrow(src, src_side, dst, dst_side, shift, dashed, lx, ly, lines) -> str:
    (x1, y1), (x2, y2) = _point(src, src_side, shift), _point(dst, dst_side, shift)
    style = ' stroke-dasharray="6 4"' if dashed else ""
    label = "".join(f'<text x="{lx}" y="{ly + 15 * i}" class="label">{line}</text>' for i, line in enumerate(lines))
    return f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" class="edge"{style} marker-end="url(#head)"/>' + label


def render() -> str:
    style = ("<style>.box{fill:#eef3fb;stroke:#2b4c7e;stroke-width:2}.edge{stroke:#333;stroke-width:1.6}"
             ".title{font:bold 15px sans-serif;text-anchor:middle}.sub{font:12px sans-serif;text-anchor:middle;"
             "fill:#555}.label{font:12px sans-serif;fill:#222}.note{font:12px sans-serif;fill:#444}</style>")
    marker = ('<defs><marker id="head" markerWidth="10" markerHeight="8" refX="9" refY="4" orient="auto">'
              '<path d="M0,0 L10,4 L0,8 z" fill="#333"/></marker></defs>')
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}">', style, marker,
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>']
    parts += [_box(name) for name in BOXES]
    parts += [_arrow(*arrow) for arrow in ARROWS]
    parts.append(f'<text x="20" y="{HEIGHT - 20}" class="note">Short prompts, or no prefill worker: the decode '
                 'worker computes the prompt itself (colocated). A failed handoff load recomputes.</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> None:
    Path(__file__).with_suffix(".svg").write_text(render())


if __name__ == "__main__":
    main()
