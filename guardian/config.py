"""guardian's one typed configuration object, loaded from TOML with pydantic-settings.

Precedence, highest first: ``GUARDIAN_*`` environment variables (nested keys with ``__``,
e.g. ``GUARDIAN_WATCHDOG__STALL_WINDOW_S=90``), then the TOML file, then the defaults here.
Unknown keys are errors: a typo must not silently leave a default in force. Numbers must be
finite and within stated bounds; unit names follow systemd's grammar; a replica's URL is a plain
base URL whose host is a host name, an IPv4 address or a bracketed IPv6 address (it is written
into nginx's include file and the file_sd targets); ``interval_s`` and the probe timeouts stay
well inside systemd's watchdog; and any failure to read or parse (deep nesting, bad JSON in an
environment override) is a ConfigError, which the CLI turns into exit status 2 and a reload into
"reload refused".
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

DEFAULT_CONFIG_PATH = Path("/etc/guardian/guardian.toml")
CONFIG_ENV = "GUARDIAN_CONFIG"
SHIPPED_WATCHDOG_S = 30.0  # WatchdogSec= of the shipped guardian.service
MAX_WINDOW_S = 30 * 86400.0  # no window or timeout is longer than 30 days
# All of a tick's container helper waits together (each replica's are concurrent): past it, the
# ports are judged without the containers (G7 refuses a holder it cannot name) and unit-less
# replicas are unknown for the tick, so a hung engine CLI never holds the loop up past systemd's
# watchdog (observe/containers.ContainerWatch.views; counted by _inside_the_watchdog).
CONTAINER_PHASE_S = 5.0
# The lowest gpu-memory-utilization fraction guardian believes or writes (core/wiring.parse_fraction):
# 1% of a GPU holds no model vLLM serves; below it a value is a typo or hostile (1e-320).
MIN_FRACTION = 0.01
# systemd.unit(5): letters, digits, ":", "-", "_", ".", "\\"; "@" separates a template's instance.
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\-]+(@[A-Za-z0-9:_.\\-]+)?\.service")
# RFC 1123: letters, digits and '-', neither first nor last, at most 63.
_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# A URL's authority once "@" is refused: a bracketed or a plain host, then an optional :PORT.
_AUTHORITY = re.compile(r"(?P<host>\[[^\]]*\]|[^:\[\]]*)(:(?P<port>[0-9]+))?")
HOST_GRAMMAR = (
    "a host name (dot-separated labels of letters, digits and inner '-', the last not all digits), "
    "an IPv4 address, or an IPv6 address in brackets such as [::1]"
)


def watchdog_s() -> float:
    """systemd's watchdog period for guardian: $WATCHDOG_USEC where systemd runs it with one
    (WatchdogSec=), else the shipped unit's 30 s (for `guardian check` and the like)."""
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return SHIPPED_WATCHDOG_S
    return usec / 1e6 if usec > 0 else SHIPPED_WATCHDOG_S


def is_host(host: str) -> bool:
    """HOST as written in a URL or an nginx server line: a host name (RFC 1123), an IPv4 address,
    or an IPv6 address in brackets (without a zone: nginx takes none). Nothing else, so nothing
    that means something to nginx (';', '{', quotes, '$') reaches its include file."""
    if host.startswith("[") and host.endswith("]") and "%" not in host:
        try:
            ipaddress.IPv6Address(host[1:-1])
            return True
        except ValueError:
            return False
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        pass
    labels = host.split(".")
    # An all-digit last label would be an IPv4 address (or 010.1, 256.0.0.1) in disguise.
    return len(host) <= 253 and all(_HOST_LABEL.fullmatch(x) for x in labels) and not labels[-1].isdigit()


