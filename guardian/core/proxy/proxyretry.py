"""Whether nginx sends a request that has had no byte of its answer yet to the other replica (issue
33): read from the nginx text whose `proxy_pass` names an upstream, for `guardian check`. Pure.

Why: a hung replica holds requests it has not answered; when guardian kills it, nginx answers
each of them 502 unless `proxy_next_upstream` lists `non_idempotent` (a completion is a POST, and
nginx sends a POST again only with it). A completion has no side effect, so sending it again is
safe. nginx gives up on the next server once `proxy_next_upstream_timeout` has passed since the
first try: shorter than guardian's time from a freeze to its kill, and the requests that waited on
the hung replica are answered 502 all the same.

Rules (nginx's own): each directive is inherited from the enclosing block (http, server, location)
unless set in an inner one; `proxy_next_upstream` defaults to "error timeout", its timeout and
tries to 0 (no limit). A file under conf.d is read as if in nginx's http block; what nginx.conf
itself sets around it is not seen (said as a limit in README).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_TOKEN = re.compile(r"#[^\n]*|\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[{};]|[^\s{};\"'#]+")
_TIME = re.compile(r"(\d+)(ms|s|m|h|d|w|M|y)?")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "M": 2592000.0, "y": 31536000.0}
DEFAULT_NEXT_UPSTREAM = ("error", "timeout")


@dataclass
class _Block:
    directives: list[list[str]] = field(default_factory=list)
    children: list[_Block] = field(default_factory=list)
    parent: _Block | None = None

    def own(self, name: str) -> list[str] | None:
        found = [d[1:] for d in self.directives if d[0] == name]
        return found[-1] if found else None

    def inherited(self, name: str) -> list[str] | None:
        block: _Block | None = self
        while block is not None:
            value = block.own(name)
            if value is not None:
                return value
            block = block.parent
        return None


def _parse(text: str) -> _Block:
    top = block = _Block()
    words: list[str] = []
    for token in _TOKEN.findall(text):
        if token.startswith("#"):
            continue
        if token == ";":
            if words:
                block.directives.append(words)
            words = []
        elif token == "{":
            child = _Block(parent=block)
            block.children.append(child)
            block, words = child, []
        elif token == "}":
            block, words = (block.parent or top), []
        else:
            words.append(token.strip("\"'"))
    return top


def _walk(block: _Block) -> list[_Block]:
    out = [block]
    for child in block.children:
        out += _walk(child)
    return out


def nginx_seconds(value: str) -> float | None:
    """An nginx time ("60s", "1m", "500ms", "30": seconds) in seconds; None if it is not one."""
    parts = _TIME.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        return None
    return sum(int(n) * _UNIT_S[u or "s"] for n, u in parts)


def _passes_to(d: list[str], upstream: str) -> bool:
    if d[0] != "proxy_pass" or len(d) < 2:
        return False
    target = d[1].split("://", 1)[-1]
    return target == upstream or target.startswith(upstream + "/")


def retry_findings(text: str, upstream: str, kill_bound_s: float) -> list[str] | None:
    """None: TEXT has no `proxy_pass` to UPSTREAM; else what keeps a request with no byte yet from
    going to the other replica there (empty: nothing). KILL_BOUND_S: guardian's longest time from a
    replica's freeze to its kill."""
    passes = [b for b in _walk(_parse(text)) if any(_passes_to(d, upstream) for d in b.directives)]
    if not passes:
        return None
    out: list[str] = []
    for block in passes:
        cases = block.inherited("proxy_next_upstream") or list(DEFAULT_NEXT_UPSTREAM)
        if "non_idempotent" not in cases or "off" in cases:
            out.append(
                f"proxy_next_upstream is '{' '.join(cases)}', without non_idempotent: a completion that has had no "
                "byte of its answer when its replica hangs (or guardian kills it) is answered 502 instead of "
                "being sent to the other replica"
            )
        tries = block.inherited("proxy_next_upstream_tries")
        if tries and tries[0] == "1":
            out.append(
                "proxy_next_upstream_tries is 1: nginx never tries another server, so a completion with no byte yet "
                "is answered 502 when its replica hangs"
            )
        timeout = block.inherited("proxy_next_upstream_timeout")
        seconds = nginx_seconds(timeout[0]) if timeout else 0.0
        if timeout and seconds is None:
            out.append(f"proxy_next_upstream_timeout '{' '.join(timeout)}' is not an nginx time")
        elif seconds and seconds < kill_bound_s:
            out.append(
                f"proxy_next_upstream_timeout {timeout[0] if timeout else ''} is shorter than guardian's time from a "
                f"replica's freeze to its kill (up to {kill_bound_s:.1f} s): the requests that waited on a hung "
                "replica are answered 502 instead of being sent to the other one"
            )
    return sorted(set(out), key=out.index)
