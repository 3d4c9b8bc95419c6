"""The sample app under gunicorn, seen from outside: HTTP, SQL and worker processes.

Used by ``tests/e2e/test_sample_app.py``. Nothing here imports the sample app: the server is a
subprocess started exactly as the contract says (``gunicorn -w N -b 127.0.0.1:PORT
'sample_app:create_app()'``), its database is prepared by ``make migrate``, and tests look at
it through HTTP, SQL and ``/proc`` only.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import typing as t
from pathlib import Path

import sqlalchemy as sa

from flask_idem.core.key_digest import unkeyed
from flask_idem.store import create_engine

from .pgcluster import ROOT, free_port
from .wire import Reply

GUNICORN = str(Path(sys.executable).with_name("gunicorn"))
ALPHA = "sk_test_alpha"


def stored_key(key: str, tenant: str = "alpha") -> str:
    """``key`` as the sample app's table stores it (its unkeyed digest: the sample configures no
    ``IDEMPOTENCY_KEY_SECRETS``), for tests that look a record up in SQL."""
    return unkeyed(tenant, key)


BETA = "sk_test_beta"


def migrate(url: str) -> None:
    """``DATABASE_URL=<url> make migrate``; ``-o install`` because the session already runs
    inside the installed environment (and must not reinstall it)."""
    done = subprocess.run(
        ["make", "--no-print-directory", "-o", "install", "migrate"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": url},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"make migrate failed:\n{done.stdout}\n{done.stderr[-3000:]}")


@contextlib.contextmanager
def served(url: str, workdir: Path, **kwargs: t.Any) -> t.Iterator[SampleServer]:
    """``make migrate`` on ``url``, then a server (``SampleServer`` arguments) for the block."""
    migrate(url)
    server = SampleServer(url, workdir, **kwargs)
    try:
        yield server
    finally:
        server.stop()


def spelled(url: str, driver: str) -> str:
    """``url`` with the driver spelling a deployment might use (``postgresql``, ...)."""
    return sa.make_url(url).set(drivername=driver).render_as_string(hide_password=False)


class SampleServer:
    """A gunicorn master serving the sample app, plus the SQL and log views of it."""

    def __init__(
        self,
        url: str,
        workdir: Path,
        *,
        workers: int = 2,
        threads: int = 1,
        args: t.Sequence[str] = (),
        **env: str,
    ) -> None:
        self.url = url
        self.port = free_port()
        self.provider_log = workdir / "provider.log"
        self.provider_log.touch()
        self.server_log = workdir / "gunicorn.log"
        self.engine = create_engine(url)
        command = [
            GUNICORN,
            "-w",
            str(workers),
            "-b",
            f"127.0.0.1:{self.port}",
            "--graceful-timeout",
            "2",
            "--no-control-socket",
            *args,
            "sample_app:create_app()",
        ]
        if threads > 1:
            command[1:1] = ["--threads", str(threads)]
        environment = {
            **os.environ,
            "DATABASE_URL": url,
            "SAMPLE_PROVIDER_LOG": str(self.provider_log),
            **env,
        }
        with open(self.server_log, "wb") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT
            )
        self._wait_until_serving()

    def _wait_until_serving(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"gunicorn exited:\n{self.server_log.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                self.request("GET", "/v1/payments", api_key=None, timeout=2)
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gunicorn did not answer:\n{self.server_log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.engine.dispose()

    # -- HTTP ----------------------------------------------------------------------------

    def connection(self, timeout: float = 30) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        *,
        api_key: str | None = ALPHA,
        key: str | None = None,
        json_body: t.Any = None,
        raw: bytes | None = None,
        headers: t.Mapping[str, str] | None = None,
        connection: http.client.HTTPConnection | None = None,
        timeout: float = 30,
    ) -> Reply:
        """Send one request on a fresh connection (or ``connection``) and read the answer."""
        sent: dict[str, str] = {}
        if api_key is not None:
            sent["Authorization"] = f"Bearer {api_key}"
        if key is not None:
            sent["Idempotency-Key"] = key
        body = raw
        if json_body is not None:
            body = json.dumps(json_body).encode()
        if body is not None:
            sent["Content-Type"] = "application/json"
        sent.update(headers or {})
        conn = connection or self.connection(timeout)
        try:
            conn.request(method, path, body=body, headers=sent)
            response = conn.getresponse()
            return Reply(response.status, response.msg, response.read())
        finally:
            conn.close()

    def pay(self, key: str | None, body: t.Any, **kwargs: t.Any) -> Reply:
        return self.request("POST", "/v1/payments", key=key, json_body=body, **kwargs)

    # -- SQL and logs -------------------------------------------------------------------

    def sql(self, statement: str, **params: t.Any) -> list[sa.Row[t.Any]]:
        with self.engine.begin() as conn:
            result = conn.execute(sa.text(statement), params)
            return list(result.all()) if result.returns_rows else []

    def scalar(self, statement: str, **params: t.Any) -> t.Any:
        rows = self.sql(statement, **params)
        return rows[0][0] if rows else None

    def provider_attempts(self) -> list[str]:
        """The provider's log: one ``<tenant> <downstream key>`` line per charge attempt."""
        return self.provider_log.read_text().splitlines()

    def flask(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """``flask --app sample_app ARGS`` against the server's database (an operator's shell);
        ``stdin`` is piped in (a key, which never goes on the command line)."""
        return subprocess.run(
            [str(Path(sys.executable).with_name("flask")), "--app", "sample_app", *args],
            cwd=ROOT,
            env={**os.environ, "DATABASE_URL": self.url},
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )

    # -- processes ------------------------------------------------------------------------

    def workers(self) -> list[int]:
        """The worker processes: the children of the gunicorn master."""
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                # The command name may contain spaces: the parent pid follows its ")".
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == self.process.pid:
                    children.append(int(stat.parent.name))
        return children

    def worker_serving(self, client_port: int) -> int | None:
        """The worker holding the server side of the client's TCP connection (Linux /proc)."""
        inodes = set()
        with open("/proc/net/tcp") as table:
            next(table)
            for line in table:
                fields = line.split()
                local_port = int(fields[1].split(":")[1], 16)
                remote_port = int(fields[2].split(":")[1], 16)
                if local_port == self.port and remote_port == client_port:
                    inodes.add(f"socket:[{fields[9]}]")
        for pid in self.workers():
            with contextlib.suppress(OSError):
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    with contextlib.suppress(OSError):
                        if os.readlink(fd) in inodes:
                            return pid
        return None