def _check_base_url(v: str) -> str:
    """A replica's (or a peer's) own base URL: http(s), a host, a real port, nothing else."""
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in v):
        raise ValueError(f"has a control character or a space ({v!r})")
    try:
        parts = urlsplit(v)
    except ValueError as e:  # e.g. an unclosed or invalid [IPv6] literal
        raise ValueError(f"is not a URL: {e} (got {v!r})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000 (got {v!r})")
    if "@" in parts.netloc:
        raise ValueError("must not carry a user or password (it would be printed in logs)")
    authority = _AUTHORITY.fullmatch(parts.netloc)
    if authority is None or not is_host(authority["host"]):
        host = authority["host"] if authority is not None else re.sub(r":[0-9]*$", "", parts.netloc)
        raise ValueError(f"host {host!r} is not {HOST_GRAMMAR} (got {v!r})")
    if parts.query or parts.fragment or v.endswith(("?", "#")):
        raise ValueError(f"must be a base URL without a query or fragment ({v!r})")
    try:
        port = parts.port  # urlsplit checks the port only when asked
    except ValueError as e:
        raise ValueError(f"has an invalid port ({v!r})") from e
    if port == 0:
        raise ValueError(f"has port 0, which no server listens on ({v!r})")
    return v.rstrip("/")


def _endpoint(url: str) -> tuple[str, int]:
    """(host, port) as a connection sees it: case folded, localhost and loopback literals as one."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    try:
        ip = ipaddress.ip_address(host)
        host = "loopback" if ip.is_loopback else ip.compressed
    except ValueError:
        if host == "localhost" or host.endswith(".localhost"):
            host = "loopback"
    return host, parts.port or (443 if parts.scheme == "https" else 80)


def _plain_text(v: str, max_chars: int) -> str:
    if len(v) > max_chars or any(ord(c) < 0x20 or ord(c) == 0x7F for c in v):
        raise ValueError(f"must be at most {max_chars} characters, without control characters")
    return v


class ConfigError(Exception):
    """A configuration that guardian refuses to run with; the message names file, key and reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# A container's name as Docker accepts it ([a-zA-Z0-9][a-zA-Z0-9_.-]+: two characters at least).
_CONTAINER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{1,127}")


_ENGINE_UNITS = frozenset({"docker.service", "containerd.service", "podman.service"})


def _runtime_was_engine(data: Any) -> Any:
    """`engine = "docker"` or `"podman"`, as configs before 0.3 named the container runtime: read as
    `runtime`, so an upgrade keeps them working (the serving engine is then the default)."""
    if isinstance(data, dict) and data.get("engine") in ("docker", "podman"):
        if "runtime" in data and data["runtime"] != data["engine"]:
            raise ValueError(
                f"engine = {data['engine']!r} (the container runtime, as configs before 0.3 wrote it) and "
                f"runtime = {data['runtime']!r} disagree; keep `runtime` only"
            )
        data = {k: v for k, v in data.items() if k != "engine"} | {"runtime": data["engine"]}
    return data


class ReplicaConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", min_length=1, max_length=64)
    # The systemd unit that serves the replica. Left out only for a Docker container kept by its
    # own restart policy: the replica is then known as "docker:CONTAINER" (README, Replicas in containers).
    unit: str
    # The replica runs in a container of this name (`docker run --name`, `podman run --name`,
    # Compose's container name): guardian recognises it on the port and kills it when it hangs.
    container: str | None = None
    # The container runtime that runs `container` (before 0.3 this was `engine`, still read so: _runtime_was_engine).
    runtime: Literal["docker", "podman"] = "docker"
    # The serving engine (guardian/engines/): whose endpoints, metric names and memory knob the replica
    # has; "auto" tells it from the unit's command line, or the container's image and command, at start.
    engine: Literal["vllm", "llama.cpp", "sglang", "trtllm", "auto"] = "vllm"
    url: str
    model: str = Field(min_length=1)
    startup_grace_s: float = Field(default=1200.0, gt=0, le=MAX_WINDOW_S)
    health_timeout_s: float = Field(default=2.0, gt=0, le=MAX_WINDOW_S)
    metrics_timeout_s: float = Field(default=3.0, gt=0, le=MAX_WINDOW_S)
    canary_timeout_s: float = Field(default=15.0, gt=0, le=MAX_WINDOW_S)
    upstream: str = Field(default="llm", pattern=r"^[A-Za-z0-9_-]+$", max_length=64)  # nginx upstream ([proxy])
    # Warm-up requests (issue 33): a JSONL file of completion or chat requests (its clients' shared
    # system prompts and tool definitions), served one token each before a replica that comes back
    # from a restart or a drain is marked up at the proxy, within warmup_timeout_s in all.
    warmup_file: Path | None = None
    warmup_timeout_s: float = Field(default=30.0, gt=0, le=MAX_WINDOW_S)

    @model_validator(mode="before")
    @classmethod
    def _unitless_container(cls, data: Any) -> Any:
        data = _runtime_was_engine(data)
        if isinstance(data, dict) and "unit" not in data and isinstance(data.get("container"), str):
            if data.get("runtime", "docker") != "docker":
                raise ValueError(
                    "a replica without `unit` is a Docker container kept by its restart policy; a Podman "
                    "container needs the unit that runs it (Quadlet writes one)"
                )
            return {**data, "unit": f"docker:{data['container']}"}
        return data

    @field_validator("container")
    @classmethod
    def _container_name(cls, v: str | None) -> str | None:
        if v is not None and not _CONTAINER_NAME.fullmatch(v):
            raise ValueError(
                f"must be a container name as Docker and Podman write it (a letter or digit, then at least one of "
                f"letters, digits, '_', '.', '-'; at most 128 characters; got {v!r})"
            )
        return v

    @model_validator(mode="after")
    def _unitless_matches(self) -> ReplicaConfig:
        if self.unit.startswith("docker:") and self.unit != f"docker:{self.container}":
            raise ValueError(
                f"unit {self.unit!r} is not a systemd service; leave `unit` out for a Docker container kept by "
                "its restart policy and name it in `container`"
            )
        return self

    @property
    def unitless(self) -> bool:
        """A Docker container that no unit runs (its restart policy keeps it)."""
        return self.container is not None and self.unit == f"docker:{self.container}"

    @field_validator("model")
    @classmethod
    def _model_is_text(cls, v: str) -> str:
        return _plain_text(v, 512)

    @field_validator("unit")
    @classmethod
    def _unit_is_service(cls, v: str) -> str:
        if v.startswith("docker:") and _CONTAINER_NAME.fullmatch(v[len("docker:") :]):
            return v  # set by _unitless_container; compared with `container` in _unitless_matches
        if v in _ENGINE_UNITS:
            raise ValueError(
                f"{v} is a container engine's own unit: restarting or killing it would take down every container "
                "of the box; name the replica's own unit, or leave `unit` out for a container that no unit runs"
            )
        if len(v) > 255 or not _UNIT_NAME.fullmatch(v):
            raise ValueError(
                f"must be a systemd service unit name (letters, digits, ':', '-', '_', '.', '\\', an optional "
                f"'@instance' that is not empty, ending in '.service', at most 255 characters; got {v!r})"
            )
        return v

    @field_validator("url")
    @classmethod
    def _url_is_base_url(cls, v: str) -> str:
        return _check_base_url(v)

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def host(self) -> str:
        """The URL's host, as a connection to it names it (an IPv6 literal without brackets)."""
        return urlsplit(self.url).hostname or ""


