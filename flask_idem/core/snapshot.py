"""The replayable part of a Flask response: what a retry is answered with, or nothing."""

from __future__ import annotations

from werkzeug.wrappers import Response

from .config import Settings
from .record import StoredResponse


def response_snapshot(settings: Settings, response: Response) -> StoredResponse | None:
    """The replayable part of a response, or None when it cannot be stored.

    A streamed body is buffered when it declares a length within the limit: an
    ``HTTPException`` raised in a view (``abort(404)``, a :class:`Problem`) reaches us as such
    a response. A stream of unknown length, or a file passed through, is never buffered.
    """
    if response.direct_passthrough:
        return None
    if response.is_streamed:
        length = response.content_length
        if length is None or length > settings.max_body:
            return None
    body = response.get_data()
    if len(body) > settings.max_body:
        return None
    stored = settings.stored_headers
    headers = []
    for name, value in response.headers.to_wsgi_list():
        if name.lower() in stored:
            if "\x00" in value:
                # No database stores a NUL in JSON text (PostgreSQL's jsonb refuses it, and
                # would log the header in its error context): the answer is marked unstored.
                return None
            headers.append((name, value))
    return StoredResponse(response.status_code, tuple(headers), body)
