"""`clef-gguf eval`, `compare` and `calibrate`: a model's metrics on labelled data, what changing the file did to the
decisions, and the softmax temperatures fitted. Thin over clef_gguf.quality, imported when a command runs (--help
loads no llama.cpp); a progress bar per stage on a terminal."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import ExitCode
from ..settings import DEFAULT_TARGET_PRECISIONS
from .common import ray_scorer, run_with_progress
from .errors import err, fail, say
from .options import AddressOption, DataFlags, ModelFlags, OnRayOption, WorkersOption, file_path, flag_groups

Data = Annotated[
    Path,
    typer.Argument(metavar="DATA", help="Labelled JSON Lines, clef-finetune's format (requests with `labels`); - reads stdin."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as JSON (for scripts).")]
OutDir = Annotated[Path | None, typer.Option("--out", "-o", help="Write the reports into this folder.", show_default=False)]
ForceReports = Annotated[bool, typer.Option("--force", help="-o DIR: overwrite the reports that DIR holds already.")]


def _adapter_of(side: str) -> Any:
    help = f"An adapter file over MODEL_{side} (its fine-tune, against a merged file say)."
    return typer.Option(f"--adapter-{side.lower()}", metavar="FILE", help=help, show_default=False)


AdapterA = Annotated[Path | None, _adapter_of("A")]
AdapterB = Annotated[Path | None, _adapter_of("B")]
DEFAULT_PRECISIONS = ",".join(f"{p:g}" for p in DEFAULT_TARGET_PRECISIONS)
MAX_HOLDOUT = 0.9  # (a tenth of the data, at least, to fit on)
TargetPrecision = Annotated[
    str, typer.Option("--target-precision", help="Auto-decide coverage at these precisions (comma-separated).")
]


@dataclass(frozen=True)
class Reports:
    """What eval and compare report, and where (a flag group: options.flag_groups)."""

    target_precision: TargetPrecision = DEFAULT_PRECISIONS
    json_output: JsonOption = False
    out: OutDir = None
    force: ForceReports = False


@dataclass(frozen=True)
class RayFlags:
    """eval on a Ray cluster, as decide's JSON Lines mode (a flag group: options.flag_groups)."""

    ray: OnRayOption = False
    workers: WorkersOption = None
    address: AddressOption = None


def _precisions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        fail(f"--target-precision takes numbers separated by commas, not {text!r}")
    if not all(0 < v <= 1 for v in values):
        fail("--target-precision values are precisions, in (0, 1]")
    return values


def _warn_duplicates(result: dict[str, Any]) -> None:
    """Records sharing an id (result["duplicates"], quality/labelled.duplicates): one warning line each, on stderr."""
    found = result.get("duplicates") or {}
    for warning in found.get("warnings", []):
        say(f"warning: {warning}")
    if found.get("duplicate_ids", 0) > len(found.get("warnings", [])):
        say(f"warning: ... {found['duplicate_ids'] - len(found['warnings'])} more ids repeated")


def _holdout(value: float) -> float:
    if not (math.isfinite(value) and 0.0 <= value <= MAX_HOLDOUT):
        fail(f"--holdout is the share of records held out of the fit, a number from 0 to {MAX_HOLDOUT}; not {value}")
    return value


def _finish(errors: list[str]) -> None:
    for line in errors[:20]:
        say(f"not counted: {line}")
    if len(errors) > 20:
        say(f"... and {len(errors) - 20} more lines not counted")
    raise typer.Exit(ExitCode.SOME_ERRORS if errors else ExitCode.OK)


def _work(
    action: Callable[..., dict[str, Any]], args: tuple[Any, ...], target_precision: str, load: DataFlags, **kwargs: Any
) -> dict[str, Any]:
    """action(*args, **kwargs) (args: the models' specs first) with the options the three commands share (the
    precisions, the line limit), and a progress bar per stage on a terminal; its errors and signals as the CLI's."""
    kwargs |= {"target_precisions": _precisions(target_precision), "max_line_bytes": load.line_limit()}
    result = run_with_progress(action, *args, bars=err.is_terminal, **kwargs)
    for path in result.pop("written", []):
        say(f"wrote {path}")
    return result


