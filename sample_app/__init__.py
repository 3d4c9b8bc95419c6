"""Placeholder sample app: shows the store answering a claim (the payments API comes next)."""

from __future__ import annotations

import hashlib
import os

from flask import Flask, jsonify, request

from flask_idem import Scope, create_store


def create_app() -> Flask:
    app = Flask(__name__)
    store = create_store(os.environ["DATABASE_URL"])

    @app.post("/claims/<key>")
    def claim(key: str):  # type: ignore[no-untyped-def]
        fingerprint = hashlib.sha256(request.get_data()).digest()
        result = store.claim(Scope("demo", "claim", key), fingerprint, ttl=86400, lease=30)
        return jsonify(claimed=result.claimed, state=result.record.state.value)

    return app