class WatchdogConfig(_Strict):
    stall_window_s: float = Field(default=60.0, gt=0, le=MAX_WINDOW_S)
    unresponsive_after_s: float = Field(default=10.0, gt=0, le=MAX_WINDOW_S)
    # 10 s: with the closer look (core/watchdog/canary.py), a frozen idle engine is found within about
    # 10 + 3 + 15 s (interval + the learned deadline's floor + canary_timeout_s): 30 s at p95 (issue 35).
    canary_interval_s: float = Field(default=10.0, gt=0, le=MAX_WINDOW_S)
    canary_retry_s: float = Field(default=5.0, gt=0, le=MAX_WINDOW_S)
    # A canary soon after traffic stops (an engine that froze between two steps looks idle).
    canary_after_traffic_s: float = Field(default=5.0, gt=0, le=MAX_WINDOW_S)
    # Work queued and nothing at all moving (no counter, no kv change) this long: send a canary.
    stall_canary_after_s: float = Field(default=10.0, gt=0, le=MAX_WINDOW_S)
    # A canary's deadline once 3 have succeeded: factor x the slowest of the last 8, within
    # [floor, replica's canary_timeout_s].
    canary_deadline_factor: float = Field(default=4.0, ge=1, le=100)
    canary_deadline_floor_s: float = Field(default=3.0, gt=0, le=MAX_WINDOW_S)
    canary_failures: int = Field(default=2, ge=1, le=1000)
    restart_budget: int = Field(default=3, ge=1, le=1000)
    restart_window_s: float = Field(default=1800.0, gt=0, le=MAX_WINDOW_S)
    backoff_s: float = Field(default=60.0, ge=0, le=MAX_WINDOW_S)
    restart_job_timeout_s: float = Field(default=300.0, gt=0, le=MAX_WINDOW_S)
    # The longest a learned step keeps the stall window (L13) and a stall canary (L14) waiting: the
    # field's own hang timeouts (vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, SGLang's
    # --watchdog-timeout, TensorRT-LLM's) are 300 s, and a /metrics page can say anything.
    max_step_s: float = Field(default=300.0, gt=0, le=MAX_WINDOW_S)
    # The kernel's view of each replica's connections (docs/rules.md, What the kernel shows): a client
    # whose request has had no byte of answer for this long, with nothing moving, is queued work.
    client_wait_s: float = Field(default=3.0, gt=0, le=MAX_WINDOW_S)
    # A replica's own processes (observe/procs.py; docs/rules.md L19-L22, C5): a group is quiet at a
    # look when it used at most quiet_cpu of one core (CPU plus run-queue wait) since the previous
    # look AND none of its processes was running, runnable or in uninterruptible wait. Quiet through
    # engine_quiet_s with nothing moving proves a hang. 4 s: two looks at the default 2 s interval
    # (one look may fall in a pause), 40x the longest pause a working engine makes between steps
    # (a decode step is 10-100 ms; a long prefill chunk burns CPU all through), and short enough
    # that a frozen engine with work is restarted within 10 s. 0.01 of a core: a frozen process
    # uses 0; the clock counts CPU in 10 ms ticks, so 20 ms a look is the least it can tell from 0.
    engine_quiet_s: float = Field(default=4.0, gt=0, le=MAX_WINDOW_S)
    quiet_cpu: float = Field(default=0.01, ge=0, le=1)
    # An engine that serves from its own process (llama-server, trtllm-serve: guardian/engines/) answers
    # guardian's probes with the same process it computes in: each probe it answered at a look adds
    # this much CPU to what its quiet allows. A Python server spends 3-10 ms a probe (the simulator's
    # trtllm-serve: 10-30 ms for three), a C++ one well under 1 ms; a working engine far more.
    probe_cpu_s: float = Field(default=0.015, ge=0, le=1)
    # Peers that are not clients of their own: units ("x.service") or addresses. [proxy]'s
    # nginx_unit counts as a proxy when [proxy] is on.
    proxy_peers: list[str] = Field(default_factory=list, max_length=64)
    monitoring_peers: list[str] = Field(default_factory=lambda: ["prometheus.service"], max_length=64)
    # With a proxy configured, a client connected straight to a replica's port for this long is
    # a hazard ("point it at the proxy").
    bypass_after_s: float = Field(default=30.0, gt=0, le=MAX_WINDOW_S)

    @field_validator("proxy_peers", "monitoring_peers")
    @classmethod
    def _peers(cls, v: list[str]) -> list[str]:
        for peer in v:
            unit = len(peer) <= 255 and _UNIT_NAME.fullmatch(peer) is not None
            if not unit and not _is_address(peer):
                raise ValueError(f"{peer!r} is neither a unit name (x.service) nor an IP address")
        return v


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class MemoryConfig(_Strict):
    enabled: bool = False
    min_headroom_bytes: int = Field(default=8 * 2**30, ge=0)
    critical_headroom_bytes: int = Field(default=3 * 2**30, ge=0)
    sustain_s: float = Field(default=30.0, ge=0, le=MAX_WINDOW_S)
    psi_some_threshold_pct: float | None = Field(default=None, ge=0, le=100)
    step: float = Field(default=0.04, gt=0, le=0.5)
    floor: float = Field(default=0.50, ge=MIN_FRACTION, lt=1)  # a lower fraction is not read back
    reserve_bytes: int = Field(default=2**30, ge=0)
    cooldown_s: float = Field(default=600.0, ge=0, le=MAX_WINDOW_S)
    device_total_bytes: int | None = Field(default=None, gt=0)
    # The start guard (docs/rules.md "The start guard"): on whenever the memory guard is, since a replica's
    # start is when a GB10 runs out (and wedges); it acts only below critical_headroom_bytes.
    start_guard: bool = True
    start_guard_interval_s: float = Field(default=0.5, gt=0, le=MAX_WINDOW_S)  # ticks while a replica loads
    priority: list[str] = Field(default_factory=list)
    peer_urls: list[str] = Field(default_factory=list)
    peer_timeout_s: float = Field(default=2.0, gt=0, le=MAX_WINDOW_S)
    # Raising a lowered fraction back toward its base (docs/rules.md "Raising a fraction back"): on by
    # default, since a guard that only ratchets down leaves memory unused after every squeeze.
    restore: bool = True
    restore_after_s: float = Field(default=600.0, gt=0, le=MAX_WINDOW_S)  # headroom clear this long first
    restore_cooldown_s: float = Field(default=600.0, ge=0, le=MAX_WINDOW_S)  # since the last change of fraction
    # A start that fits (docs/rules.md "A start that fits"): before every start guardian causes on a
    # unified-memory box, the replica's own model files' page cache is released where that makes it fit
    # (no privilege); the whole cache only when drop_caches is set (the root helper, off by default: it
    # costs every other program its warm cache). These apply whether or not the memory guard is enabled.
    release_cache: bool = True
    drop_caches: bool = False
    # Whether the GPU's memory is the box's (GB10): "auto" asks NVML (NOT_SUPPORTED for the device's memory).
    unified: bool | Literal["auto"] = "auto"

    @model_validator(mode="after")
    def _consistent(self) -> MemoryConfig:
        if self.critical_headroom_bytes > self.min_headroom_bytes:
            raise ValueError("critical_headroom_bytes must be <= min_headroom_bytes")
        if self.restore and self.restore_after_s <= self.sustain_s:
            raise ValueError(
                f"restore_after_s ({self.restore_after_s:g} s) must be > sustain_s ({self.sustain_s:g} s): headroom "
                "must stay clear longer than a squeeze must last, or the guard would raise and lower in turn "
                "(or set restore = false)"
            )
        for url in self.peer_urls:
            try:
                _check_base_url(url)
            except ValueError as e:
                raise ValueError(f"peer_urls: {url!r}: {e}") from None
        return self


