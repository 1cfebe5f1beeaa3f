"""What `eval` and `compare` write into `-o DIR`: JSON, JSON Lines, markdown tables and reliability diagrams (PNG,
drawn with Pillow, a dependency already), each written under a temporary name and renamed."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from ..errors import OutputError
from ..outputs import atomic_file

METRICS = ("accuracy", "macro_f1", "nll", "brier", "ece")


def fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def output_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot make the report folder {path}: {e.strerror or e}") from None
    return path


def write_bytes(path: Path, data: bytes, force: bool = False) -> None:
    """`data` into `path`, whole or not at all: a temporary file beside it, fsynced, then given the name
    (outputs.publish: an existing file only replaced with --force)."""
    try:
        with atomic_file(path, force) as tmp, open(tmp, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None


def write_json(path: Path, value: Any, force: bool = False) -> None:
    write_bytes(path, (json.dumps(value, indent=2, ensure_ascii=False, allow_nan=True) + "\n").encode(), force)


def write_jsonl(path: Path, values: Sequence[dict[str, Any]], force: bool = False) -> None:
    write_bytes(path, "".join(json.dumps(v, ensure_ascii=False) + "\n" for v in values).encode(), force)


def errors_section(title: str, errors: Sequence[str], shown: int = 50) -> list[str]:
    """A report's markdown section listing the lines that were not counted (none: no section)."""
    return ["", f"## {title} ({len(errors)})", "", *(f"- {e}" for e in errors[:shown])] if errors else []


def metrics_table(columns: dict[str, dict[str, Any]]) -> list[str]:
    """A markdown table of metrics blocks ({"overall", "per_question"}) side by side, one column per name;
    with two columns, their difference (the second minus the first) too."""
    names = list(columns)
    first = columns[names[0]]
    delta = len(names) == 2
    head = ["question", "n", "metric", *names, *(["delta"] if delta else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for q in ["overall", *sorted(first["per_question"])]:
        blocks = [c["overall"] if q == "overall" else c["per_question"].get(q, {}) for c in columns.values()]
        if not blocks[0]:
            continue
        rows: list[tuple[str, list[Any]]] = [(m, [b.get(m) for b in blocks]) for m in METRICS if m in blocks[0]]
        for tp in blocks[0]["auto_decide"]:
            cov = [(b.get("auto_decide") or {}).get(tp, {}) for b in blocks]
            rows.append((f"auto-decide @ {tp} (threshold)", [(c.get("coverage"), c.get("threshold")) for c in cov]))
        for metric, values in rows:
            shown = [f"{fmt(v[0])} ({fmt(v[1])})" if isinstance(v, tuple) else fmt(v) for v in values]
            if delta:
                a, b = (v[0] if isinstance(v, tuple) else v for v in values)
                shown.append(fmt(b - a) if isinstance(a, float) and isinstance(b, float) else "-")
            lines.append(f"| {q} | {blocks[0]['n']} | {metric} | " + " | ".join(shown) + " |")
    return lines


def reliability_png(bins: list[dict[str, float]], title: str, path: Path, size: int = 480, force: bool = False) -> None:
    """A reliability diagram: per confidence bin, the accuracy (bar) against the mean confidence (dot) and the
    diagonal of perfect calibration; each bar's count above it."""
    margin, width = 48, size - 2 * 48
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)

    def xy(x: float, y: float) -> tuple[float, float]:
        return margin + x * width, size - margin - y * width

    draw.rectangle([xy(0, 1), xy(1, 0)], outline="black")
    for tick in (0.0, 0.5, 1.0):
        draw.text((xy(tick, 0)[0] - 8, size - margin + 6), f"{tick:.1f}", fill="black")
        draw.text((margin - 28, xy(0, tick)[1] - 6), f"{tick:.1f}", fill="black")
    draw.line([xy(0, 0), xy(1, 1)], fill=(150, 150, 150), width=1)
    for b in bins:
        left, top = xy(b["low"], b["accuracy"])
        right, bottom = xy(b["high"], 0)
        draw.rectangle([left + 2, top, right - 2, bottom], fill=(70, 120, 200), outline=(30, 60, 120))
        cx, cy = xy(b["confidence"], b["confidence"])
        draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=(220, 80, 40))
        draw.text((left + 4, top - 14), str(int(b["n"])), fill="black")
    draw.text((margin, 14), title, fill="black")
    draw.text((margin, size - 20), "confidence (top probability); bars: accuracy, dots: mean confidence", fill="black")
    png = io.BytesIO()
    img.save(png, "PNG")
    write_bytes(path, png.getvalue(), force)
