"""`pdserve bench`: the benchmarks (commands.py, microbench.py) and their parts."""

from __future__ import annotations

import json
from collections.abc import Callable


def write_json(path: str | None, payload: Callable[[], dict]) -> None:
    """A benchmark's `--json PATH`: `payload()` written there, indented; nothing when
    `path` is None (the payload is then not built)."""
    if path:
        with open(path, "w") as f:
            json.dump(payload(), f, indent=2)
