"""Clients of the replicas through the proxy, run inside the test container: stdlib only.

    python3 loadgen.py URL MODEL OUT.jsonl [--clients 8] [--max-tokens 40] [--stop-file F] [--mode M]

Each client loops: a streaming completion, then a plain one, and so on (--mode stream or plain:
only those), until the stop file exists. Every request is one JSON line in OUT: start and end (wall time), whether it failed, and
how (HTTP status, "reset", "timeout", "truncated": a stream that ended without [DONE]), a stream's
time to its first token (ttft_s), the status
it was answered with (None: no answer at all), and which upstreams nginx tried (its X-Upstream
header, "A, B" when it retried on B).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import threading
import time
from urllib.parse import urlsplit

LOCK = threading.Lock()


def one(url: str, model: str, max_tokens: int, stream: bool, timeout_s: float, prompt: str = "hello there") -> dict:
    parts = urlsplit(url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
    rec: dict = {"t0": time.time(), "stream": stream, "failed": None, "upstream": None, "status": None,
                 "ttft_s": None}
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        rec["status"] = resp.status  # a 200's headers: nginx had the replica's first bytes, and sent them on
        rec["upstream"] = resp.getheader("X-Upstream")
        data = b""
        while stream and (line := resp.readline()):
            if rec["ttft_s"] is None and line.startswith(b"data: "):
                rec["ttft_s"] = time.time() - rec["t0"]  # its first token reached the client
            data += line
        data += resp.read()
        if resp.status != 200:
            rec["failed"] = f"HTTP {resp.status}: {data[:200].decode(errors='replace')}"
        elif stream and b"data: [DONE]" not in data:
            rec["failed"] = "truncated"
    except TimeoutError:
        rec["failed"] = "timeout"
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        rec["failed"] = f"reset: {type(e).__name__}: {e}"
    finally:
        conn.close()
    rec["t1"] = time.time()
    return rec


def client(args: argparse.Namespace, out, i: int) -> None:
    stream = i % 2 == 0 if args.mode == "mixed" else args.mode == "stream"
    n = 0
    while not os.path.exists(args.stop_file):
        n += 1
        prompt = f"{args.prefix} client {i} request {n}" if args.prefix else "hello there"
        rec = one(args.url, args.model, args.max_tokens, stream, args.timeout_s, prompt)
        rec["client"] = i
        with LOCK:
            out.write(json.dumps(rec) + "\n")
            out.flush()
        if args.mode == "mixed":
            stream = not stream


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--stop-file", default="/run/loadgen.stop")
    p.add_argument("--prefix", default="", help="a prompt prefix every request shares (a system prompt)")
    p.add_argument("--mode", choices=["mixed", "stream", "plain"], default="mixed",
                   help="mixed: each client alternates streaming and plain completions")
    args = p.parse_args()
    with open(args.out, "a", buffering=1) as out:
        threads = [threading.Thread(target=client, args=(args, out, i)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
