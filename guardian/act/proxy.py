"""The proxy, made to match the core's set of replicas marked down (core/proxy/drain.py), as the last
action of each tick (SyncProxy) asks; only a change is applied.

nginx: guardian owns one file per upstream, ``P.nginx_upstream_dir/NAME.conf``, that the operator's
``upstream NAME { ... }`` block includes. It holds the ``server`` lines of this box's replicas of
that upstream, with ``down`` for a replica marked down. A change is written atomically, checked
with ``nginx -t`` (the unit ``P.nginx_check_unit`` runs it as root: guardian has no rights on
nginx's own files), and applied by reloading ``P.nginx_unit`` over D-Bus. If the check fails the
previous file is put back and nothing is reloaded. The files are read back with read_back
(observe/readback.py): what is at such a name that is not a regular file of at most
UPSTREAM_MAX_BYTES (a link, a FIFO, a device) is never read, but replaced by the rename, and not
put back if the check fails.

Any other proxy: ``P.drain_command`` and ``P.undrain_command``, run for one replica each, with
GUARDIAN_REPLICA, GUARDIAN_UNIT, GUARDIAN_URL and GUARDIAN_ACTION in the environment, bounded by
``P.command_timeout_s`` (then killed with what they started; every wait after it is bounded
too); the last HOOK_OUTPUT_MAX_BYTES of their output go to the journal (act/proxy_hook.py runs them;
act/proxy_check.py is what `guardian check` says of the proxy).

What was applied is reported to the core (ProxyView) and kept in the state file ("proxy_down"),
so that a guardian restarted in the middle of a drain marks the replica up once it serves.
A failed attempt is retried after RETRY_S, or at once when the wanted set changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, ReplicaConfig
from ..core.actions import LogLine
from ..core.observations import ProxyView
from ..core.proxy import drain
from ..core.proxy.drainstate import Drain, Phase
from ..core.vocab import Decision, Priority
from ..observe.clock import Now
from ..observe.readback import Refused, read_back
from ..observe.systemd import JOB_DONE, Systemd, SystemdError
from ..observe.unitlog import unit_lines
from . import units
from .journal import Journal
from .proxy_hook import OUTPUT_CHARS, hook_report, run_command
from .state import CorruptState, StateStore, atomic_write

RETRY_S = 30.0
JOB_TIMEOUT_S = 30.0
# nginx's reload job ends when the signal is sent; its new workers start a moment later.
NGINX_TAKEOVER_S = 5.0
NGINX_POLL_S = 0.05
# An upstream file is a few lines per replica; an nginx configuration file is read by `guardian
# check` only up to this size.
UPSTREAM_MAX_BYTES = 2**20


def upstreams(cfg: Config) -> dict[str, list[ReplicaConfig]]:
    out: dict[str, list[ReplicaConfig]] = {}
    for r in cfg.replicas:
        out.setdefault(r.upstream, []).append(r)
    return out


def server_address(cfg: Config, r: ReplicaConfig) -> str:
    host = cfg.proxy.server_host
    if not host:
        from urllib.parse import urlsplit

        host = urlsplit(r.url).hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
    return f"{host}:{r.port}"


def render_upstream(cfg: Config, upstream: str, down: frozenset[str]) -> str:
    """The include file of UPSTREAM: one server line per replica of this box, `down` when marked down."""
    lines = [
        f"# Written by guardian: the replicas of this box in upstream {upstream}. Do not edit: guardian",
        "# rewrites this file when it drains or restarts a replica (a 'down' server is out of rotation).",
    ]
    for r in upstreams(cfg).get(upstream, []):
        params = " ".join(p for p in (cfg.proxy.server_params, "down" if r.name in down else "") if p)
        lines.append(f"server {server_address(cfg, r)}{' ' + params if params else ''};  # {r.name} ({r.unit})")
    return "\n".join(lines) + "\n"


def nginx_workers(processes: list[tuple[int, str]]) -> frozenset[int]:
    """The PIDs of nginx workers that take new requests: after a reload, the old ones are titled
    "nginx: worker process is shutting down" and only finish what they had read. systemd quotes a
    command line with spaces (252 does: "\"nginx: worker process\""), older ones do not."""
    titles = ((pid, cmdline.strip().strip("\"'")) for pid, cmdline in processes)
    return frozenset(pid for pid, t in titles if t.startswith("nginx: worker process") and "shutting down" not in t)


def nginx_took_over(before: frozenset[int], current: frozenset[int]) -> bool:
    """A reload is in effect once every worker that takes requests (CURRENT) started after it."""
    return bool(current) and not current & before


@dataclass(frozen=True)
class _Rewrite:
    """One rewrite of nginx's upstream files: what each held before (None: nothing guardian reads),
    those where something was planted (not a regular file guardian reads: replaced by the rename,
    never put back; why not read), and the new text of each file that changes."""

    old: dict[Path, bytes | None]
    planted: dict[Path, str]
    changed: dict[Path, str]


class _Unreadable(Exception):
    pass


def _rewrite_of(files: dict[Path, str]) -> _Rewrite:
    """The rewrite that makes each of FILES hold its text. _Unreadable: one could not be read."""
    old: dict[Path, bytes | None] = {}
    planted: dict[Path, str] = {}
    for path in files:
        try:
            old[path] = read_back(path, UPSTREAM_MAX_BYTES)
        except FileNotFoundError:
            old[path] = None
        except Refused as e:
            old[path], planted[path] = None, e.strerror or str(e)
        except OSError as e:
            raise _Unreadable(f"cannot read {path}: {e}") from e
    return _Rewrite(old, planted, {path: text for path, text in files.items() if old[path] != text.encode()})


def upstream_path(cfg: Config, upstream: str) -> Path:
    assert cfg.proxy.nginx_upstream_dir is not None
    return cfg.proxy.nginx_upstream_dir / f"{upstream}.conf"


class ProxySync:
    def __init__(
        self,
        cfg: Config,
        sd: Systemd,
        store: StateStore,
        journal: Journal,
        clock: Callable[[], Now],
    ) -> None:
        self.cfg = cfg
        self.sd = sd
        self.store = store
        self.journal = journal
        self.clock = clock
        # What the proxy has now. nginx's is unknown until its files have been compared once;
        # the hooks' is what the state file says they were last told (adopt).
        self.nginx_down: frozenset[str] | None = None
        self.hook_down: frozenset[str] = frozenset()
        self.failed: frozenset[str] = frozenset()
        self.error: str | None = None
        self.retry_at_mono = 0.0
        self.task: asyncio.Task[None] | None = None
        self.stopping = False  # guardian is stopping: a failure is not retried

    @property
    def applied(self) -> frozenset[str]:
        p = self.cfg.proxy
        sets = [
            s
            for s, on in ((self.nginx_down, p.nginx_upstream_dir is not None), (self.hook_down, bool(p.drain_command)))
            if on
        ]
        out = frozenset(r.name for r in self.cfg.replicas)
        for s in sets:
            out &= s if s is not None else frozenset()
        return out

    def adopt(self, persisted: Iterable[str], at_mono: float) -> dict[str, Drain]:
        """At startup: what the state file says was marked down when guardian last ran (it may
        have died in the middle of a drain) is what the hooks were told. The configured replicas
        among them stay down until they serve (D11): said, and returned as the tick's drains."""
        down = [name for name in persisted if self.cfg.replica(name) is not None]
        self.hook_down = frozenset(down)
        if not down or not self.cfg.proxy.enabled:
            return {}
        self.journal.send(
            Priority.INFO,
            f"proxy: {', '.join(down)} marked down when guardian last ran; each is marked up once it serves "
            f"({drain.MARKED_UP.id})",
        )
        return {name: Drain(Phase.AWAY, at_mono, "marked down when guardian last ran") for name in down}

    def reload(self, cfg: Config) -> None:
        """The files may have moved or changed: compare them afresh."""
        self.cfg, self.store, self.nginx_down = cfg, StateStore(cfg.state_dir), None

    async def stop(self, timeout_s: float) -> int:
        """A change under way is finished, so that the state file says what the proxy has; then
        every replica marked down in nginx's upstream files is marked up, within what is left of
        TIMEOUT_S: a guardian that is not running could never mark it up again."""
        deadline_mono = self.clock().mono + timeout_s
        try:
            await asyncio.wait_for(self.wait(), timeout_s)
            await asyncio.wait_for(self._mark_up_at_stop(), max(0.0, deadline_mono - self.clock().mono))
        except TimeoutError:
            return 1
        return 0

    def _down_in_files(self) -> list[tuple[ReplicaConfig, Path]]:
        """The configured replicas whose server line in nginx's upstream files says down now."""
        out = []
        for upstream, replicas in upstreams(self.cfg).items():
            path = upstream_path(self.cfg, upstream)
            try:
                lines = read_back(path, UPSTREAM_MAX_BYTES).decode(errors="replace").splitlines()
            except OSError:
                continue  # absent or not guardian's file: nothing of guardian's to mark up
            for r in replicas:
                tail = f"# {r.name} ({r.unit})"
                if any(ln.startswith("server ") and " down;" in ln and ln.endswith(tail) for ln in lines):
                    out.append((r, path))
        return out

    async def _mark_up_at_stop(self) -> None:
        if self.cfg.proxy.nginx_upstream_dir is None:
            return
        down = self._down_in_files()
        if not down:
            return
        self.stopping = True
        # The state file keeps what guardian had marked down: a guardian started again (a restart, an
        # upgrade) marks those down again until each serves (D11); after `apt remove` none starts.
        err = await self._nginx(frozenset())
        for r, path in down:
            text = (
                f"replica {r.name}: marked up in nginx upstream file {path} as guardian stops "
                "(a guardian that is not running could never mark it up again; a guardian started again "
                "marks it down until it serves)"
                if err is None
                else f"replica {r.name}: still marked down in nginx upstream file {path} as guardian stops: {err}"
            )
            self.journal.line(
                LogLine(Priority.WARNING if err is None else Priority.ERROR, text, Decision.PROXY, r.name, r.unit)
            )

    def view(self) -> ProxyView | None:
        if not self.cfg.proxy.enabled:
            return None
        return ProxyView(self.applied, self.failed, self.error)

    def _due(self, want: frozenset[str]) -> bool:
        p = self.cfg.proxy
        nginx = p.nginx_upstream_dir is not None and self.nginx_down != want
        hooks = bool(p.drain_command) and self.hook_down != want
        if not (nginx or hooks):
            return False
        return self.error is None or want != self.failed or self.clock().mono >= self.retry_at_mono

    def sync(self, want: frozenset[str]) -> None:
        """Start making the proxy match WANT, unless that is under way or done."""
        if not self.cfg.proxy.enabled or (self.task is not None and not self.task.done()):
            return
        if self._due(want):
            self.task = asyncio.ensure_future(self._apply(want))

    async def wait(self) -> None:
        if self.task is not None:
            with contextlib.suppress(Exception):
                await self.task

    async def _apply(self, want: frozenset[str]) -> None:
        errors: list[str] = []
        try:
            if self.cfg.proxy.nginx_upstream_dir is not None and self.nginx_down != want:
                err = await self._nginx(want)
                if err is not None:
                    errors.append(err)
            if self.cfg.proxy.drain_command and self.hook_down != want:
                errors += await self._hooks(want)
        except Exception as e:  # noqa: BLE001 - a bug here must not stop the watchdog; said, retried
            errors.append(f"{type(e).__name__}: {e}")
        if errors:
            self.failed, self.error = want, "; ".join(errors)
            self.retry_at_mono = self.clock().mono + RETRY_S
        else:
            self.failed, self.error = frozenset(), None
        self._persist(want)

    def _persist(self, want: frozenset[str]) -> None:
        # nginx's is unknown after a failed reload of a file already written: count what it says.
        nginx = self.nginx_down if self.nginx_down is not None else want
        down = sorted(nginx | self.hook_down if self.cfg.proxy.nginx_upstream_dir is not None else self.hook_down)
        try:
            self.store.update(lambda d: d.__setitem__("proxy_down", down))
        except (CorruptState, OSError) as e:
            self.journal.send(Priority.ERROR, f"proxy: cannot record what is marked down in {self.store.dir}: {e}")

    # --- nginx -------------------------------------------------------------------------------
    async def _nginx(self, want: frozenset[str]) -> str | None:
        """Make nginx's upstream files say WANT: write, check, reload; None, or what failed (said)."""
        cfg = self.cfg
        files = {upstream_path(cfg, u): render_upstream(cfg, u, want) for u in upstreams(cfg)}
        try:
            rewrite = _rewrite_of(files)
        except _Unreadable as e:
            return self._say_nginx(want, str(e))
        if not rewrite.changed:
            self.nginx_down = want  # already so (at start, or after guardian was restarted)
            return None
        began = self.clock()
        try:
            for path, text in rewrite.changed.items():
                atomic_write(path, text.encode(), 0o644)
        except OSError as e:
            self._restore(rewrite)
            where = e.filename or cfg.proxy.nginx_upstream_dir
            return self._say_nginx(want, f"cannot write {where}: {e.strerror or e}")
        for path, why in rewrite.planted.items():
            self.journal.line(
                LogLine(
                    Priority.WARNING,
                    f"proxy: {path} was not read ({why}): replaced by the upstream file guardian writes",
                    Decision.PROXY,
                )
            )
        check = await self._job("StartUnit", cfg.proxy.nginx_check_unit)
        if check != JOB_DONE:
            return await self._check_failed(want, check, rewrite, began)
        return await self._reload_nginx(want, rewrite, began)

    async def _check_failed(self, want: frozenset[str], check: str, rewrite: _Rewrite, began: Now) -> str:
        """nginx -t refused the new files: the previous ones are put back, nginx is not reloaded."""
        unit = self.cfg.proxy.nginx_check_unit
        said = await unit_lines(unit, began.wall, 8)
        detail = " | ".join(line for line in (said or []) if line.strip())[-OUTPUT_CHARS:]
        self._restore(rewrite)
        gone = "".join(f"; {path} is not put back (it was {why}): removed" for path, why in rewrite.planted.items())
        return self._say_nginx(
            want,
            f"nginx -t ({unit}) {check}: {detail or 'see journalctl -u ' + unit}; "
            f"the previous upstream file is back and nginx was not reloaded{gone}",
        )

    async def _reload_nginx(self, want: frozenset[str], rewrite: _Rewrite, began: Now) -> str | None:
        """Reload nginx onto the checked files and wait for its new workers to take over."""
        unit = self.cfg.proxy.nginx_unit
        try:
            running = (await self.sd.active_state(unit)).running
        except SystemdError:
            running = True  # ask for the reload: its error says what is wrong
        if not running:  # nothing to reload: nginx reads the file when it starts
            self.nginx_down = want
            self._say_written(want, rewrite.changed, f"{unit} is not running, so it was not reloaded", began)
            return None
        before, unread = await self._workers()
        reload = await self._job("ReloadUnit", unit)
        if reload != JOB_DONE:
            self.nginx_down = None  # the files are new, nginx may still run the old ones: compare again
            return self._say_nginx(want, f"reload of {unit}: {reload} (the upstream file is written)")
        how = f"{unit} reloaded"
        if before:
            took_s, why = await self._takeover(before)
            if took_s is None:
                self.nginx_down = None
                return self._say_nginx(
                    want,
                    f"{unit} reloaded, but {NGINX_TAKEOVER_S:g} s later {why} "
                    f"(the upstream file is written; see journalctl -u {unit})",
                )
            how += f", its new workers in charge after {took_s:.2f} s"
        else:
            how += f" (not confirmed that its new workers took over: {unread or 'no nginx worker found'})"
        self.nginx_down = want
        self._say_written(want, rewrite.changed, how, began)
        return None

    async def _workers(self) -> tuple[frozenset[int], str | None]:
        """nginx's workers that take requests, or none and why its processes could not be read."""
        try:
            return nginx_workers(await self.sd.unit_processes(self.cfg.proxy.nginx_unit)), None
        except SystemdError as e:
            return frozenset(), f"its processes could not be read: {e}"

    async def _takeover(self, before: frozenset[int]) -> tuple[float | None, str]:
        """Seconds until nginx's workers from before the reload no longer take requests; None and
        what was seen last if that did not happen in time."""
        start = self.clock().mono
        while True:
            workers, unread = await self._workers()
            if nginx_took_over(before, workers):
                return self.clock().mono - start, ""
            if self.clock().mono - start >= NGINX_TAKEOVER_S:
                return None, unread or "its workers from before the reload still take requests"
            await asyncio.sleep(NGINX_POLL_S)

    def _say_written(self, want: frozenset[str], changed: dict[Path, str], how: str, began: Now) -> None:
        down = ", ".join(sorted(want)) or "none"
        self.journal.line(
            LogLine(
                Priority.INFO,
                f"proxy: nginx upstream file(s) {', '.join(str(x) for x in changed)} written; marked down: {down}; "
                f"nginx -t passed and {how}, in {self.clock().mono - began.mono:.1f} s",
                Decision.PROXY,
            )
        )

    async def _job(self, member: str, unit: str) -> str:
        try:
            return await units.run_job(self.sd, member, unit, JOB_TIMEOUT_S)
        except SystemdError as e:
            return f"could not be asked: {e}"

    def _restore(self, rewrite: _Rewrite) -> None:
        for path in rewrite.changed:
            prev = rewrite.old[path]
            try:
                if prev is None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                else:
                    atomic_write(path, prev, 0o644)
            except OSError as e:
                self.journal.send(Priority.ERROR, f"proxy: cannot put the previous {path} back: {e}")

    def _say_nginx(self, want: frozenset[str], err: str) -> str:
        down = ", ".join(sorted(want)) or "none"
        self.journal.line(
            LogLine(
                Priority.ERROR,
                f"proxy: could not make nginx mark down exactly [{down}]: {err}; "
                + ("guardian is stopping: not retried" if self.stopping else f"retried in {RETRY_S:g} s"),
                Decision.PROXY,
            )
        )
        return err

    # --- command hooks -----------------------------------------------------------------------
    async def _hooks(self, want: frozenset[str]) -> list[str]:
        errors = []
        down = set(self.hook_down)
        for r in self.cfg.replicas:
            action = "drain" if r.name in want and r.name not in down else None
            if r.name not in want and r.name in down:
                action = "undrain"
            if action is None:
                continue
            err = await self._run_hook(r, action)
            if err is None:
                down.symmetric_difference_update({r.name})
            else:
                errors.append(f"{action} of {r.name}: {err}")
        down &= {r.name for r in self.cfg.replicas}
        self.hook_down = frozenset(down)
        return errors

    async def _run_hook(self, r: ReplicaConfig, action: str) -> str | None:
        p = self.cfg.proxy
        argv = p.drain_command if action == "drain" else p.undrain_command
        if not argv:
            return None  # no undrain command: marking down is all the proxy needs
        env = dict(
            os.environ, GUARDIAN_REPLICA=r.name, GUARDIAN_UNIT=r.unit, GUARDIAN_URL=r.url, GUARDIAN_ACTION=action
        )
        began = self.clock().mono
        try:
            run = await run_command(argv, env, p.command_timeout_s)
        except OSError as e:
            err = f"{argv[0]} could not be run: {e.strerror or e}"
            self._say_hook(r, action, Priority.ERROR, err)
            return err
        ok, text = hook_report(argv[0], run, p.command_timeout_s, self.clock().mono - began)
        self._say_hook(r, action, Priority.INFO if ok else Priority.ERROR, text)
        return None if ok else text

    def _say_hook(self, r: ReplicaConfig, action: str, priority: Priority, text: str) -> None:
        self.journal.line(
            LogLine(priority, f"replica {r.name}: proxy {action} command: {text}", Decision.PROXY, r.name, r.unit)
        )
