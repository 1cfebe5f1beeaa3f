"""`clef-gguf compare A B DATA.jsonl`: what changing the file (a quantization, a calibration, a new fine-tune)
does to the decisions, per question type and overall:

- changed: questions whose top answer differs (the first maximum, as `choice` answers it);
- flips: changed questions where A was decided, its top-two margin over FLIP_MARGIN (mlx-decision's "decided
  flips": a change there is not a near-tie falling the other way);
- |dp|: every option's |p_B - p_A|: mean, p99, max;
- KL(A||B): per question, sum p_A log(p_A / p_B), each p floored at 1e-12: mean, p99, max.
With labels, both models' metrics side by side, as clef-finetune's base-vs-tuned comparison shows them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..check.validate import open_validated
from ..errors import RequestError
from ..inputs import open_regular
from ..outputs import check_folder
from ..settings import MAX_LINE_BYTES, ModelSpec
from .metrics import DEFAULT_TARGET_PRECISIONS, summarize
from .report import errors_section, metrics_table, output_dir, write_bytes, write_json
from .scoring import Progress, Run, score_path

FLIP_MARGIN = 0.04
REPORTS = ("comparison.json", "report.md")  # what -o DIR gets
FLOOR = 1e-12


def _margin(p: np.ndarray) -> float:
    top = np.sort(p)[-2:]
    return float(top[1] - top[0])


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def _changes(pairs: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    changed = [int(np.argmax(a)) != int(np.argmax(b)) for a, b in pairs]
    flips = sum(c and _margin(a) > FLIP_MARGIN for c, (a, _) in zip(changed, pairs, strict=True))
    dp = [float(x) for a, b in pairs for x in np.abs(b - a)]
    kl = [float(np.sum(a * (np.log(np.maximum(a, FLOOR)) - np.log(np.maximum(b, FLOOR))))) for a, b in pairs]
    return {
        "n": len(pairs),
        "changed": sum(changed),
        "changed_share": sum(changed) / len(pairs),
        "flips": flips,
        "abs_dp": _stats(dp),
        "kl": _stats(kl),
    }


def compare_runs(a: Run, b: Run, target_precisions: Sequence[float] = DEFAULT_TARGET_PRECISIONS) -> dict[str, Any]:
    """The comparison of two models' runs over the same file."""
    b_by_line = {d.record.line: d for d in b.decided if d.error is None}
    pairs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for d in a.decided:
        other = b_by_line.get(d.record.line)
        if d.error is not None or other is None:
            continue
        for qid, a_q in d.questions.items():
            b_q = other.questions[qid]
            if b_q.options != a_q.options:
                raise RequestError(f"line {d.record.line}: question {qid} has options {a_q.options} in A, {b_q.options} in B")
            pairs.setdefault(a_q.type, []).append((a_q.probs, b_q.probs))
    if not pairs:
        raise RequestError(f"{a.data}: no question was decided by both models")
    result: dict[str, Any] = {
        "a": a.label,
        "b": b.label,
        "data": a.data,
        "records": len(b_by_line),
        "changes": {
            "overall": _changes([p for v in pairs.values() for p in v]),
            "per_type": {t: _changes(v) for t, v in sorted(pairs.items())},
        },
        "errors": {"a": a.errors, "b": b.errors},
        "timing": {"a": a.timing(), "b": b.timing()},
    }
    rows_a, rows_b = a.rows(), b.rows()
    if rows_a and rows_b:
        result["metrics"] = {"a": summarize(rows_a, target_precisions), "b": summarize(rows_b, target_precisions)}
    return result


def _readable_twice(data: str | Path) -> None:
    """DATA is read once per model: a regular file (a pipe or a FIFO would be read by A alone, and one without a
    writer would hold the command); refused before any model loads."""
    try:
        open_regular(data).close()
    except OSError as e:
        raise RequestError(f"{data}: {e.strerror or e}; compare reads DATA once per model: give a file") from None


def compare(
    a: ModelSpec,
    b: ModelSpec,
    data: str | Path,
    *,
    target_precisions: Sequence[float] = DEFAULT_TARGET_PRECISIONS,
    out_dir: Path | None = None,
    force: bool = False,
    progress: Progress | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> dict[str, Any]:
    """compare_runs of the two models the specs declare (each with its adapter, if any: a fine-tune against its merged
    conversion, say) on `data`, loaded one after the other (never together: each may be large).

    Before any decision: B is validated (header only) as A is by its load, and -o DIR checked (outputs.check_folder),
    so that neither fails once A has decided the whole file."""
    if out_dir is not None:
        check_folder(Path(out_dir), REPORTS, force=force, inputs=[a.path, b.path, data, a.options.mmproj, b.options.mmproj])
    open_validated(b.path).close()
    _readable_twice(data)
    how = {"require_labels": False, "progress": progress, "max_line_bytes": max_line_bytes}
    runs = [score_path(spec, data, stage=stage, **how) for spec, stage in ((a, "A"), (b, "B"))]  # type: ignore[arg-type]
    result = compare_runs(*runs, target_precisions)
    if out_dir is not None:
        result["written"] = [str(p) for p in write_reports(Path(out_dir), result, force)]
    return result


def report_markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Comparison",
        "",
        f"A: `{result['a']}`  ",
        f"B: `{result['b']}`  ",
        f"data: `{result['data']}`, {result['records']} records decided by both",
        "",
        "| questions | n | top answer changed | decided flips | mean abs dp | p99 abs dp | max abs dp "
        "| mean KL(A‖B) | p99 KL | max KL |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in [("all", result["changes"]["overall"]), *result["changes"]["per_type"].items()]:
        dp, kl = c["abs_dp"], c["kl"]
        lines.append(
            f"| {name} | {c['n']} | {c['changed']} ({c['changed_share']:.1%}) | {c['flips']} | {dp['mean']:.5f} | "
            f"{dp['p99']:.5f} | {dp['max']:.5f} | {kl['mean']:.2e} | {kl['p99']:.2e} | {kl['max']:.2e} |"
        )
    lines += ["", f"Decided flips: changed where A's top-two margin was over {FLIP_MARGIN}."]
    if "metrics" in result:
        lines += ["", "## On the labels", "", *metrics_table({"A": result["metrics"]["a"], "B": result["metrics"]["b"]})]
    for side in ("a", "b"):
        lines += errors_section(f"Lines {side.upper()} did not decide", result["errors"][side])
    return "\n".join(lines) + "\n"


def write_reports(out: Path, result: dict[str, Any], force: bool = False) -> list[Path]:
    out = output_dir(out)
    written = [out / "comparison.json", out / "report.md"]
    write_json(written[0], result, force)
    write_bytes(written[1], report_markdown(result).encode(), force)
    return written
