"""`clef-gguf eval MODEL DATA.jsonl`: clef-finetune's metrics of a GGUF model on labelled data.

The result has the shape of clef-finetune's tuned_metrics.json ({"metrics": {"overall", "per_question"}, ...}), so
that the two can be diffed; `-o DIR` writes metrics.json, predictions.jsonl (clef-finetune's columns), report.md and
a reliability diagram per question type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import RequestError
from ..outputs import check_folder
from ..settings import MAX_LINE_BYTES, ModelSpec
from .labelled import duplicates
from .metrics import DEFAULT_TARGET_PRECISIONS, Row, reliability, summarize
from .report import errors_section, metrics_table, output_dir, reliability_png, write_bytes, write_json, write_jsonl
from .scoring import Progress, Run, score_path

REPORTS = ("metrics.json", "predictions.jsonl", "report.md", "reliability-*.png")  # what -o DIR gets (fnmatch)


def evaluation(run: Run, rows: list[Row], target_precisions: Sequence[float]) -> dict[str, Any]:
    """The eval's result: clef-finetune's tuned_metrics.json fields (model_dir, checkpoint, eval, metrics) and ours."""
    return {
        "model_dir": run.model,
        "checkpoint": run.adapter,  # (clef-finetune's: the fine-tune over model_dir; here the adapter file)
        "eval": run.data,
        "metrics": summarize(rows, target_precisions),
        "rows": len(rows),
        "errors": run.errors,
        "duplicates": duplicates(d.record for d in run.decided),  # (ids repeated, with contradictory labels or not)
        **run.timing(),
        "tokens": run.tokens,
    }


def evaluate(
    spec: ModelSpec,
    data: str | Path,
    *,
    target_precisions: Sequence[float] = DEFAULT_TARGET_PRECISIONS,
    out_dir: Path | None = None,
    force: bool = False,
    progress: Progress | None = None,
    score: Callable[..., Run] = score_path,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> dict[str, Any]:
    """The metrics of the model `spec` declares on the labelled file `data`; with out_dir, the reports there too
    (result["written"] lists them; outputs.check_folder's rule, checked first)."""
    if out_dir is not None:
        check_folder(Path(out_dir), REPORTS, force=force, inputs=[spec.path, data, spec.options.mmproj])
    # (score_path; on Ray: scoring_ray.py's)
    run = score(spec, data, stage="eval", progress=progress, max_line_bytes=max_line_bytes)
    rows = run.rows()
    if not rows:
        shown = "; ".join(run.errors[:3])
        raise RequestError(f"{data}: no labelled question could be decided" + (f" ({shown})" if shown else ""))
    result = evaluation(run, rows, target_precisions)
    if out_dir is not None:
        result["written"] = [str(p) for p in write_reports(output_dir(Path(out_dir)), result, rows, force)]
    return result


def report_markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Evaluation",
        "",
        f"model: `{result['model_dir']}`" + (f" with the adapter `{result['checkpoint']}`  " if result["checkpoint"] else "  "),
        f"data: `{result['eval']}`: {result['records']} records decided, {result['rows']} labelled questions, "
        f"{len(result['errors'])} lines with errors ({result['records_per_s']} records/s)",
        "",
        *metrics_table({"value": result["metrics"]}),
        "",
        "Lower is better for nll, brier and ece. Auto-decide coverage: the share of questions whose top probability "
        "clears the threshold while the precision on them stays at the target; small sets make it noisy.",
    ]
    warnings = [f"- {w}" for w in result.get("duplicates", {}).get("warnings", [])]
    lines += ["", "## Repeated ids", "", *warnings] if warnings else []
    return "\n".join([*lines, *errors_section("Lines not counted", result["errors"])]) + "\n"


def write_reports(out: Path, result: dict[str, Any], rows: list[Row], force: bool = False) -> list[Path]:
    written = [out / "metrics.json", out / "predictions.jsonl", out / "report.md"]
    write_json(written[0], result, force)
    write_jsonl(written[1], [r.as_dict() for r in rows], force)
    write_bytes(written[2], report_markdown(result).encode(), force)
    for qtype in sorted({r.type for r in rows}):
        of_type = [r for r in rows if r.type == qtype]
        bins = reliability([float(r.probs.max()) for r in of_type], [r.predicted == r.target for r in of_type])
        path = out / f"reliability-{qtype}.png"
        reliability_png(bins, f"{qtype}: {len(of_type)} questions", path, force=force)
        written.append(path)
    return written