class MetricsConfig(_Strict):
    """Prometheus: guardian's own metrics and the replicas as scrape targets. All off by default."""

    http: bool = False  # serve GET /metrics and /healthz on `address`
    address: str = "127.0.0.1:9464"
    textfile_dir: Path | None = None  # node_exporter's textfile collector directory: guardian.prom
    file_sd_path: Path | None = None  # a Prometheus file_sd JSON listing each replica's own /metrics
    box: str = ""  # the `box` label in file_sd; empty: this machine's host name

    @field_validator("address")
    @classmethod
    def _host_port(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"must be HOST:PORT with a port from 1 to 65535 (got {v!r})")
        if any(ord(c) < 0x21 or ord(c) == 0x7F for c in v):
            raise ValueError("must not contain spaces or control characters")
        return v

    @field_validator("textfile_dir", "file_sd_path")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_absolute():
            raise ValueError(f"must be an absolute path (got {str(v)!r})")
        return v

    @field_validator("box")
    @classmethod
    def _label(cls, v: str) -> str:
        return _plain_text(v, 253)

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host.strip("[]"), int(port)


class ProxyConfig(_Strict):
    """The proxy in front of the replicas (README "Under a proxy"). Off unless an nginx upstream
    file or a drain command is set."""

    # nginx: guardian owns one file per upstream here, NAME.conf, that the operator's `upstream NAME`
    # block includes (each replica's `upstream` key, default "llm").
    nginx_upstream_dir: Path | None = None
    nginx_unit: str = "nginx.service"  # reloaded over D-Bus after a change (polkit verb "reload")
    nginx_check_unit: str = "guardian-nginx-check.service"  # runs `nginx -t` as root (polkit verb "start")
    server_host: str = ""  # the host nginx reaches this box's replicas at; empty: each replica URL's host
    server_params: str = "max_fails=3 fail_timeout=30s"  # appended to every server line
    # Any other proxy: argv run with GUARDIAN_REPLICA, GUARDIAN_UNIT, GUARDIAN_URL in the environment.
    drain_command: list[str] = Field(default_factory=list)
    undrain_command: list[str] = Field(default_factory=list)
    command_timeout_s: float = Field(default=10.0, gt=0, le=MAX_WINDOW_S)
    drain_timeout_s: float = Field(default=120.0, gt=0, le=MAX_WINDOW_S)  # marked down -> restart at the latest
    stop_timeout_s: float = Field(
        default=30.0, gt=0, le=MAX_WINDOW_S
    )  # a drained unit's stop, then its processes are killed

    @field_validator("nginx_upstream_dir")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        if v is not None and (not v.is_absolute() or str(v) == "/"):
            raise ValueError(f"must be an absolute directory other than / (got {str(v)!r})")
        return v

    @field_validator("nginx_unit", "nginx_check_unit")
    @classmethod
    def _unit(cls, v: str) -> str:
        if v in _ENGINE_UNITS:
            raise ValueError(
                f"{v} is a container engine's own unit: restarting or killing it would take down every container "
                "of the box; name the replica's own unit, or leave `unit` out for a container that no unit runs"
            )
        if len(v) > 255 or not _UNIT_NAME.fullmatch(v):
            raise ValueError(f"must be a systemd service unit name ending in '.service' (got {v!r})")
        return v

    @field_validator("server_host")
    @classmethod
    def _host(cls, v: str) -> str:
        if v and not is_host(v):
            raise ValueError(f"host {v!r} is not {HOST_GRAMMAR}")
        return v

    @field_validator("server_params")
    @classmethod
    def _params(cls, v: str) -> str:
        # Each is a `key=value` or `backup`-like word: nothing that could end the server line.
        if not re.fullmatch(r"[A-Za-z0-9_=. -]{0,200}", v):
            raise ValueError(f"must be nginx server parameters such as 'max_fails=3 fail_timeout=30s' (got {v!r})")
        return v

    @field_validator("drain_command", "undrain_command")
    @classmethod
    def _argv(cls, v: list[str]) -> list[str]:
        if v and not v[0].startswith("/"):
            raise ValueError(f"must be an argv list whose first item is an absolute path (got {v!r})")
        for arg in v:
            _plain_text(arg, 4096)
        return v

    @property
    def enabled(self) -> bool:
        return self.nginx_upstream_dir is not None or bool(self.drain_command)


