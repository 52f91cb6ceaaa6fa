"""Where benchmark scripts write their JSON: bench/results/, or $SANDKERNEL_BENCH_RESULTS
(the CI smoke run points it at a temporary directory so the committed results stay as measured)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def results_path(name: str) -> Path:
    directory = Path(os.environ.get("SANDKERNEL_BENCH_RESULTS") or Path(__file__).with_name("results"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name


def save_for_runtime(name: str, runtime: str, results: dict) -> None:
    """Write ``results`` under ``runtime`` in bench/results/``name``, keeping the other runtimes'."""
    path = results_path(name)
    previous = json.loads(path.read_text()) if path.exists() else {}
    previous[runtime] = results
    path.write_text(json.dumps(previous, indent=2) + "\n")
