"""Reading vLLM's start errors from a unit's journal lines, and checking a unit's wiring."""

from __future__ import annotations

from pathlib import Path

import pytest

from guardian.observe.unitlog import find_start_error
from guardian.core.memory.wiring import EnvFile, wiring_problem
from guardian.observe.memory import read_env_fraction
from harness import returns_within

MEM_074 = ("ValueError: Free memory on device cuda:0 (1.40/2.00 GiB) on startup is less than desired GPU memory "
           "utilization (0.74, 1.48 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")


ULIMIT = ("(APIServer pid=4242) WARNING 11-30 10:01:02 [system_utils.py:255] Found ulimit of 1024 and failed to "
          "automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors")


def test_memory_refusal_is_found_and_matched_to_its_fraction():
    lines = ["INFO starting", "ERROR [sim] EngineCore failed to start.", MEM_074, "INFO Started"]
    assert find_start_error(lines) == MEM_074
    assert find_start_error(lines, 0.74) == MEM_074
    assert find_start_error(lines, 0.7) is None  # a refusal of another fraction is not this start's
    assert find_start_error(["INFO all good"]) is None


def test_a_warning_that_says_error_is_not_a_failed_start():
    assert find_start_error([ULIMIT, "ERROR something else", "INFO Application startup complete."], 0.74) is None


ENV = "/var/lib/guardian/replicas/a.env"
GOOD = ("/usr/bin/vllm", "serve", "m", "--gpu-memory-utilization", "${GPU_MEMORY_UTILIZATION}")


def files(*entries) -> tuple[EnvFile, ...]:
    return tuple(e if isinstance(e, EnvFile) else EnvFile(e, "") for e in entries)


def test_wiring():
    assert wiring_problem("u.service", files(ENV), GOOD, ENV) is None
    assert wiring_problem("u.service", files(ENV), ("vllm", "--gpu-memory-utilization=$GPU_MEMORY_UTILIZATION"),
                          ENV) is None
    p = wiring_problem("u.service", (), GOOD, ENV)
    assert "add EnvironmentFile=-/var/lib/guardian/replicas/a.env" in p and "ExecStart" not in p
    p = wiring_problem("u.service", files(ENV), ("vllm", "--gpu-memory-utilization", "0.78"), ENV)
    assert "pass --gpu-memory-utilization ${GPU_MEMORY_UTILIZATION} in ExecStart=" in p


@pytest.mark.parametrize("later, problem", [
    (EnvFile("/etc/vllm/a.env", "MODEL=m\nGPU_MEMORY_UTILIZATION=0.9\n"), "/etc/vllm/a.env comes after"),
    (EnvFile("/etc/vllm/a.env", 'export_not=1\nGPU_MEMORY_UTILIZATION="0.9"\n'), "sets GPU_MEMORY_UTILIZATION"),
    (EnvFile("/etc/vllm/a.env", None, "Permission denied"), "cannot be read"),
    (EnvFile("/etc/vllm/a.env", "MODEL=m\n# GPU_MEMORY_UTILIZATION=0.9\n"), None),  # does not set it
    (EnvFile("/etc/vllm/a.env", None), None),  # optional and absent
])
def test_a_later_environment_file_that_sets_the_fraction_overrides_guardians(later, problem):
    """systemd reads EnvironmentFile= in order and the later file wins (systemd.exec(5))."""
    p = wiring_problem("u.service", files(ENV, later), GOOD, ENV)
    assert (p is None) if problem is None else (problem in p)
    # the same file listed before guardian's is harmless
    assert wiring_problem("u.service", files(later, ENV), GOOD, ENV) is None


def test_env_file_reading(tmp_path):
    f = tmp_path / "a.env"
    assert read_env_fraction(f) is None
    f.write_text("# by guardian\nGPU_MEMORY_UTILIZATION=0.74\n")
    assert read_env_fraction(f) == 0.74
    f.write_text("GPU_MEMORY_UTILIZATION=lots\n")
    assert read_env_fraction(f) is None
    f.write_text("GPU_MEMORY_UTILIZATION=7.4\n")
    assert read_env_fraction(f) is None
    f.write_text("GPU_MEMORY_UTILIZATION=1e-320\n")
    assert read_env_fraction(f) is None