class FleetConfig(_Strict):
    """Planned restarts coordinated across boxes on etcd (README, A fleet). Off unless endpoints are set."""

    endpoints: list[str] = Field(default_factory=list)  # etcd client URLs (v3 API, JSON gateway)
    name: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)  # keys under /guardian/NAME/
    box: str = ""  # this box's name in the fleet; empty: the host name
    max_planned_restarts: int = Field(default=1, ge=1, le=1000)  # in the whole fleet at once
    min_serving: int = Field(default=1, ge=0, le=1000)  # other replicas of the model serving before one may begin
    lease_ttl_s: int = Field(
        default=10, ge=2, le=3600
    )  # a dead guardian's keys vanish this long after its last renewal
    timeout_s: float = Field(default=2.0, gt=0, le=MAX_WINDOW_S)  # each etcd request
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    username: str = ""
    password_file: Path | None = None  # the password, read at start (not in the config)

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        return [_check_base_url(u) for u in v]

    @field_validator("box")
    @classmethod
    def _box(cls, v: str) -> str:
        if v and not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", v):
            raise ValueError(f"must be letters, digits, '_', '.', '-' (got {v!r})")
        return v

    @model_validator(mode="after")
    def _pairs(self) -> FleetConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        if self.password_file is not None and not self.username:
            raise ValueError("password_file needs a username")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.endpoints)