@flag_groups
def eval_(
    model_path: Annotated[Path, typer.Argument(metavar="MODEL", help="The Clef GGUF file.", parser=file_path)],
    data: Data,
    *,
    reports: Reports,
    load: ModelFlags,
    cluster: RayFlags,
) -> None:
    """clef-finetune's metrics (accuracy, macro_f1, nll, brier, ece, auto-decide coverage) of MODEL on labelled data,
    per question and overall. -o DIR: metrics.json, predictions.jsonl, report.md, a reliability diagram per question
    type. A bad line is reported (exit 8 at the end) and the others are counted. --ray: decided on a Ray cluster, the
    same result (docs/dataset.md)."""
    if cluster.workers is not None and not cluster.ray:
        fail("--workers is for --ray")
    from ..quality import evaluate as evaluating
    from ..quality.report import metrics_table

    on = {"score": ray_scorer(cluster.address, cluster.workers)} if cluster.ray else {}
    chosen = {"out_dir": reports.out, "force": reports.force, **on}
    result = _work(evaluating.evaluate, (load.spec(model_path), data), reports.target_precision, load, **chosen)
    if reports.json_output:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo("\n".join(metrics_table({"value": result["metrics"]})))
        rate = f"{result['seconds']} s ({result['records_per_s']} records/s)"
        say(f"{result['records']} records, {result['rows']} labelled questions in {rate}")
    _warn_duplicates(result)
    _finish(result["errors"])


@flag_groups
def compare(
    model_a: Annotated[
        Path, typer.Argument(metavar="MODEL_A", help="The Clef GGUF to compare from (e.g. f32).", parser=file_path)
    ],
    model_b: Annotated[
        Path, typer.Argument(metavar="MODEL_B", help="The Clef GGUF to compare with it (e.g. Q4_K_M).", parser=file_path)
    ],
    data: Annotated[
        Path, typer.Argument(metavar="DATA", help="JSON Lines requests; with `labels` (clef-finetune's format), metrics too.")
    ],
    *,
    reports: Reports,
    load: DataFlags,
    adapter_a: AdapterA = None,
    adapter_b: AdapterB = None,
) -> None:
    """What changing the file does to the decisions: top answers changed, decided flips (A's top-two margin over
    0.04), |dp| and KL(A||B), per question type and overall; with labels, both models' metrics side by side. The
    models are loaded one after the other, so that the two never take memory together."""
    if str(data) == "-":  # (each model reads DATA in turn)
        fail("compare reads DATA once per model: give a file, not - (stdin)")
    from ..quality import compare as comparing

    a, b = load.pinned(model_a, adapter_a), load.pinned(model_b, adapter_b)
    chosen = {"out_dir": reports.out, "force": reports.force}
    result = _work(comparing.compare, (a, b, data), reports.target_precision, load, **chosen)
    typer.echo(json.dumps(result, indent=2) if reports.json_output else comparing.report_markdown(result))
    _finish(sorted(set(result["errors"]["a"]) | set(result["errors"]["b"])))


@flag_groups
def calibrate(
    model_path: Annotated[Path, typer.Argument(metavar="MODEL", help="The Clef GGUF file (never changed).", parser=file_path)],
    data: Data,
    out: Annotated[Path, typer.Option("--out", "-o", help="The calibrated copy of MODEL.")],
    holdout: Annotated[
        float,
        typer.Option(
            metavar="SHARE", help=f"Share of records held out of the fit, to measure it on (by record id), 0 to {MAX_HOLDOUT}."
        ),
    ] = 0.0,
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUT if it exists.")] = False,
    target_precision: TargetPrecision = DEFAULT_PRECISIONS,
    json_output: JsonOption = False,
    *,
    load: ModelFlags,
) -> None:
    """Fit llama.cpp's softmax temperatures (clef.decision.temperature.<type>[.<bucket>]) on labelled data by NLL,
    and write MODEL with them as OUT: its tensor data byte for byte, llama-server and clef-gguf apply them alike.
    Prints the temperatures, and NLL, ECE and auto-decide coverage before and after (--holdout: on records kept
    out of the fit)."""
    from ..quality import calibrate as calibrating

    fit = {"holdout_fraction": _holdout(holdout), "force": force}
    result = _work(calibrating.calibrate, (load.spec(model_path), data, out), target_precision, load, **fit)
    typer.echo(json.dumps(result, indent=2) if json_output else calibrating.report_markdown(result))
    say(f"wrote {out}")
    _warn_duplicates(result)
    _finish(result["errors"])
