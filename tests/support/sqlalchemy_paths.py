"""Both ways the store reaches the driver: SQLAlchemy's private fast path and public API only.

A test module that says ``pytestmark = pytest.mark.usefixtures("sqlalchemy_path")`` runs each
of its tests twice: once with every store on the fast path (``IDEMPOTENCY_SQLALCHEMY_FAST_PATH``
True, the default) and once with every store on SQLAlchemy's public API only (False), whether
the test builds its store itself or through ``init_app``.
"""

from __future__ import annotations

import typing as t

import pytest

from flask_idem.store.base import RequestStore

PATHS = {"fast_path": True, "public_api": False}


@pytest.fixture(params=list(PATHS.values()), ids=list(PATHS))
def sqlalchemy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> t.Any:
    """Every store of the test on one path (a store starts from this class default, and an
    application's ``IDEMPOTENCY_SQLALCHEMY_FAST_PATH = False`` can only switch it off)."""
    monkeypatch.setattr(RequestStore, "fast_path", request.param)
    return request.param
