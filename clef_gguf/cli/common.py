"""What several commands share beyond their flags (cli/options.py): a library call with progress bars on stderr, and
Ray's dataset mode, imported once a run starts. A command module imports from here, never from another command."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from ..errors import SettingsError
from .errors import err, raise_pending, run, signals_clean_up

T = TypeVar("T")


@contextmanager
def progress_bars() -> Iterator[Callable[[str, int, int, str], None]]:
    """A progress callback (stage, done, total, item): one bar per stage; where a deferred signal is raised."""
    # Rich's bars, loaded by the commands that draw them: not by every `clef-gguf` process.
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[item]}"),
    )
    with Progress(*columns, console=err, transient=False) as bar:
        tasks: dict[str, TaskID] = {}

        def update(stage: str, done: int, total: int, item: str) -> None:
            raise_pending()
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total, item="")
            bar.update(tasks[stage], completed=done, total=total, item=item)

        yield update


def run_with_progress(action: Callable[..., T], *args: Any, bars: bool = True, **kwargs: Any) -> T:
    """action(*args, **kwargs) with the CLI's signals and errors (errors.run); with `bars`, progress=progress_bars()."""

    def work() -> T:
        with signals_clean_up():
            if not bars:
                return action(*args, **kwargs)
            with progress_bars() as progress:
                return action(*args, progress=progress, **kwargs)

    return run(work)


def on_ray(address: str | None) -> Any:
    """runtime/dataset_ray.py, imported after ray_local.loopback_only when the cluster is to be started here."""
    from ..runtime.ray_local import bounded_connect, loopback_only

    if address is None:
        loopback_only()  # the cluster started here listens on 127.0.0.1 only; before ray is imported
    else:
        bounded_connect()  # an address where no cluster answers: refused in seconds, not minutes
    try:
        from ..runtime import dataset_ray
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in ("ray", "pandas", "pyarrow"):
            raise
        raise SettingsError("--ray needs Ray Data: pip install 'clef-gguf[ray]'") from None
    return dataset_ray


def ray_scorer(address: str | None, workers: int | None) -> Callable[..., Any]:
    """`eval --ray`'s scorer (quality.evaluate's `score`): Ray imported once the run starts (its errors the CLI's)."""

    def score(*args: Any, **kwargs: Any) -> Any:
        on_ray(address)  # Ray prepared and imported (or the CLI's error): then eval's half, quality/scoring_ray.py
        from ..quality.scoring_ray import score_on_ray

        return score_on_ray(address, workers)(*args, **kwargs)

    return score
