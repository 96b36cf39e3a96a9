"""Reading JSON files a live run rewrites (``metrics.jsonl``, the run plan) while it rewrites them: trellis
replaces them whole (``Store.replace_text``), but a file written in place (by an earlier trellis, or a copy under
way) may be read empty or with its last line cut short.

What is not whole yet is left for the next read; a whole line that is not JSON is a damaged file and says where.
"""

from __future__ import annotations

import json
from typing import Any


def whole_json(text: str | None) -> Any | None:
    """The JSON of a file read while its writer may be half-way through it: None until it is whole."""
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return None


def whole_lines(text: str | None, *, source: str) -> list[Any]:
    """The JSON values of the lines of ``text`` that end (a line still being written is left out); blank lines
    are skipped. Raises ValueError naming ``source`` and the line when a whole line is not JSON."""
    text = text or ""
    values = []
    for number, line in enumerate(text[: text.rfind("\n") + 1].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(f"{source} line {number} is not JSON ({error.msg}): {line[:80]!r}") from None
    return values
