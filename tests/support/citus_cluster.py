"""A throwaway Citus cluster for the tests: a coordinator and two workers on loopback ports.

Citus has no Debian or PyPI package here, so the suite installs it itself, as the browser tests
install Chromium: when the machine's PostgreSQL has no ``citus`` extension and the session runs
as root, it unpacks the build found at ``$FLASK_IDEM_CITUS_TARBALL`` or in ``../shared/citus/``
(next to the repository) into ``/``, after checking it against the ``SHA256SUMS`` beside it.
When that cannot be done the Citus tests skip with one line saying why, except under
``FLASK_IDEM_REQUIRE_CITUS=1`` (set by ``.ci/run``), where they fail.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import typing as t
from pathlib import Path

import sqlalchemy as sa

from .pgcluster import ROOT, Cluster, find_binary, have_server_binaries

TARBALL_VARIABLE = "FLASK_IDEM_CITUS_TARBALL"
REQUIRE_VARIABLE = "FLASK_IDEM_REQUIRE_CITUS"
SHARED_DIR = ROOT.parent / "shared" / "citus"
#: How a skip, and the summary line, begin (conftest finds the skips by it).
DID_NOT_RUN = "Citus tests did not run"
WORKERS = 2
#: ``citus`` must come first; ``pg_stat_statements`` as on the plain test server.
SETTINGS = {
    "shared_preload_libraries": "citus,pg_stat_statements",
    "citus.enable_statistics_collection": "off",
    "max_prepared_transactions": "200",
    "max_connections": "200",
    # Shard moves by logical replication (``shard_transfer_mode => 'force_logical'``).
    "wal_level": "logical",
}


class CitusUnavailable(RuntimeError):
    """Citus is not installed and cannot be installed here (the message says why)."""


def required() -> bool:
    """Whether a missing Citus fails the run instead of skipping its tests (CI)."""
    return os.environ.get(REQUIRE_VARIABLE, "") not in ("", "0")


def _server_dirs() -> tuple[Path, Path]:
    """The server's library and extension folders (Debian's layout, from ``postgres``'s path)."""
    postgres = find_binary("postgres")
    if postgres is None:
        raise CitusUnavailable("no PostgreSQL server binaries (apt-get install postgresql)")
    major = Path(postgres).resolve().parts[-3]
    return Path(f"/usr/lib/postgresql/{major}/lib"), Path(f"/usr/share/postgresql/{major}")


def installed() -> bool:
    libdir, sharedir = _server_dirs()
    return (libdir / "citus.so").exists() and (sharedir / "extension" / "citus.control").exists()


def tarball() -> Path:
    """The Citus build to install: the variable's path, else the newest one for this server."""
    given = os.environ.get(TARBALL_VARIABLE)
    if given:
        if not Path(given).is_file():
            raise CitusUnavailable(f"{TARBALL_VARIABLE}={given} is not a file")
        return Path(given)
    major = _server_dirs()[0].parts[-2]
    found = sorted(SHARED_DIR.glob(f"citus-*-pg{major}-*.tar.gz"))
    if not found:
        raise CitusUnavailable(
            f"no citus extension in PostgreSQL {major} and no build in {SHARED_DIR} "
            f"(or set {TARBALL_VARIABLE})"
        )
    return found[-1]


def _verify(archive: Path) -> None:
    sums = archive.parent / "SHA256SUMS"
    if not sums.exists():
        return
    wanted = {
        name: digest
        for digest, name in (line.split() for line in sums.read_text().split("\n") if line)
    }
    if archive.name in wanted:
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != wanted[archive.name]:
            raise CitusUnavailable(f"{archive} does not match {sums}")


def ensure_installed() -> None:
    """Citus in the machine's PostgreSQL, unpacked from its build when missing.

    :raises CitusUnavailable: it is missing and cannot be installed.
    """
    if not have_server_binaries():
        raise CitusUnavailable("no PostgreSQL server binaries (initdb, pg_ctl)")
    if installed():
        return
    archive = tarball()
    if os.geteuid() != 0:
        raise CitusUnavailable(f"installing {archive} needs root: tar -xzf {archive} -C /")
    _verify(archive)
    with tarfile.open(archive) as bundle:
        bundle.extractall("/", filter="tar")
    if not installed():
        raise CitusUnavailable(f"{archive} did not install citus.so and citus.control")


class CitusCluster:
    """A coordinator (``nodes[0]``) and its workers, each a
    :class:`~tests.support.pgcluster.Cluster`."""

    def __init__(self, directory: Path, workers: int = WORKERS) -> None:
        self.directory = directory
        self.nodes = [Cluster(directory / f"node{n}") for n in range(workers + 1)]

    @property
    def coordinator(self) -> Cluster:
        return self.nodes[0]

    @property
    def workers(self) -> list[Cluster]:
        return self.nodes[1:]

    def start(self) -> None:
        for node in self.nodes:
            node.start(settings=SETTINGS)
        self._join("postgres")

    def create_database(self, name: str) -> str:
        """A new database with Citus on every node, the workers added; its coordinator URL
        (Citus' catalogs are per database: each test module gets a cluster of its own)."""
        for node in self.nodes:
            self.run(node, f'CREATE DATABASE "{name}"')
        self._join(name)
        return self.url(self.coordinator, name)

    @staticmethod
    def url(node: Cluster, database: str) -> str:
        return sa.make_url(node.url).set(database=database).render_as_string(hide_password=False)

    def _join(self, database: str) -> None:
        for node in self.nodes:
            self.run(node, "CREATE EXTENSION citus", database)
        self.run(
            self.coordinator,
            f"SELECT citus_set_coordinator_host('127.0.0.1', {self.coordinator.port})",
            database,
        )
        for worker in self.workers:
            self.run(
                self.coordinator, f"SELECT citus_add_node('127.0.0.1', {worker.port})", database
            )

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    @classmethod
    def run(cls, node: Cluster, sql: str, database: str = "postgres") -> list[t.Any]:
        """One statement on ``node``'s ``database`` in autocommit; its rows."""
        from flask_idem.store import normalize_url

        url = normalize_url(cls.url(node, database))
        engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                result = conn.exec_driver_sql(sql)
                return list(result) if result.returns_rows else []
        finally:
            engine.dispose()
