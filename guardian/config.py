"""guardian's one typed configuration object, loaded from TOML with pydantic-settings.

Precedence, highest first: ``GUARDIAN_*`` environment variables (nested keys with ``__``,
e.g. ``GUARDIAN_WATCHDOG__STALL_WINDOW_S=90``), then the TOML file, then the defaults here.
Unknown keys are errors: a typo must not silently leave a default in force.
"""

from __future__ import annotations

import os
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

DEFAULT_CONFIG_PATH = Path("/etc/guardian/guardian.toml")
CONFIG_ENV = "GUARDIAN_CONFIG"


class ConfigError(Exception):
    """A configuration that guardian refuses to run with; the message names file, key and reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplicaConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", min_length=1, max_length=64)
    unit: str
    url: str
    model: str = Field(min_length=1)
    startup_grace_s: float = Field(default=1200.0, gt=0)
    health_timeout_s: float = Field(default=2.0, gt=0)
    metrics_timeout_s: float = Field(default=3.0, gt=0)
    canary_timeout_s: float = Field(default=15.0, gt=0)

    @field_validator("unit")
    @classmethod
    def _unit_is_service(cls, v: str) -> str:
        if not v.endswith(".service") or len(v) <= len(".service") or "/" in v:
            raise ValueError(f"must be a systemd service unit name ending in '.service' (got {v!r})")
        return v

    @field_validator("url")
    @classmethod
    def _url_has_scheme(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000 (got {v!r})")
        try:
            _ = parts.port  # urlsplit checks the port only when asked
        except ValueError as e:
            raise ValueError(f"has an invalid port ({v!r})") from e
        return v.rstrip("/")

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)


class WatchdogConfig(_Strict):
    stall_window_s: float = Field(default=60.0, gt=0)
    unresponsive_after_s: float = Field(default=10.0, gt=0)
    canary_interval_s: float = Field(default=30.0, gt=0)
    canary_retry_s: float = Field(default=5.0, gt=0)
    canary_failures: int = Field(default=2, ge=1)
    restart_budget: int = Field(default=3, ge=1)
    restart_window_s: float = Field(default=1800.0, gt=0)
    backoff_s: float = Field(default=60.0, ge=0)
    restart_job_timeout_s: float = Field(default=300.0, gt=0)


class MemoryConfig(_Strict):
    enabled: bool = False
    min_headroom_bytes: int = Field(default=8 * 2**30, ge=0)
    critical_headroom_bytes: int = Field(default=3 * 2**30, ge=0)
    sustain_s: float = Field(default=30.0, ge=0)
    psi_some_threshold_pct: float | None = Field(default=None, ge=0, le=100)
    step: float = Field(default=0.04, gt=0, le=0.5)
    floor: float = Field(default=0.50, gt=0, lt=1)
    reserve_bytes: int = Field(default=2**30, ge=0)
    cooldown_s: float = Field(default=600.0, ge=0)
    device_total_bytes: int | None = Field(default=None, gt=0)
    priority: list[str] = Field(default_factory=list)
    peer_urls: list[str] = Field(default_factory=list)
    peer_timeout_s: float = Field(default=2.0, gt=0)
    restore: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> MemoryConfig:
        if self.critical_headroom_bytes > self.min_headroom_bytes:
            raise ValueError("critical_headroom_bytes must be <= min_headroom_bytes")
        if self.restore:
            raise ValueError(
                "restore (raising a fraction back when headroom returns) is not built yet; "
                "raise it by hand: edit /var/lib/guardian/replicas/NAME.env and restart that replica"
            )
        for url in self.peer_urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"peer_urls: {url!r} is not an http:// or https:// URL with a host")
        return self


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
    )

    interval_s: float = Field(default=2.0, gt=0)
    dry_run: bool = False
    state_dir: Path = Path("/var/lib/guardian")
    runtime_dir: Path = Path("/run/guardian")
    shutdown_timeout_s: float = Field(default=10.0, gt=0)
    # With the system bus gone this long, guardian stops pinging systemd's watchdog (it is blind:
    # no unit view, no restart) so that systemd restarts it; it reconnects on its own before that.
    bus_lost_restart_s: float = Field(default=60.0, gt=0)
    watchdog: WatchdogConfig = WatchdogConfig()
    memory: MemoryConfig = MemoryConfig()
    replicas: list[ReplicaConfig] = Field(default_factory=list)

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

    @field_validator("replicas")
    @classmethod
    def _replicas_distinct(cls, replicas: list[ReplicaConfig]) -> list[ReplicaConfig]:
        for attr in ("name", "unit", "url"):
            seen: set[str] = set()
            for r in replicas:
                value = getattr(r, attr)
                if value in seen:
                    raise ValueError(f"two replicas have the same {attr} {value!r}")
                seen.add(value)
        return replicas

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
    """Read and validate PATH; raise ConfigError with one message per problem."""
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
