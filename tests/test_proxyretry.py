"""Whether nginx sends a request with no byte of its answer yet to the other replica (issue 33):
core/proxy/proxyretry.py on nginx texts, the README's snippet among them."""

from __future__ import annotations

from pathlib import Path

import pytest

from guardian.core.proxy.proxyretry import nginx_seconds, retry_findings

README = Path(__file__).resolve().parent.parent / "README.md"
BOUND_S = 12.0


def site(location: str, server: str = "", http: str = "") -> str:
    return f"{http}\nupstream llm {{ server 127.0.0.1:8001; }}\nserver {{\n  listen 8080;\n  {server}\n" \
        f"  location / {{\n    proxy_pass http://llm;\n    {location}\n  }}\n}}\n"


RETRY = "proxy_next_upstream error timeout http_502 non_idempotent;"


@pytest.mark.parametrize(
    "text, found",
    [
        (site(RETRY), []),
        (site(RETRY + " proxy_next_upstream_timeout 60s; proxy_next_upstream_tries 2;"), []),
        (site("proxy_next_upstream error timeout http_502 http_503;"), ["without non_idempotent"]),
        (site(""), ["'error timeout', without non_idempotent"]),  # nginx's default
        (site("proxy_next_upstream off;"), ["without non_idempotent"]),
        (site("", server=RETRY), []),  # inherited from the server block
        (site("", http=RETRY), []),  # ... or the file's own level (http, for a conf.d file)
        (site("proxy_next_upstream error;", server=RETRY), ["'error', without non_idempotent"]),  # inner wins
        (site(RETRY + " proxy_next_upstream_timeout 10s;"), ["shorter than guardian's time"]),
        (site(RETRY + " proxy_next_upstream_timeout 0;"), []),  # 0: no limit
        (site(RETRY + " proxy_next_upstream_timeout 1m;"), []),
        (site(RETRY + " proxy_next_upstream_timeout soon;"), ["not an nginx time"]),
        (site(RETRY + " proxy_next_upstream_tries 1;"), ["tries is 1"]),
        (site(RETRY + " proxy_next_upstream_tries 3;"), []),
        (site("# proxy_next_upstream error non_idempotent;"), ["without non_idempotent"]),  # a comment sets nothing
        (site(RETRY).replace("http://llm", "http://other"), None),  # not guardian's upstream: not judged here
        (site(RETRY).replace("http://llm", "http://llm/v1"), []),
        (site("proxy_next_upstream error;").replace("http://llm", "http://llmx"), None),
    ],
)
def test_retry_findings(text: str, found: list[str] | None) -> None:
    got = retry_findings(text, "llm", BOUND_S)
    if found is None:
        assert got is None
        return
    assert got is not None and len(got) == len(found), got
    for text_part, line in zip(found, got, strict=True):
        assert text_part in line, line


@pytest.mark.parametrize("value, seconds", [("60s", 60.0), ("1m", 60.0), ("500ms", 0.5), ("30", 30.0),
                                            ("1m30s", 90.0), ("1w", 604800.0), ("soon", None), ("", None), ("5x", None)])
def test_nginx_seconds(value: str, seconds: float | None) -> None:
    assert nginx_seconds(value) == seconds


def test_the_readmes_snippet_sends_a_request_with_no_byte_yet_to_the_peer() -> None:
    text = README.read_text().split("\n### nginx\n", 1)[1].split("```nginx\n", 1)[1].split("```", 1)[0]
    assert retry_findings(text, "llm", BOUND_S) == []
    before = text.replace(" non_idempotent;", ";")  # the snippet before issue 33
    assert len(retry_findings(before, "llm", BOUND_S) or []) == 1