_toml_data: ContextVar[dict[str, Any]] = ContextVar("_toml_data")


class _DictSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return None, field_name, False  # unused: __call__ gives the whole table

    def __call__(self) -> dict[str, Any]:
        return _toml_data.get({})


class Config(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="GUARDIAN_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
    )

    interval_s: float = Field(default=2.0, gt=0, le=MAX_WINDOW_S)
    dry_run: bool = False
    state_dir: Path = Path("/var/lib/guardian")
    runtime_dir: Path = Path("/run/guardian")
    shutdown_timeout_s: float = Field(default=10.0, gt=0, le=MAX_WINDOW_S)
    # With the system bus gone this long, guardian stops pinging systemd's watchdog (it is blind:
    # no unit view, no restart) so that systemd restarts it; it reconnects on its own before that.
    bus_lost_restart_s: float = Field(default=60.0, gt=0, le=MAX_WINDOW_S)
    # With no tick completed this long (each one abandoned for an unexpected error), guardian stops
    # pinging systemd's watchdog so that systemd restarts it: a fresh process may not repeat it.
    stuck_restart_s: float = Field(default=60.0, gt=0, le=MAX_WINDOW_S)
    watchdog: WatchdogConfig = WatchdogConfig()
    memory: MemoryConfig = MemoryConfig()
    metrics: MetricsConfig = MetricsConfig()
    proxy: ProxyConfig = ProxyConfig()
    fleet: FleetConfig = FleetConfig()
    replicas: list[ReplicaConfig] = Field(default_factory=list)

    @property
    def probe_wait_s(self) -> float:
        """How long a tick waits for its probes; one still running then is carried into the next
        tick. Half an interval: a healthy replica answers in milliseconds."""
        return self.interval_s / 2

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _DictSource(settings_cls))

    @field_validator("state_dir", "runtime_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        if not v.is_absolute() or str(v) == "/":
            raise ValueError(f"must be an absolute directory other than / (got {str(v)!r})")
        return v

    @field_validator("replicas")
    @classmethod
    def _replicas_distinct(cls, replicas: list[ReplicaConfig]) -> list[ReplicaConfig]:
        # Compared as systemd and a connection see them: names and units case-insensitively (a
        # journal filter or `guardian pause A` must not be ambiguous), URLs by host and port.
        keys: dict[str, Callable[[ReplicaConfig], str]] = {
            "name": lambda r: r.name.lower(),
            "unit": lambda r: r.unit.lower(),
            "address": lambda r: "{}:{}".format(*_endpoint(r.url)),
            "container": lambda r: f"{r.runtime}:{r.container}" if r.container is not None else "",
        }
        for attr, key in keys.items():
            seen: dict[str, str] = {}
            for r in replicas:
                k = key(r)
                if not k:
                    continue
                if k in seen:
                    raise ValueError(f"two replicas have the same {attr}: {seen[k]!r} and {r.name!r}")
                seen[k] = r.name
        return replicas

    @model_validator(mode="after")
    def _inside_the_watchdog(self) -> Config:
        """A tick starts every interval_s and can wait out a probe's timeout; systemd kills a
        guardian that does not ping within WatchdogSec. Each must stay <= a quarter of it."""
        limit_s = watchdog_s() / 4
        checks = [("interval_s", self.interval_s)]
        if self.memory.enabled and self.memory.peer_urls:  # peers are asked within the tick
            checks.append(("memory.peer_timeout_s", self.memory.peer_timeout_s))
        for i, r in enumerate(self.replicas):
            checks += [
                (f"replicas.{i}.health_timeout_s", r.health_timeout_s),
                (f"replicas.{i}.metrics_timeout_s", r.metrics_timeout_s),
            ]
        if any(r.container is not None for r in self.replicas):
            # the container helpers' waits in a tick, all together (observe/containers.CONTAINER_PHASE_S)
            checks.append(("the container helpers' wait with container replicas", CONTAINER_PHASE_S))
        over = [f"{k} = {v:g}" for k, v in checks if v > limit_s]
        if over:
            raise ValueError(
                f"{', '.join(over)}: must be <= {limit_s:g} s, a quarter of systemd's watchdog period "
                f"({watchdog_s():g} s), or systemd kills guardian while it waits"
            )
        return self

    @model_validator(mode="after")
    def _priority_names_replicas(self) -> Config:
        names = {r.name for r in self.replicas}
        unknown = [n for n in self.memory.priority if n not in names]
        if unknown:
            raise ValueError(f"memory.priority names no configured replica: {', '.join(unknown)}")
        return self

    @property
    def env_dir(self) -> Path:
        """Where guardian keeps each replica's GPU_MEMORY_UTILIZATION environment file."""
        return self.state_dir / "replicas"

    def replica(self, name: str) -> ReplicaConfig | None:
        return next((r for r in self.replicas if r.name == name), None)


def config_path(cli_path: str | None) -> Path:
    if cli_path:
        return Path(cli_path)
    return Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)


