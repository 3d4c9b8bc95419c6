"""Throwaway PostgreSQL clusters for the tests, the bench and ``make pg-start``.

``python -m tests.support.pgcluster start [NAME]`` builds a cluster under ``.pg/NAME`` with the
machine's ``initdb``/``pg_ctl`` on a free loopback port and prints its ``DATABASE_URL``;
``stop [NAME]`` removes it; ``check`` says in one line how to get a server when there is none.
When running as root (CI, containers) the server runs as the ``postgres`` user, because
PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import typing as t
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PG_DIR = ROOT / ".pg"
SERVER_USER_CANDIDATES = ("postgres", "nobody")
NO_SERVER = (
    "No PostgreSQL: install the server binaries (initdb, pg_ctl; e.g. apt-get install "
    "postgresql) or set DATABASE_URL=postgresql://user:pass@host/db"
)


def find_binary(name: str) -> str | None:
    """``name`` on PATH, else in the newest ``/usr/lib/postgresql/*/bin``."""
    found = shutil.which(name)
    if found:
        return found
    candidates = glob.glob(f"/usr/lib/postgresql/*/bin/{name}")
    candidates.sort(
        key=lambda path: int(Path(path).parts[-3]) if Path(path).parts[-3].isdigit() else 0
    )
    return candidates[-1] if candidates else None


