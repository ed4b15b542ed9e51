"""Reading vLLM's start errors from a unit's journal lines, and checking a unit's wiring."""

from __future__ import annotations

from pathlib import Path

from guardian.unitlog import find_start_error
from guardian.wiring import read_env_fraction, wiring_problem

MEM_074 = ("ValueError: Free memory on device cuda:0 (1.40/2.00 GiB) on startup is less than desired GPU memory "
           "utilization (0.74, 1.48 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")


def test_memory_refusal_is_found_and_matched_to_its_fraction():
    lines = ["INFO starting", "ERROR [sim] EngineCore failed to start.", MEM_074, "INFO Started"]
    assert find_start_error(lines) == MEM_074
    assert find_start_error(lines, 0.74) == MEM_074
    assert find_start_error(lines, 0.7) == "ERROR [sim] EngineCore failed to start."
    assert find_start_error(["INFO all good"]) is None


ENV = Path("/var/lib/guardian/replicas/a.env")


def test_wiring():
    good = ("/usr/bin/vllm", "serve", "m", "--gpu-memory-utilization", "${GPU_MEMORY_UTILIZATION}")
    assert wiring_problem("u.service", (str(ENV),), good, ENV) is None
    assert wiring_problem("u.service", (str(ENV),), ("vllm", "--gpu-memory-utilization=$GPU_MEMORY_UTILIZATION"), ENV) is None
    p = wiring_problem("u.service", (), good, ENV)
    assert "EnvironmentFile=-/var/lib/guardian/replicas/a.env" in p and "ExecStart" not in p.split(" to ")[0]
    p = wiring_problem("u.service", (str(ENV),), ("vllm", "--gpu-memory-utilization", "0.78"), ENV)
    assert "--gpu-memory-utilization ${GPU_MEMORY_UTILIZATION} in ExecStart=" in p


def test_env_file_reading(tmp_path):
    f = tmp_path / "a.env"
    assert read_env_fraction(f) is None
    f.write_text("# by guardian\nGPU_MEMORY_UTILIZATION=0.74\n")
    assert read_env_fraction(f) == 0.74
    f.write_text("GPU_MEMORY_UTILIZATION=lots\n")
    assert read_env_fraction(f) is None
    f.write_text("GPU_MEMORY_UTILIZATION=7.4\n")
    assert read_env_fraction(f) is None