def _describe(err: ErrorDetails) -> str:
    key = ".".join(str(p) for p in err.get("loc", ())) or "(top level)"
    msg = err.get("msg", "invalid")
    if err.get("type") == "extra_forbidden":
        msg = "unknown key (typo?)"
    elif err.get("type") == "missing":
        msg = "required key is missing"
    msg = msg.removeprefix("Value error, ")
    env_name = "GUARDIAN_" + key.upper().replace(".", "__")
    if env_name in os.environ:
        return f"{key} (set by environment variable {env_name}): {msg}"
    return f"{key}: {msg}"


def load_config(path: Path) -> Config:
    """Read and validate PATH; raise ConfigError with one message per problem. Nothing else
    escapes: whatever goes wrong while reading or parsing is a ConfigError too."""
    try:
        return _load_config(path)
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError(f"config error in {path}: nested too deeply to read") from None
    except Exception as e:  # noqa: BLE001 - e.g. pydantic-settings' SettingsError for bad JSON in GUARDIAN_*
        raise ConfigError(f"config error in {path}: {type(e).__name__}: {e}") from None


def _load_config(path: Path) -> Config:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config error in {path}: file not found") from None
    except OSError as e:
        raise ConfigError(f"config error in {path}: cannot read it: {e.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"config error in {path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config error in {path}: invalid TOML: {e}") from None
    token = _toml_data.set(data)
    try:
        return Config()
    except ValidationError as e:
        problems = "; ".join(_describe(err) for err in e.errors())
        raise ConfigError(f"config error in {path}: {problems}") from None
    finally:
        _toml_data.reset(token)