def have_server_binaries() -> bool:
    return find_binary("initdb") is not None and find_binary("pg_ctl") is not None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_user() -> str | None:
    """The account the server runs as: ourselves, unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in SERVER_USER_CANDIDATES:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise SystemExit("running as root and no 'postgres' or 'nobody' user to run PostgreSQL as")


def _run_as_server_user(command: list[str], **kwargs: t.Any) -> subprocess.CompletedProcess[str]:
    user = _server_user()
    if user is not None:
        command = ["runuser", "-u", user, "--", *command]
    # From "/": the server user may not be allowed into the current folder.
    return subprocess.run(command, check=True, text=True, cwd="/", **kwargs)


@dataclasses.dataclass
class Cluster:
    """One throwaway cluster: a data directory and a loopback port."""

    directory: Path
    port: int = 0
    #: Where the server's own files live when ``directory`` is out of its reach (see start).
    server_dir: Path | None = None
    _options: str = ""

    @property
    def home(self) -> Path:
        return self.server_dir or self.directory

    @property
    def datadir(self) -> Path:
        return self.home / "data"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def _state_file(self) -> Path:
        return self.directory / "cluster.json"

    @classmethod
    def load(cls, directory: Path) -> Cluster | None:
        state = directory / "cluster.json"
        if not state.exists():
            return None
        saved = json.loads(state.read_text())
        server_dir = saved.get("server_dir")
        return cls(directory, saved["port"], Path(server_dir) if server_dir else None)

    def start(self, *, durable: bool = False, settings: t.Mapping[str, str] = {}) -> None:
        initdb, pg_ctl = find_binary("initdb"), find_binary("pg_ctl")
        if initdb is None or pg_ctl is None:
            raise SystemExit(NO_SERVER)
        self.stop()
        self.directory.mkdir(parents=True, exist_ok=True)
        user = _server_user()
        if user is not None and not _reachable_by_all(self.directory):
            # The server runs as another user, who cannot reach a checkout under a private
            # folder (CI clones as root): its files go to a fresh folder under /tmp instead.
            self.server_dir = Path(tempfile.mkdtemp(prefix="flask-idem-pg-"))
        for path in {PG_DIR, self.directory, self.home}:
            path.chmod(0o755)
        if user is not None:
            shutil.chown(self.home, user)
        _run_as_server_user(
            [
                initdb,
                "-D",
                str(self.datadir),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--locale=C",
            ],
            stdout=subprocess.DEVNULL,
        )
        self.port = free_port()
        options = [
            "-c listen_addresses=127.0.0.1",
            f"-c port={self.port}",
            "-c unix_socket_directories=''",
            "-c max_connections=300",
            "-c shared_preload_libraries=pg_stat_statements",
        ]
        if not durable:
            # Test data is thrown away: skip the disk flushes that only protect against crashes.
            options += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        options += [f"-c {name}={value}" for name, value in settings.items()]
        self._options = " ".join(options)
        self.start_server()
        server_dir = str(self.server_dir) if self.server_dir else None
        self._state_file.write_text(json.dumps({"port": self.port, "server_dir": server_dir}))

    @property
    def log_file(self) -> Path:
        """The server's own log (``pg_ctl -l``)."""
        return self.home / "server.log"

    def start_server(self) -> None:
        """Start the server of an initialised cluster (again, after :meth:`stop_server`)."""
        pg_ctl = find_binary("pg_ctl")
        assert pg_ctl is not None
        _run_as_server_user(
            [pg_ctl, "-D", str(self.datadir), "-l", str(self.log_file), "-w", "-t", "60"]
            + ["-o", self._options, "start"],
            stdout=subprocess.DEVNULL,
        )

    def stop_server(self, mode: str = "immediate") -> None:
        """Stop the server and keep its files (``pg_ctl stop -m <mode>``)."""
        pg_ctl = find_binary("pg_ctl")
        assert pg_ctl is not None
        _run_as_server_user(
            [pg_ctl, "-D", str(self.datadir), "-m", mode, "-w", "stop"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def server_pids(self) -> list[int]:
        """The postmaster, then every process it started (Linux ``/proc``)."""
        postmaster = int((self.datadir / "postmaster.pid").read_text().split()[0])
        children = []
        for stat_file in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = stat_file.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == postmaster:
                    children.append(int(stat_file.parent.name))
        return [postmaster, *children]

    def stop(self) -> None:
        pg_ctl = find_binary("pg_ctl")
        if pg_ctl and (self.datadir / "postmaster.pid").exists():
            _run_as_server_user(
                [pg_ctl, "-D", str(self.datadir), "-m", "immediate", "-w", "stop"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        if self.server_dir is not None:
            shutil.rmtree(self.server_dir, ignore_errors=True)
        shutil.rmtree(self.directory, ignore_errors=True)


def _reachable_by_all(path: Path) -> bool:
    """Whether every folder above ``path`` lets any user through (the ``o+x`` bit)."""
    return all(parent.stat().st_mode & stat.S_IXOTH for parent in path.resolve().parents)


def create_database(server_url: str, options: str = "") -> str:
    """Create a fresh, uniquely named database on ``server_url``; return its URL.

    :param options: appended to ``CREATE DATABASE`` (``ENCODING 'LATIN1' TEMPLATE template0``).
    """
    import sqlalchemy as sa

    from flask_idem.store import normalize_url

    name = f"flask_idem_test_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(normalize_url(server_url), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}" {options}')
    finally:
        engine.dispose()
    return sa.make_url(server_url).set(database=name).render_as_string(hide_password=False)


def drop_database(url: str) -> None:
    import sqlalchemy as sa

    from flask_idem.store import normalize_url

    parsed = normalize_url(url)
    engine = sa.create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{parsed.database}" WITH (FORCE)')
    finally:
        engine.dispose()


def main(argv: list[str]) -> int:
    positional = [arg for arg in argv if not arg.startswith("--")]
    command = positional[0] if positional else ""
    name = positional[1] if len(positional) > 1 else "dev"
    cluster_dir = PG_DIR / name
    if command == "start":
        cluster = Cluster(cluster_dir)
        cluster.start(durable="--durable" in argv)
        print(f"DATABASE_URL={cluster.url}")
        return 0
    if command == "stop":
        (Cluster.load(cluster_dir) or Cluster(cluster_dir)).stop()
        return 0
    if command == "url":
        cluster = Cluster.load(cluster_dir)
        if cluster is None:
            print(f"no cluster under {cluster_dir}; run make pg-start", file=sys.stderr)
            return 1
        print(cluster.url)
        return 0
    if command == "check":
        if os.environ.get("DATABASE_URL") or have_server_binaries():
            return 0
        print(NO_SERVER, file=sys.stderr)
        return 1
    print(
        "usage: python -m tests.support.pgcluster start|stop|url|check [NAME] [--durable]",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
