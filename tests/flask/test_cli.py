"""``flask idem maintain|stuck|show|history|release`` and start-up partition upkeep, on both
databases.

``flask idem reconcile`` is covered with the reconcilers in ``test_reconcile.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pty
import re
import select
import subprocess
import sys
import textwrap
import typing as t
from pathlib import Path

import flask
import pytest
from click.testing import Result

from flask_idem import Idempotency, Scope, State, StoredResponse, create_store
from flask_idem.core.idempotency_keys import key_hash
from flask_idem.core.key_digest import unkeyed
from flask_idem.ops.migrate import upgrade
from flask_idem.store import SQLStore
from tests.support.helpers import Counter, partition_names, run_sql, shift

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]
FP = hashlib.sha256(b"request").digest()
PAYMENTS = "POST /payments"


def idem(app: flask.Flask, *args: str, input: str | None = None) -> Result:
    """Run ``flask idem ARGS`` against ``app``."""
    return app.test_cli_runner().invoke(args=["idem", *args], input=input)


def _pay(app: flask.Flask, key: str, tenant: str = "alpha") -> flask.Response:
    response = app.test_client().post(
        "/payments", json={"amount": 4200}, headers={"Idempotency-Key": key, "X-Tenant": tenant}
    )
    assert response.status_code == 201, response.data
    return response


@pytest.fixture
def restore_partitions(store: SQLStore) -> t.Iterator[None]:
    """Maintenance drops yesterday's empty partition: give later tests a fresh migration's."""
    yield
    if store.dialect == "postgresql":
        run_sql(store, "SELECT idempotency_create_partitions(7, false, 1)")


def _partition(store: SQLStore, days_ahead: int) -> str:
    day = run_sql(
        store, f"SELECT to_char((now() AT TIME ZONE 'UTC')::date + {days_ahead}, 'YYYYMMDD')"
    )
    return f"idempotency_keys_p{day[0][0]}"


# -- the group -------------------------------------------------------------------------------


def test_init_app_registers_the_command_group(app_factory: Factory) -> None:
    app, _, _ = app_factory()
    result = idem(app, "--help")
    assert result.exit_code == 0, result.output
    for command in ("maintain", "stuck", "show", "release", "reconcile"):
        assert command in result.stdout
    for command in ("maintain", "stuck", "show", "release", "reconcile"):
        assert "--json" in idem(app, command, "--help").stdout


def test_store_failures_exit_non_zero_with_one_line(db_url: str) -> None:
    broken = create_store(
        "sqlite:////nonexistent-dir/for/sure/idem.sqlite3"
        if db_url.startswith("sqlite")
        else "postgresql://nobody@127.0.0.1:1/none"
    )
    app = flask.Flask("broken")
    Idempotency(app, store=broken, tenant=lambda: "alpha")
    for args in (["maintain"], ["stuck"], ["show", "--tenant", "t"], ["reconcile"]):
        result = idem(app, *args, input="k\n")
        assert result.exit_code == 1, (args, result.output)
        assert "Error: idempotency store failed" in result.stderr
        assert "Traceback" not in result.output
    broken.engine.dispose()


# -- maintain --------------------------------------------------------------------------------


@pytest.mark.usefixtures("restore_partitions")
def test_maintain_creates_missing_partitions_idempotently(store: SQLStore) -> None:
    app = flask.Flask("maintain")
    Idempotency(app, store=store, tenant=lambda: "alpha")
    if store.dialect == "sqlite":
        # One plain table: nothing to create, and the output says only what applies.
        assert idem(app, "maintain").stdout == "purged 0 expired rows\n"
        return
    # Partitions for today's window first: the suite's database may have been migrated before
    # midnight, and the new day's last partition would be missing too.
    run_sql(store, "SELECT idempotency_create_partitions(7, false, 1)")
    missing = _partition(store, 3)
    run_sql(store, f"DROP TABLE {missing}")

    dry = idem(app, "maintain", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert f"would create 1 partition: {missing}\n" in dry.stdout
    assert missing not in partition_names(store), "a dry run changes nothing"

    done = idem(app, "maintain")
    assert f"created 1 partition: {missing}\n" in done.stdout
    assert "purged 0 expired rows" in done.stdout
    assert missing in partition_names(store)

    again = json.loads(idem(app, "maintain", "--json").stdout)
    assert again == {
        "dialect": "postgresql",
        "created": [],
        "dropped": [],
        "purged": 0,
        "dry_run": False,
    }


@pytest.mark.usefixtures("restore_partitions")
def test_maintain_removes_expired_records(store: SQLStore) -> None:
    app = flask.Flask("maintain")
    Idempotency(app, store=store, tenant=lambda: "alpha")
    expired = Scope("alpha", PAYMENTS, "old")
    store.claim(expired, FP, ttl=60, lease=30)
    # Past its TTL counted from the claim and from the end of its (abandoned) lease.
    shift(store, expired, 91)
    if store.dialect == "postgresql":
        # Two days back, in a partition of its own: the whole partition goes, no row delete.
        run_sql(store, "SELECT idempotency_create_partitions(0, false, 2)")
        shift(store, expired, 2 * 86400)
        gone = _partition(store, -2)
        report = json.loads(idem(app, "maintain", "--dry-run", "--json").stdout)
        assert gone in report["dropped"] and report["dry_run"]
        assert gone in idem(app, "maintain").stdout
        assert gone not in partition_names(store)
    else:
        dry = idem(app, "maintain", "--dry-run", "--json")
        assert json.loads(dry.stdout) == {
            "dialect": "sqlite",
            "created": [],
            "dropped": [],
            "purged": 1,
            "dry_run": True,
        }
        assert idem(app, "maintain", "--ahead", "2").stdout == "purged 1 expired row\n"
    assert store.find("alpha", "old") == []
    assert store.get(expired) is None


@pytest.mark.usefixtures("restore_partitions")
def test_init_app_creates_missing_partitions_when_configured(store: SQLStore) -> None:
    if store.dialect == "sqlite":
        app = flask.Flask("startup")
        app.config["IDEMPOTENCY_ENSURE_PARTITIONS"] = True
        Idempotency(app, store=store, tenant=lambda: "alpha")  # a read-only check: no error
        return
    missing = _partition(store, 2)
    run_sql(store, f"DROP TABLE {missing}")
    Idempotency(flask.Flask("off"), store=store, tenant=lambda: "alpha")
    assert missing not in partition_names(store), "off by default"

    app = flask.Flask("startup")
    app.config["IDEMPOTENCY_ENSURE_PARTITIONS"] = True
    Idempotency(app, store=store, tenant=lambda: "alpha")
    assert missing in partition_names(store)


def test_start_up_check_never_stops_the_app(caplog: pytest.LogCaptureFixture) -> None:
    broken = create_store("postgresql://nobody@127.0.0.1:1/none")
    app = flask.Flask("startup")
    app.config["IDEMPOTENCY_ENSURE_PARTITIONS"] = True
    with caplog.at_level(logging.ERROR, logger="flask_idem"):
        Idempotency(app, store=broken, tenant=lambda: "alpha")
    assert "flask idem maintain" in caplog.text
    assert "idempotency" in app.extensions
    broken.engine.dispose()


# -- stuck -----------------------------------------------------------------------------------


def _stuck_records(store: SQLStore) -> tuple[Scope, Scope]:
    """A dead request (lease expired) and an older unknown outcome, plus two healthy records."""
    dead, unknown = Scope("alpha", PAYMENTS, "dead-key"), Scope("beta", PAYMENTS, "unk-key")
    store.claim(dead, FP, ttl=3600, lease=30)
    shift(store, dead, 95, "lease_expires_at")
    store.mark_unknown(unknown, store.claim(unknown, FP, ttl=3600, lease=30).token)
    shift(store, unknown, 600, "created_at")
    store.claim(Scope("alpha", PAYMENTS, "alive-key"), FP, ttl=3600, lease=30)
    done = Scope("alpha", PAYMENTS, "done-key")
    store.complete(done, store.claim(done, FP, ttl=3600, lease=30).token, None)
    return dead, unknown


def test_stuck_lists_oldest_first_with_key_hashes(store: SQLStore) -> None:
    app = flask.Flask("stuck")
    Idempotency(app, store=store, tenant=lambda: "alpha")
    assert idem(app, "stuck").stdout == "no stuck records\n"
    dead, unknown = _stuck_records(store)

    result = idem(app, "stuck")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["AGE", "STATE", "LEASE", "TENANT", "ENDPOINT", "KEY", "HASH"]
    assert lines[1].split() == ["10m00s", "unknown", "-", "beta", "POST", "/payments"] + [
        key_hash(unknown)
    ]
    assert lines[2].split()[1:] == [
        "in_progress",
        "expired",
        "1m05s",
        "ago",
        "alpha",
        "POST",
        "/payments",
        key_hash(dead),
    ]
    assert lines[3] == "2 stuck records: 1 in progress past the lease, 1 unknown"
    assert "-key" not in result.stdout, "raw keys only with --show-keys"

    shown = idem(app, "stuck", "--show-keys", "--limit", "1").stdout
    assert "unk-key" not in shown, "raw keys are not stored: --show-keys shows their digests"
    assert unkeyed("beta", "unk-key") in shown and unkeyed("alpha", "dead-key") not in shown
    assert "1 stuck record: 0 in progress past the lease, 1 unknown" in shown
    assert "(the oldest 1; there may be more)" in shown


def test_stuck_json_for_scripts(store: SQLStore) -> None:
    app = flask.Flask("stuck")
    Idempotency(app, store=store, tenant=lambda: "alpha")
    dead, unknown = _stuck_records(store)
    listed = json.loads(idem(app, "stuck", "--json").stdout)
    assert [item["key_hash"] for item in listed] == [key_hash(unknown), key_hash(dead)]
    first = listed[0]
    assert first["state"] == "unknown" and first["tenant"] == "beta"
    assert first["endpoint"] == PAYMENTS and 599 <= first["age_seconds"] <= 610
    assert first["replays"] is False and first["status"] is None
    assert listed[1]["lease_expired"] is True
    assert "key" not in first and "body" not in first
    with_keys = json.loads(idem(app, "stuck", "--json", "--show-keys").stdout)
    assert [item["key"] for item in with_keys] == [
        unkeyed("beta", "unk-key"),
        unkeyed("alpha", "dead-key"),
    ]


# -- show ------------------------------------------------------------------------------------


def _value(text: str, name: str) -> str:
    """The value printed for ``name`` in ``flask idem show`` output."""
    found = re.search(rf"^{name}  +(.*)$", text, re.MULTILINE)
    assert found is not None, text
    return found.group(1)


def test_show_prints_state_timestamps_fingerprint_and_status(app_factory: Factory) -> None:
    app, _, _ = app_factory()
    _pay(app, "show-key")
    result = idem(app, "show", "--tenant", "alpha", input="show-key\n")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert _value(text, "endpoint") == PAYMENTS
    assert _value(text, "state") == "completed"
    assert _value(text, "status") == "201"
    assert _value(text, "replays") == "yes"
    assert _value(text, "tenant") == "alpha"
    assert _value(text, "key hash") == key_hash(Scope("alpha", PAYMENTS, "show-key"))
    assert "pay_1" not in text, "stored bodies and headers only when configured"
    assert "show-key" not in text
    shown = idem(app, "show", "--tenant", "alpha", "--json", input="show-key\n")
    record = json.loads(shown.stdout)[0]
    stored = app.extensions["idempotency"].store.get(Scope("alpha", PAYMENTS, "show-key"))
    assert record["fingerprint"] == stored.fingerprint.hex()
    assert record["first_seen"] == stored.created_at.isoformat()
    assert record["completed_at"] == stored.completed_at.isoformat()
    assert record["expires_at"] == stored.expires_at.isoformat()
    assert record["status"] == 201 and record["replays"] is True
    assert "body" not in record


def test_show_filters_by_endpoint_and_tenant(app_factory: Factory) -> None:
    app, _, _ = app_factory()
    _pay(app, "shared")
    assert (
        app.test_client().post("/status/200", headers={"Idempotency-Key": "shared"}).status_code
        == 200
    )
    both = json.loads(idem(app, "show", "--tenant", "alpha", "--json", input="shared\n").stdout)
    assert [item["endpoint"] for item in both] == [PAYMENTS, "POST /status/<int:code>"]
    one = idem(app, "show", "--tenant", "alpha", "--endpoint", PAYMENTS, "--json", input="shared")
    assert [item["endpoint"] for item in json.loads(one.stdout)] == [PAYMENTS]

    other = idem(app, "show", "--tenant", "beta", input="shared\n")
    assert other.exit_code == 1
    assert other.stdout == ""
    assert "no live record of this key for this tenant" in other.stderr
    nope = idem(app, "show", "--tenant", "alpha", "--json", input="nope\n")
    assert json.loads(nope.stdout) == []


def test_show_prints_bodies_only_when_configured(app_factory: Factory) -> None:
    app, _, _ = app_factory(IDEMPOTENCY_INSPECT_BODIES=True)
    _pay(app, "body-key")
    shown = idem(app, "show", "--tenant", "alpha", "--json", input="body-key\n")
    record = json.loads(shown.stdout)[0]
    assert json.loads(record["body"]) == {"id": "pay_1", "amount": 4200}
    assert record["body_encoding"] == "utf-8"
    assert ["Location", "/payments/pay_1"] in record["headers"]
    text = idem(app, "show", "--tenant", "alpha", input="body-key\n").stdout
    assert "Location: /payments/pay_1" in text


# -- how a key is named: never on the command line ------------------------------------------


def test_a_raw_key_on_the_command_line_is_refused(app_factory: Factory) -> None:
    app, _, counter = app_factory(IDEMPOTENCY_AUDIT=True)
    _pay(app, "cmdline-secret")
    for args in (
        ("show", "cmdline-secret", "--tenant", "alpha"),
        ("history", "cmdline-secret", "--tenant", "alpha"),
        ("release", "cmdline-secret", "--tenant", "alpha", "--endpoint", PAYMENTS, "--yes"),
    ):
        refused = idem(app, *args)
        assert refused.exit_code == 2, (args, refused.output)
        assert "Invalid value for KEY_HASH: not a key hash" in refused.stderr
        assert "Never put a raw key on the command line" in refused.stderr
        pipe = f"printf '%s\\n' \"$KEY\" | idem-test idem {args[0]} --tenant ..."
        assert pipe in refused.stderr, "says how to pipe it in"
        assert "cmdline-secret" not in refused.output, "never echoed back"
        assert refused.stdout == ""
    assert "Idempotent-Replayed" in _pay(app, "cmdline-secret").headers, "nothing released"
    assert counter.calls == 1


def test_records_are_named_by_their_key_hash(store: SQLStore) -> None:
    app = flask.Flask("by-hash")
    Idempotency(app, store=store, tenant=lambda: "alpha")
    dead, unknown = _stuck_records(store)
    listed = idem(app, "stuck").stdout
    assert key_hash(dead) in listed, "the hash the operator copies from stuck"

    (shown,) = json.loads(idem(app, "show", key_hash(dead), "--tenant", "alpha", "--json").stdout)
    assert shown["key_hash"] == key_hash(dead) and shown["endpoint"] == PAYMENTS
    assert shown["state"] == "in_progress" and shown["lease_expired"] is True
    other = idem(app, "show", key_hash(unknown), "--tenant", "alpha")
    assert other.exit_code == 1, "the hash of another tenant's key finds nothing"

    args = ("release", key_hash(dead), "--tenant", "alpha", "--endpoint", PAYMENTS, "--yes")
    released = idem(app, *args)
    assert released.exit_code == 0, released.output
    assert released.stdout == f"reopened {PAYMENTS} for alpha, key hash {key_hash(dead)}\n"
    record = store.get(dead)
    assert record is not None and record.state is State.REOPENED
    assert idem(app, "release", "0" * 16, *args[2:]).exit_code == 1
    # The database hashes as Python does, UTF-8 included.
    accented = Scope("tënant-ü", PAYMENTS, "accented-tenant-key")
    store.claim(accented, FP, ttl=3600, lease=30)
    found = idem(app, "show", key_hash(accented), "--tenant", accented.tenant, "--json")
    assert [item["key_hash"] for item in json.loads(found.stdout)] == [key_hash(accented)]


def test_a_piped_key_must_be_there_and_valid(app_factory: Factory) -> None:
    app, _, _ = app_factory()
    _pay(app, "piped-key")
    quoted = idem(app, "show", "--tenant", "alpha", "--json", input=' "piped-key"\r\n')
    assert quoted.exit_code == 0 and len(json.loads(quoted.stdout)) == 1, "as a header spells it"
    empty = idem(app, "show", "--tenant", "alpha", input="")
    assert empty.exit_code == 2 and "no key on standard input" in empty.stderr
    invalid = idem(app, "show", "--tenant", "alpha", input="no spaces allowed\n")
    assert invalid.exit_code == 2
    assert "the key on standard input: an idempotency key is 1 to 255" in invalid.stderr


def _read_until(fd: int, marker: bytes, timeout: float = 30.0) -> bytes:
    seen = b""
    while marker not in seen:
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, f"waited for {marker!r}, got {seen!r}"
        chunk = os.read(fd, 4096)
        assert chunk, f"closed before {marker!r}: {seen!r}"
        seen += chunk
    return seen


def test_on_a_terminal_the_key_is_typed_at_a_prompt_that_does_not_echo(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/prompt.sqlite3"
    upgrade(url)
    store = create_store(url)
    scope = Scope("alpha", PAYMENTS, "typed-secret-key")
    store.claim(scope, FP, ttl=600, lease=30)
    store.engine.dispose()
    (tmp_path / "prompt_app.py").write_text(
        textwrap.dedent(
            f"""
            import flask
            from flask_idem import Idempotency

            app = flask.Flask("prompt")
            app.config["IDEMPOTENCY_DATABASE_URL"] = {url!r}
            Idempotency(app, tenant=lambda: "alpha")
            """
        )
    )
    terminal, process_side = pty.openpty()
    env = {key: value for key, value in os.environ.items() if key != "FLASK_APP"}
    # A session of its own: no controlling terminal, so the prompt turns echo off on stdin,
    # the terminal this test types into.
    process = subprocess.Popen(
        [sys.executable, "-m", "flask", "--app", "prompt_app", "idem", "show", "--tenant", "alpha"],
        cwd=tmp_path,
        env=env,
        stdin=process_side,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert process.stderr is not None
        prompt = _read_until(process.stderr.fileno(), b"Idempotency key: ")
        os.write(terminal, b"typed-secret-key\n")
        out, err = process.communicate(timeout=60)
        ready, _, _ = select.select([terminal], [], [], 0)
        echoed = os.read(terminal, 4096) if ready else b""
    finally:
        process.kill()
        process.wait()
        # Kept open until now: reading the terminal after the process ended is no error.
        os.close(process_side)
        os.close(terminal)
    assert process.returncode == 0, (prompt, out, err)
    assert _value(out.decode(), "key hash") == key_hash(scope)
    assert b"typed-secret-key" not in echoed + out + prompt + err, "typed, never shown"


# -- release ---------------------------------------------------------------------------------


def test_release_refuses_a_completed_operation(app_factory: Factory) -> None:
    app, _, counter = app_factory()
    _pay(app, "rel-key")
    for extra in ((), ("--not-happened",)):
        args = ("release", "--tenant", "alpha", "--endpoint", PAYMENTS, *extra)
        refused = idem(app, *args, input="rel-key\ny\n")
        assert refused.exit_code == 1
        assert "it happened, and releasing it would run it a second time" in refused.stderr
        assert "Idempotent-Replayed" in _pay(app, "rel-key").headers, "nothing released"
    assert counter.calls == 1


def test_release_asks_first_then_reopens_as_the_same_operation(store: SQLStore) -> None:
    app = flask.Flask("release")
    idem_app = Idempotency(app, store=store, tenant=lambda: "alpha")
    charges: list[str] = []

    @app.post("/payments")
    @idem_app.idempotent
    def pay() -> t.Any:
        charges.append(idem_app.downstream_key("charge"))
        if len(charges) == 1:
            raise RuntimeError("the provider charged, then the answer was lost")
        return "paid", 201

    client = app.test_client()
    assert client.post("/payments", headers={"Idempotency-Key": "rel-key"}).status_code == 500
    args = ("release", "--tenant", "alpha", "--endpoint", PAYMENTS)
    declined = idem(app, *args, input="rel-key\nn\n")
    assert declined.exit_code == 1
    assert "The next retry runs it again as the same operation" in declined.stderr
    assert "Release this key? [y/N]" in declined.stderr
    assert declined.stdout == "", "the prompt goes to stderr"
    accepted = idem(app, *args, input="rel-key\ny\n")
    assert accepted.exit_code == 0, accepted.output
    scope = Scope("alpha", PAYMENTS, "rel-key")
    assert accepted.stdout == f"reopened POST /payments for alpha, key hash {key_hash(scope)}\n"
    again = client.post("/payments", headers={"Idempotency-Key": "rel-key"})
    assert again.status_code == 201 and "Idempotent-Replayed" not in again.headers
    assert charges[0] == charges[1], "the re-run keeps its downstream key"


def test_release_with_yes_and_json(store: SQLStore) -> None:
    app = flask.Flask("release")
    Idempotency(app, store=store, tenant=lambda: "alpha")
    scope = Scope("alpha", PAYMENTS, "unk")
    store.mark_unknown(scope, store.claim(scope, FP, ttl=60, lease=30).token)
    args = ["release", "--tenant", "alpha", "--endpoint", PAYMENTS, "--not-happened"]

    warned = idem(app, *args, input="unk\nn\n")
    assert "The next retry runs it again as the same operation" in warned.stderr
    before = store.get(scope)

    result = idem(app, *args, "--yes", "--json", input="unk\n")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["released"] is True and answer["action"] == "reopened"
    assert answer["record"]["state"] == State.UNKNOWN.value
    assert answer["record"]["key_hash"] == key_hash(scope)
    after = store.get(scope)
    assert after is not None and after.state is State.REOPENED, "never forgotten"
    assert before is not None and after.created_at == before.created_at, "same downstream keys"

    again = idem(app, *args, "--yes", input="unk\n")
    assert again.exit_code == 1
    assert "It is already reopened: the next retry runs it." in again.stderr
    missing = idem(app, *args, "--yes", input="other\n")
    assert missing.exit_code == 1
    assert "no live record of this key for this tenant and endpoint" in missing.stderr


def test_release_warns_about_a_running_request(store: SQLStore) -> None:
    app = flask.Flask("release")
    Idempotency(app, store=store, tenant=lambda: "alpha")
    scope = Scope("alpha", PAYMENTS, "running")
    store.claim(scope, FP, ttl=60, lease=30)
    args = ("release", "--tenant", "alpha", "--endpoint", PAYMENTS)
    result = idem(app, *args, input="running\nn\n")
    assert "Its request is still running" in result.stderr
    assert store.get(scope) is not None
    forced = idem(app, *args, "--not-happened", "--yes", input="running\n")
    assert forced.exit_code == 1 and "Its request is still running" in forced.stderr
    assert store.get(scope) is not None, "a running retry is never forgotten under it"


def test_release_is_scoped_by_tenant(store: SQLStore) -> None:
    app = flask.Flask("release")
    Idempotency(app, store=store, tenant=lambda: "alpha")
    mine = Scope("alpha", PAYMENTS, "k")
    token = store.claim(mine, FP, ttl=60, lease=30).token
    store.complete(mine, token, StoredResponse(201, (), b"{}"))
    args = ("release", "--tenant", "beta", "--endpoint", PAYMENTS, "--yes")
    result = idem(app, *args, input="k\n")
    assert result.exit_code == 1
    assert store.get(mine) is not None