@pytest.mark.parametrize("value, fraction", [
    ("0.9", 0.9), ("0.74", 0.74), ("1", 1.0), ("1.0", 1.0), (".5", 0.5), ("0.01", 0.01), ("0.50000000000000001", 0.5),
    # issue 21: float() takes all of these; none is a fraction vLLM runs with
    ("1e-320", None), ("5e-324", None), ("9e-1", None), ("0.009", None), ("0", None), ("0.0", None), ("1.01", None),
    ("-0.5", None), ("+0.5", None), ("nan", None), ("inf", None), ("0_9", None), ("0x1p-1", None), (" 0.9", None),
    ("", None), ("0." + "9" * 40, None), ("٠.٥", None),
])
def test_a_fraction_is_a_plain_decimal_from_one_hundredth_to_one(value, fraction):
    from guardian.core.memory.wiring import cmdline_fraction, parse_fraction

    assert parse_fraction(value) == fraction
    assert cmdline_fraction(("vllm", "serve", "m", "--gpu-memory-utilization", value)) == fraction
    assert cmdline_fraction(("vllm", f"--gpu-memory-utilization={value}")) == fraction


def test_the_shipped_example_unit_is_wired_even_with_the_operators_file_setting_the_fraction():
    """units/vllm-replica@.service lists guardian's file last, so /etc/vllm/a.env cannot override it."""
    text = (Path(__file__).resolve().parent.parent / "units" / "vllm-replica@.service").read_text()
    entries = [line.split("=", 1)[1].lstrip("-").replace("%i", "a") for line in text.splitlines()
               if line.startswith("EnvironmentFile=")]
    exec_start = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ExecStart="))
    found = tuple(EnvFile(e, "GPU_MEMORY_UTILIZATION=0.9\n" if e.startswith("/etc/") else None) for e in entries)
    assert wiring_problem("vllm-replica@a.service", found, tuple(exec_start.split()), ENV) is None
    assert "LimitNOFILE=65536" in text


def test_a_fifo_or_a_device_as_an_environment_file_is_unreadable_not_a_hang(tmp_path):
    """issue 21: the observer reads guardian's env file on the event loop and the units'
    EnvironmentFile= paths in a thread; a FIFO there would block it for ever."""
    import os

    from guardian.observe.memory import read_env_file

    fifo = tmp_path / "a.env"
    os.mkfifo(fifo)
    assert returns_within(5.0, read_env_fraction, fifo, unblock=[fifo]) is None
    e = returns_within(5.0, read_env_file, str(fifo), unblock=[fifo])
    assert e.text is None and e.error == "not a regular file (a FIFO)"
    p = wiring_problem("u.service", (EnvFile(ENV, ""), e), GOOD, ENV)
    assert p is not None and f"{fifo} comes after" in p and "cannot be read" in p and "(not a regular file (a FIFO))" in p
    zero = tmp_path / "zero.env"
    os.symlink("/dev/zero", zero)
    assert returns_within(5.0, read_env_fraction, zero) is None
    assert returns_within(5.0, read_env_file, str(zero)).error == "not a regular file (a character device)"
    big = tmp_path / "big.env"
    big.write_bytes(b"#" * (2**20))
    assert read_env_file(str(big)).error == f"larger than {64 * 2**10} bytes"
    # an operator's env file may be a link to a regular file, as systemd follows it; guardian's own is never followed
    real = tmp_path / "real.env"
    real.write_text("GPU_MEMORY_UTILIZATION=0.5\n")
    link = tmp_path / "link.env"
    link.symlink_to(real)
    assert read_env_file(str(link)).text == "GPU_MEMORY_UTILIZATION=0.5\n"
    assert read_env_fraction(real) == 0.5 and read_env_fraction(link) is None
    assert read_env_file(str(tmp_path / "absent.env")) == EnvFile(str(tmp_path / "absent.env"), None)
