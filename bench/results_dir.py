"""Where benchmark scripts write their JSON: bench/results/, or $SANDKERNEL_BENCH_RESULTS
(the CI smoke run points it at a temporary directory so the committed results stay as measured)."""

from __future__ import annotations

import os
from pathlib import Path


def results_path(name: str) -> Path:
    directory = Path(os.environ.get("SANDKERNEL_BENCH_RESULTS") or Path(__file__).with_name("results"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name
