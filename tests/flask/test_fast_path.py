"""The switch of SQLAlchemy's private fast path (``IDEMPOTENCY_SQLALCHEMY_FAST_PATH``)."""

from __future__ import annotations

import pytest
from flask import Flask

from flask_idem import Idempotency
from flask_idem.core.config import ConfigurationError, Settings
from flask_idem.store import create_store


def test_the_fast_path_is_on_by_default_and_a_flag() -> None:
    assert Settings.from_mapping({}).sqlalchemy_fast_path is True
    off = Settings.from_mapping({"IDEMPOTENCY_SQLALCHEMY_FAST_PATH": False})
    assert off.sqlalchemy_fast_path is False
    with pytest.raises(ConfigurationError, match="IDEMPOTENCY_SQLALCHEMY_FAST_PATH"):
        Settings.from_mapping({"IDEMPOTENCY_SQLALCHEMY_FAST_PATH": "sometimes"})


def test_an_application_that_switches_it_off_keeps_its_store_on_public_api(
    tmp_path: object,
) -> None:
    """Off in one application is off for its store, also when another one left it on."""
    store = create_store(f"sqlite:///{tmp_path}/off.db")
    on = Flask("on")
    Idempotency(on, store=store)
    assert store.fast_path is True
    off = Flask("off")
    off.config["IDEMPOTENCY_SQLALCHEMY_FAST_PATH"] = False
    Idempotency(off, store=store)
    assert store.fast_path is False
    assert create_store(f"sqlite:///{tmp_path}/other.db").fast_path is True
