"""The baseline for the benchmark only: what a Kubernetes liveness probe does by default.

GET URL/health every 10 s with a 1 s timeout; after 3 consecutive failures, restart UNIT.
    python3 baseline_prober.py http://127.0.0.1:8001 vllm-a.service
"""

import subprocess
import sys
import time
import urllib.request

PERIOD_S, TIMEOUT_S, FAILURE_THRESHOLD = 10.0, 1.0, 3


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=TIMEOUT_S) as r:
            return 200 <= r.status < 400
    except Exception:
        return False


def main(url: str, unit: str) -> None:
    failures = 0
    while True:
        if healthy(url):
            failures = 0
        else:
            failures += 1
            if failures >= FAILURE_THRESHOLD:
                print(f"baseline: {failures} failed probes of {url}/health: restarting {unit}", flush=True)
                subprocess.run(["systemctl", "restart", unit], check=False)
                failures = 0
        time.sleep(PERIOD_S)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
