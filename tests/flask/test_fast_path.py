"""The switch of SQLAlchemy's private fast path (``IDEMPOTENCY_SQLALCHEMY_FAST_PATH``)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency, commits
from flask_idem.core.config import ConfigurationError, Settings
from flask_idem.store import create_store


def test_the_fast_path_is_on_by_default_and_a_flag() -> None:
    assert Settings.from_mapping({}).sqlalchemy_fast_path is True
    off = Settings.from_mapping({"IDEMPOTENCY_SQLALCHEMY_FAST_PATH": False})
    assert off.sqlalchemy_fast_path is False
    with pytest.raises(ConfigurationError, match="IDEMPOTENCY_SQLALCHEMY_FAST_PATH"):
        Settings.from_mapping({"IDEMPOTENCY_SQLALCHEMY_FAST_PATH": "sometimes"})


def test_a_store_on_the_fast_path_refuses_an_application_that_switches_it_off(
    tmp_path: object,
) -> None:
    """Its dialect is wrapped already: the application asking for public API only would get
    both the wrapped dialect and the event listeners. A store switched off first stays off."""
    store = create_store(f"sqlite:///{tmp_path}/on.db")
    Idempotency(Flask("on"), store=store)
    assert store.fast_path is True
    off = Flask("off")
    off.config["IDEMPOTENCY_SQLALCHEMY_FAST_PATH"] = False
    with pytest.raises(ConfigurationError, match="its own store"):
        Idempotency(off, store=store)
    assert store.fast_path is True and not sa.event.contains(
        store.engine, "commit", commits._on_commit
    )

    public = create_store(f"sqlite:///{tmp_path}/off.db")
    Idempotency(off, store=public)
    Idempotency(Flask("default"), store=public)  # keeps to public API, as asked first
    assert public.fast_path is False
    assert "do_commit" not in vars(public.engine.dialect)
    assert create_store(f"sqlite:///{tmp_path}/other.db").fast_path is True


def test_switched_off_the_commit_guard_listens_to_events_instead_of_wrapping_the_dialect(
    tmp_path: object,
) -> None:
    """Off, nothing of the store engine's dialect is replaced: the commit guard's checks
    (run on both paths by the commit guard's tests) are SQLAlchemy event listeners."""
    off = Flask("off")
    off.config["IDEMPOTENCY_SQLALCHEMY_FAST_PATH"] = False
    store = create_store(f"sqlite:///{tmp_path}/events.db")
    Idempotency(off, store=store)
    dialect = store.engine.dialect
    for name in ("do_commit", "do_rollback", "do_execute", "do_execute_no_params"):
        assert name not in vars(dialect), f"{name} was replaced on the dialect"
    assert sa.event.contains(store.engine, "commit", commits._on_commit)

    on = create_store(f"sqlite:///{tmp_path}/wrapped.db")
    Idempotency(Flask("on"), store=on)
    assert "do_commit" in vars(on.engine.dialect)
    assert not sa.event.contains(on.engine, "commit", commits._on_commit)
