"""A PgBouncer in transaction pooling mode in front of a test cluster (installed when missing).

Its configuration is PgBouncer's default apart from what it needs to run at all: a loopback
port, its own files, an auth file and one wildcard database entry pointing at the cluster, and
``pool_mode = transaction`` (the mode that breaks session state). When ``pgbouncer`` is missing
and the session runs as root (CI, containers), ``apt-get install -y pgbouncer`` installs it, as
:mod:`tests.support.browser` does with Chromium; when that cannot be done the tests fail, never
skip.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
import tempfile
import time
import typing as t
from pathlib import Path

import sqlalchemy as sa

from . import debian, pgcluster

BINARY_CANDIDATES = ("pgbouncer", "/usr/sbin/pgbouncer")
#: The password clients give PgBouncer (its default ``auth_type`` is md5); the cluster itself
#: trusts loopback connections.
PASSWORD = "pooled"


def binary() -> str | None:
    for candidate in BINARY_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    return None


def ensure_binary() -> str:
    """``pgbouncer``, installed from the distribution when missing.

    :raises RuntimeError: it is missing and cannot be installed (say why).
    """
    found = binary()
    if found is not None:
        return found
    debian.apt_install("pgbouncer")
    found = binary()
    if found is None:
        raise RuntimeError("pgbouncer still missing after apt-get install")
    return found


@dataclasses.dataclass
class PgBouncer:
    """One PgBouncer process in front of the server at ``server_url``."""

    server_url: str
    #: More ``[pgbouncer]`` settings (none: the default configuration).
    settings: t.Mapping[str, str] = dataclasses.field(default_factory=dict)
    directory: Path = dataclasses.field(
        default_factory=lambda: Path(tempfile.mkdtemp(prefix="flask-idem-pgbouncer-"))
    )
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def log_file(self) -> Path:
        return self.directory / "pgbouncer.log"

    def url(self, database_url: str) -> str:
        """``database_url`` (a database of the server) reached through the pooler."""
        parsed = sa.make_url(database_url)
        return parsed.set(password=PASSWORD, host="127.0.0.1", port=self.port).render_as_string(
            hide_password=False
        )

    def start(self) -> None:
        executable = ensure_binary()
        server = sa.make_url(self.server_url)
        self.port = pgcluster.free_port()
        (self.directory / "userlist.txt").write_text(f'"{server.username}" "{PASSWORD}"\n')
        (self.directory / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={server.host} port={server.port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            f"unix_socket_dir = {self.directory}\n"
            f"logfile = {self.log_file}\n"
            f"pidfile = {self.directory / 'pgbouncer.pid'}\n"
            f"auth_file = {self.directory / 'userlist.txt'}\n"
            "pool_mode = transaction\n"
            + "".join(f"{name} = {value}\n" for name, value in self.settings.items())
        )
        command = [executable, str(self.directory / "pgbouncer.ini")]
        user = pgcluster._server_user()
        if user is not None:  # PgBouncer refuses to run as root
            shutil.chown(self.directory, user)
            for path in self.directory.iterdir():
                shutil.chown(path, user)
            command = ["runuser", "-u", user, "--", *command]
        self.process = subprocess.Popen(
            command, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited:\n{self._log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer did not listen:\n{self._log_tail()}") from None
                time.sleep(0.05)

    def _log_tail(self) -> str:
        return self.log_file.read_text()[-2000:] if self.log_file.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
