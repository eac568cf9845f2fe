"""How a benchmark's configuration is recorded in bench/results/: without this machine's paths."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from jaxpaged.model_loader.model_store import jaxpaged_home

REPO = Path(__file__).resolve().parent.parent


def portable(value):
    """`value`, or for a path (or a string holding an absolute one): relative to the repo, or
    `$JAXPAGED_HOME/...` for a model imported there, or else its last component alone."""
    if isinstance(value, str) and Path(value).is_absolute():
        value = Path(value)
    if not isinstance(value, Path):
        return value
    path = value.expanduser().resolve()
    if path.is_relative_to(REPO):
        return str(path.relative_to(REPO))
    home = jaxpaged_home().resolve()
    if path.is_relative_to(home):
        return f"$JAXPAGED_HOME/{path.relative_to(home)}"
    return path.name


def portable_config(args: argparse.Namespace) -> dict:
    """A benchmark's arguments, with `portable` paths."""
    return {k: portable(v) for k, v in vars(args).items()}


def call_times(run, repeats: int = 10) -> list[float]:
    """Seconds of each of `repeats` timed calls of `run()`, after one untimed warm-up."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def best_time(run, repeats: int = 10) -> float:
    """The fastest of `repeats` timed calls of `run()` (after one untimed warm-up), seconds."""
    return min(call_times(run, repeats))
