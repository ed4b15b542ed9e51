"""Drive a running simulator: inject faults, set load, read its state.

    python3 -m vllm_sim.ctl URL fault engine-dead
    python3 -m vllm_sim.ctl URL fault slow-health '{"delay_s": 4}'
    python3 -m vllm_sim.ctl URL fault stall-endpoints '{"stall_s": 20}'
    python3 -m vllm_sim.ctl URL fault engine-frozen
    python3 -m vllm_sim.ctl URL fault spinning '{"busy": 0.5}'
    python3 -m vllm_sim.ctl URL load 4
    python3 -m vllm_sim.ctl URL prefill '{"prompt_tokens": 7185, "chunk_tokens": 7185, "chunk_s": 60}'
    python3 -m vllm_sim.ctl URL clear | state
"""

import json
import sys
import urllib.request


def call(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    url, verb, rest = argv[0], argv[1], argv[2:]
    if verb == "fault":
        out = call(url, "/_sim/fault", {"fault": rest[0], **(json.loads(rest[1]) if len(rest) > 1 else {})})
    elif verb == "load":
        extra = json.loads(rest[1]) if len(rest) > 1 else {}
        out = call(url, "/_sim/load", {"streams": int(rest[0]), **extra})
    elif verb == "prefill":
        out = call(url, "/_sim/prefill", json.loads(rest[0]) if rest else {})
    elif verb == "clear":
        out = call(url, "/_sim/clear", {})
    elif verb == "state":
        out = call(url, "/_sim/state")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
