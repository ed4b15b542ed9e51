"""A replica's warm-up requests (R.warmup_file, issue 33): a JSONL file, one completion or chat
request per line, read and checked. Nothing here sends them (act/warmup.py does).

Each line is a JSON object with "prompt" (a string: a completion) or "messages" (a non-empty list
of {"role", "content"} objects: a chat completion); other keys are the request's own (tools,
temperature...), but "model", "max_tokens", "max_completion_tokens", "stream", "stream_options" and
"n" are guardian's: the replica's model, one token, one choice, not streamed. NaN and Infinity are
refused (they are not JSON, and could not be sent), and so is a line nested deeper than the JSON
parser goes (issue 41 row 5: a line of 100,000 "[" raised RecursionError out of here, and killed
`guardian check` and the daemon's warm-up). Blank lines and lines starting with "#" are skipped.
At most MAX_BYTES and MAX_REQUESTS: a file larger than that is not read (a warm-up is a handful of
shared prefixes), so no line is longer than MAX_BYTES either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .readback import read_back

MAX_BYTES = 1 << 20
MAX_REQUESTS = 256
GUARDIANS_KEYS = ("model", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n")


@dataclass(frozen=True)
class WarmupRequest:
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]  # without guardian's keys


class WarmupFileError(ValueError):
    """The file cannot be used; the message names the file, and the line where one is to blame."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _request(line: str, where: str) -> WarmupRequest:
    try:
        body = json.loads(line, parse_constant=_no_constant)
    except ValueError as e:
        raise WarmupFileError(f"{where}: not JSON ({e})") from None
    except RecursionError as e:  # the C decoder's own bound on nesting (the interpreter's recursion limit)
        raise WarmupFileError(f"{where}: not JSON: nested too deep ({e})") from None
    if not isinstance(body, dict):
        raise WarmupFileError(f"{where}: not a JSON object")
    body = {k: v for k, v in body.items() if k not in GUARDIANS_KEYS}
    if isinstance(body.get("prompt"), str) and "messages" not in body:
        return WarmupRequest("/v1/completions", body)
    messages = body.get("messages")
    if (
        "prompt" not in body
        and isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages)
    ):
        return WarmupRequest("/v1/chat/completions", body)
    raise WarmupFileError(
        f'{where}: neither "prompt" (a string) nor "messages" (a list of {{"role", "content"}} objects), and not both'
    )


def load(path: Path) -> tuple[WarmupRequest, ...]:
    """PATH's requests; WarmupFileError (naming PATH and the line) when it cannot be used."""
    try:
        text = read_back(path, MAX_BYTES, follow_symlinks=True).decode()
    except (OSError, UnicodeDecodeError) as e:
        raise WarmupFileError(f"{path}: cannot be read: {e}") from None
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            found.append(_request(line, f"{path} line {number}"))
    if not found:
        raise WarmupFileError(f"{path}: no request in it")
    if len(found) > MAX_REQUESTS:
        raise WarmupFileError(f"{path}: {len(found)} requests, more than {MAX_REQUESTS}")
    return tuple(found)
