"""`clef-gguf eval` and `clef-gguf compare`: a model's metrics on labelled data, and what changing the file did to
the decisions. Thin over clef_gguf.quality; a progress bar per model on a terminal."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

from ..check.validate import validate as validate_file
from ..conversion.rekey import rekey
from ..format import contract as C
from ..llama.defaults import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_PARALLEL, DEFAULT_STATE_CACHE
from ..quality import calibrate as calibrating
from ..quality import compare as comparing
from ..quality import evaluate as evaluating
from ..quality.metrics import DEFAULT_TARGET_PRECISIONS
from ..quality.report import metrics_table, output_dir
from ..quality.scoring import Run, score_file
from ..runtime.model import load
from .decide import SOME_ERRORS
from .errors import err, fail, run, say, signals_clean_up
from .options import GpuLayers, MaxPrompt, Mmproj, Parallel, Ubatch, check_ubatch, state_cache_option

Data = Annotated[Path, typer.Argument(help="Labelled JSON Lines, clef-finetune's format (requests with `labels`).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as JSON (for scripts).")]
OutDir = Annotated[Path | None, typer.Option("--out", "-o", help="Write the reports into this folder.", show_default=False)]
DEFAULT_PRECISIONS = ",".join(f"{p:g}" for p in DEFAULT_TARGET_PRECISIONS)
TargetPrecision = Annotated[
    str, typer.Option("--target-precision", help="Auto-decide coverage at these precisions (comma-separated).")
]


def _precisions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        fail(f"--target-precision takes numbers separated by commas, not {text!r}")
    if not all(0 < v <= 1 for v in values):
        fail("--target-precision values are precisions, in (0, 1]")
    return values


@contextmanager
def _bar(label: str) -> Iterator[Callable[[int, int | None], None] | None]:
    if not err.is_terminal:
        yield None
        return
    with Progress(f"[bold]{label}", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=err) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _score(model_path: Path, data: Path, label: str, require_labels: bool, settings: dict[str, Any]) -> Run:
    with signals_clean_up(), load(model_path, **settings) as model, _bar(label) as progress:
        return score_file(model, data, require_labels=require_labels, progress=progress)


def _settings(
    n_gpu_layers: int, max_prompt_tokens: int, ubatch: int | None, state_cache: int | None, mmproj: Path | None, parallel: int
) -> dict[str, Any]:
    check_ubatch(ubatch, max_prompt_tokens)
    cache = DEFAULT_STATE_CACHE if state_cache is None else state_cache
    return {
        "n_gpu_layers": n_gpu_layers,
        "max_prompt_tokens": max_prompt_tokens,
        "ubatch": ubatch,
        "state_cache": cache,
        "mmproj": mmproj,
        "parallel": parallel,
    }


def _finish(errors: list[str]) -> None:
    for line in errors[:20]:
        say(f"not counted: {line}")
    if len(errors) > 20:
        say(f"... and {len(errors) - 20} more lines not counted")
    raise typer.Exit(SOME_ERRORS if errors else 0)


def eval_(
    model_path: Annotated[Path, typer.Argument(metavar="MODEL", help="The Clef GGUF file.")],
    data: Data,
    target_precision: TargetPrecision = DEFAULT_PRECISIONS,
    json_output: JsonOption = False,
    out: OutDir = None,
    n_gpu_layers: GpuLayers = 0,
    max_prompt_tokens: MaxPrompt = DEFAULT_MAX_PROMPT_TOKENS,
    ubatch: Ubatch = None,
    state_cache: Annotated[int | None, state_cache_option("1GiB")] = None,
    mmproj: Mmproj = None,
    parallel: Parallel = DEFAULT_PARALLEL,
) -> None:
    """clef-finetune's metrics (accuracy, macro_f1, nll, brier, ece, auto-decide coverage) of MODEL on labelled data,
    per question and overall. -o DIR: metrics.json, predictions.jsonl, report.md, a reliability diagram per question
    type. A bad line is reported (exit 8 at the end) and the others are counted."""
    precisions = _precisions(target_precision)
    settings = _settings(n_gpu_layers, max_prompt_tokens, ubatch, state_cache, mmproj, parallel)

    def work() -> dict[str, Any]:
        scored = _score(model_path, data, "eval", True, settings)
        rows = scored.rows()
        if not rows:
            fail(f"{data}: no labelled question could be decided; " + "; ".join(scored.errors[:3]))
        result = evaluating.evaluation(scored, rows, precisions)
        if out is not None:
            for path in evaluating.write_reports(output_dir(out), result, rows):
                say(f"wrote {path}")
        return result

    result = run(work)
    if json_output:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo("\n".join(metrics_table({"value": result["metrics"]})))
        rate = f"{result['seconds']} s ({result['records_per_s']} records/s)"
        say(f"{result['records']} records, {result['rows']} labelled questions in {rate}")
    _finish(result["errors"])


def compare(
    model_a: Annotated[Path, typer.Argument(metavar="MODEL_A", help="The Clef GGUF to compare from (e.g. f32).")],
    model_b: Annotated[Path, typer.Argument(metavar="MODEL_B", help="The Clef GGUF to compare with it (e.g. Q4_K_M).")],
    data: Annotated[Path, typer.Argument(help="JSON Lines requests; with `labels` (clef-finetune's format), metrics too.")],
    target_precision: TargetPrecision = DEFAULT_PRECISIONS,
    json_output: JsonOption = False,
    out: OutDir = None,
    n_gpu_layers: GpuLayers = 0,
    max_prompt_tokens: MaxPrompt = DEFAULT_MAX_PROMPT_TOKENS,
    ubatch: Ubatch = None,
    state_cache: Annotated[int | None, state_cache_option("1GiB")] = None,
    mmproj: Mmproj = None,
    parallel: Parallel = DEFAULT_PARALLEL,
) -> None:
    """What changing the file does to the decisions: top answers changed, decided flips (A's top-two margin over
    0.04), |dp| and KL(A||B), per question type and overall; with labels, both models' metrics side by side. The
    models are loaded one after the other, so that the two never take memory together."""
    precisions = _precisions(target_precision)
    settings = _settings(n_gpu_layers, max_prompt_tokens, ubatch, state_cache, mmproj, parallel)

    def work() -> dict[str, Any]:
        a = _score(model_a, data, "A", False, settings)
        b = _score(model_b, data, "B", False, settings)
        result = comparing.compare_runs(a, b, precisions)
        if out is not None:
            for path in comparing.write_reports(out, result):
                say(f"wrote {path}")
        return result

    result = run(work)
    typer.echo(json.dumps(result, indent=2) if json_output else comparing.report_markdown(result))
    _finish(sorted(set(result["errors"]["a"]) | set(result["errors"]["b"])))


def calibrate(
    model_path: Annotated[Path, typer.Argument(metavar="MODEL", help="The Clef GGUF file (never changed).")],
    data: Data,
    out: Annotated[Path, typer.Option("--out", "-o", help="The calibrated copy of MODEL.")],
    holdout: Annotated[
        float, typer.Option(min=0.0, max=0.9, help="Share of records held out of the fit, to measure it on (by record id).")
    ] = 0.0,
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUT if it exists.")] = False,
    target_precision: TargetPrecision = DEFAULT_PRECISIONS,
    json_output: JsonOption = False,
    n_gpu_layers: GpuLayers = 0,
    max_prompt_tokens: MaxPrompt = DEFAULT_MAX_PROMPT_TOKENS,
    ubatch: Ubatch = None,
    state_cache: Annotated[int | None, state_cache_option("1GiB")] = None,
    mmproj: Mmproj = None,
    parallel: Parallel = DEFAULT_PARALLEL,
) -> None:
    """Fit llama.cpp's softmax temperatures (clef.decision.temperature.<type>[.<bucket>]) on labelled data by NLL,
    and write MODEL with them as OUT: its tensor data byte for byte, llama-server and clef-gguf apply them alike.
    Prints the temperatures, and NLL, ECE and auto-decide coverage before and after (--holdout: on records kept
    out of the fit)."""
    precisions = _precisions(target_precision)
    settings = _settings(n_gpu_layers, max_prompt_tokens, ubatch, state_cache, mmproj, parallel)

    def work() -> dict[str, Any]:
        scored = _score(model_path, data, "calibrate", True, settings)
        rows = scored.rows()
        current = dict(validate_file(model_path).temperatures)  # (load refused a file whose keys are invalid)
        fit = calibrating.calibrate_rows(rows, current, holdout, precisions)
        if not fit.counts:
            fail(f"{data}: no question type has {calibrating.MIN_QUESTIONS} labelled questions to fit a temperature on")
        keys = {C.KEY_TEMPERATURE_PREFIX + name: value for name, value in fit.temperatures.items()}
        with signals_clean_up(), _bar("writing") as progress:
            update = (lambda stage, done, total, item: progress(done, total)) if progress else None
            rekey(model_path, out, keys, drop_prefix=C.KEY_TEMPERATURE_PREFIX, force=force, progress=update)
        return {
            "model": str(model_path),
            "out": str(out),
            "eval": str(data),
            "temperatures": fit.temperatures,
            "fitted_on": fit.counts,
            "before": fit.before,
            "after": fit.after,
            "errors": scored.errors,
        }

    result = run(work)
    if json_output:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo(calibrating.report_markdown(result))
    say(f"wrote {out}")
    _finish(result["errors"])
