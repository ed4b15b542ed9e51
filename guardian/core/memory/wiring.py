"""Is a replica's unit wired for the memory guard? Pure: judges what systemd reports and what
the unit's environment files say (the observer reads them).

Wired means, by systemd's semantics (systemd.exec(5): files are read in the order listed, a
later file overrides an earlier one, and every EnvironmentFile= overrides Environment=):

1. guardian's file for the replica is one of the unit's EnvironmentFile= entries;
2. no EnvironmentFile= listed after it sets GPU_MEMORY_UTILIZATION (a later file that does
   would win, and silently cancel every lowering), and each later file can be read to tell;
3. its ExecStart= passes ``--gpu-memory-utilization ${GPU_MEMORY_UTILIZATION}`` (or
   ``$GPU_MEMORY_UTILIZATION``, or the ``--gpu-memory-utilization=...`` form): the flag is its
   engine's knob (guardian/engines/: SGLang's --mem-fraction-static, TensorRT-LLM's
   --kv_cache_free_gpu_memory_fraction); an engine with none (llama.cpp) is never wired.

Otherwise a restart would start it with the same fraction and free nothing. What the restarted
replica really runs with is confirmed afterwards (core/memory/memguard.py, M4/M5), and a serving
replica that reports another fraction than guardian's file counts as not wired (core/memory/memview.py, M9).
"""

from __future__ import annotations

import re

from ...config import MIN_FRACTION
from ..observations import EnvFile as EnvFile  # the observed value it judges, named here too
from ..observations import UnitWiring

VAR = "GPU_MEMORY_UTILIZATION"
VAR_FORMS = ("${GPU_MEMORY_UTILIZATION}", "$GPU_MEMORY_UTILIZATION")
# Below MIN_FRACTION a value is a typo or a hostile label (1e-320, a subnormal), and the memory
# guard's arithmetic on it (steps, floors, bytes freed) would mean nothing; MemoryConfig.floor is
# bounded by it too, so guardian never writes a fraction it would not read back.
MAX_FRACTION = 1.0
# What guardian writes ({:g} of a fraction >= MIN_FRACTION) and what vLLM's label and a person's
# env file hold: digits and one point. No sign, exponent, underscore, inf or nan, as float() takes.
_PLAIN_DECIMAL = re.compile(r"[0-9]{1,3}(\.[0-9]{0,17})?|\.[0-9]{1,17}")


def env_value(text: str, key: str = VAR) -> str | None:
    """The last assignment of KEY in an environment file's text (systemd's KEY=VALUE format)."""
    found = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            found = value.strip().strip("\"'")
    return found


def parse_fraction(value: str | None) -> float | None:
    """A gpu-memory-utilization value, or None when it is not a plain decimal within
    [MIN_FRACTION, MAX_FRACTION]."""
    if value is None or not _PLAIN_DECIMAL.fullmatch(value):
        return None
    fraction = float(value)
    return fraction if MIN_FRACTION <= fraction <= MAX_FRACTION else None


KNOB = "--gpu-memory-utilization"  # vLLM's, the default engine's


def wiring_problem(
    unit: str,
    env_files: tuple[EnvFile, ...],
    exec_start: tuple[str, ...],
    env_path: str,
    knob: str | None = KNOB,
    engine: str = "vLLM",
) -> str | None:
    """Why UNIT does not pass guardian's fraction to its server with KNOB (ENGINE's memory flag;
    None: it has none), or None: it does."""
    if knob is None:
        return f"{engine} has no memory fraction to lower (its own flags size it): the memory guard never lowers it"
    problems = []
    paths = [e.path for e in env_files]
    if env_path not in paths:
        problems.append(f"add EnvironmentFile=-{env_path} to {unit}, after every other EnvironmentFile= line")
    else:
        later = env_files[len(paths) - paths[::-1].index(env_path) :]
        for later_file in later:
            if later_file.error is not None:
                problems.append(
                    f"{later_file.path} comes after guardian's {env_path} in {unit} and cannot be read to check "
                    f"that it does not set {VAR} ({later_file.error})"
                )
            elif later_file.text is not None and env_value(later_file.text) is not None:
                problems.append(
                    f"{later_file.path} comes after guardian's {env_path} in {unit} and sets {VAR}: it overrides "
                    f"every lowering; remove {VAR} from it, or list guardian's file last"
                )
    argv = list(exec_start)
    passes = any(
        (a == knob and i + 1 < len(argv) and argv[i + 1] in VAR_FORMS) or a in tuple(f"{knob}={v}" for v in VAR_FORMS)
        for i, a in enumerate(argv)
    )
    if not passes:
        problems.append(f"pass {knob} ${{{VAR}}} in ExecStart= of {unit}")
    if not problems:
        return None
    return "; ".join(problems) + (f" (systemctl edit --full {unit}; keep a default with Environment={VAR}=0.78)")


def cmdline_fraction(argv: tuple[str, ...], knob: str | None = KNOB) -> float | None:
    """KNOB (its engine's memory flag) from a process's command line: what a running server was given."""
    if knob is None:
        return None
    for at, arg in enumerate(argv):
        if arg == knob and at + 1 < len(argv):
            return parse_fraction(argv[at + 1])
        if arg.startswith(knob + "="):
            return parse_fraction(arg.partition("=")[2])
    return None


def problem_of(wiring: UnitWiring | None) -> str | None:
    """Why the memory guard cannot lower a replica whose unit shows WIRING, or None: wired."""
    if wiring is None:
        return "wiring not checked yet"
    if wiring.unseen is not None:
        return wiring.unseen
    return wiring_problem(wiring.unit, wiring.env_files, wiring.exec_start, wiring.env_path, wiring.knob, wiring.engine)
