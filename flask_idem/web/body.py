"""Reading a protected request's body: whole, bounded, and before anything is claimed.

The fingerprint, and so the claim, must be computed from the body the client meant to send.
Servers differ in how they report a body that did not arrive completely: gunicorn sets
``wsgi.input_terminated`` and hands back a *short* read when a ``Content-Length`` body is cut
off (so werkzeug cannot notice), and raises its own ``IOError`` subclasses for a broken chunked
body; werkzeug's server raises :class:`~werkzeug.exceptions.ClientDisconnected`. Here every one
of them is a 400 ``request-body-incomplete`` and a body over the limit a 413
``request-body-too-large``, both before any claim: a half body is never fingerprinted, its
answer never stored, and a complete retry with the same key runs normally.
"""

from __future__ import annotations

import functools
import io
import logging
import typing as t
import urllib.parse

from werkzeug.exceptions import ClientDisconnected

from ..core.problem import InternalError, RequestBodyIncomplete, RequestBodyTooLarge

if t.TYPE_CHECKING:
    from flask import Request

_CHUNK = 64 * 1024

log = logging.getLogger("flask_idem")


def read_body(request: Request, limit: int) -> bytes:
    """The complete request body, at most ``limit`` bytes; the view then reads it again.

    :raises RequestBodyTooLarge: the declared or received body exceeds ``limit`` (413).
    :raises RequestBodyIncomplete: fewer bytes than ``Content-Length`` arrived, the chunked
        framing broke, or reading failed (400).
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise _too_large(limit)
    if "form" in request.__dict__ and not getattr(request, "_cached_data", None):
        # Parsed as a form before the claim, and no bytes kept (none at all, or the b"" a
        # get_data() after the form read from the spent stream).
        parsed = _parsed_form(request)
        if parsed is not None:
            return parsed
    if declared is not None or "stream" in request.__dict__:
        # A declared length (within the limit): werkzeug reads it (bounded by the server:
        # gunicorn stops at the length); or someone read from the stream before us (the
        # cached property exists): take what was read. Either way a short read is an
        # incomplete body.
        body = _guarded(lambda: request.get_data(cache=True))
        _check(body, declared, limit)
        return body
    environ = request.environ
    source = environ.get("wsgi.input")
    if source is None or not environ.get("wsgi.input_terminated"):
        # No framing: werkzeug reads nothing in this case either (a keep-alive connection
        # would otherwise block until the client gives up).
        body = b""
    else:
        body = _read(source, limit)
    _check(body, None, limit)
    # Hand the exact bytes to werkzeug, so that get_data(), get_json() and form parsing in the
    # view see this body and nothing after it.
    environ["wsgi.input"] = io.BytesIO(body)
    environ["CONTENT_LENGTH"] = str(len(body))
    environ.pop("wsgi.input_terminated", None)
    # The body is no longer chunked: werkzeug reads nothing from a request that still says
    # "Transfer-Encoding: chunked" but is not input_terminated.
    environ.pop("HTTP_TRANSFER_ENCODING", None)
    return request.get_data(cache=True)


def _parsed_form(request: Request) -> bytes | None:
    """The body of a form that was parsed before the claim, or None if none was.

    CSRF protection (Flask-WTF) and signature checks read ``request.form`` in a
    ``before_request`` hook. werkzeug then keeps the fields, not the bytes, and the stream is
    spent. A URL-encoded form is encoded again from its fields: the fingerprint reads a valid
    form as the same pairs, so a retry replays and another form is 422. (A form werkzeug
    repaired, with invalid UTF-8 or percent escapes, is fingerprinted as it was repaired, not
    byte for byte as without the hook.) The bytes were already read, within the declared
    length the caller checked, so the rebuilt body, longer where it escapes characters, is not
    held to the limit. A multipart form cannot be rebuilt byte for byte (its files and
    boundary): it is refused before any claim, never fingerprinted as an empty body.
    """
    if request.mimetype == "application/x-www-form-urlencoded":
        return urllib.parse.urlencode(list(request.form.items(multi=True))).encode()
    if request.mimetype == "multipart/form-data":
        log.error(
            "a multipart body was parsed before the idempotency claim (request.form or "
            "request.files in a before_request hook or a decorator above @idem.idempotent): "
            "it cannot be fingerprinted; read request.get_data() before it, or give the view "
            "a fingerprint= function"
        )
        raise InternalError(
            "The server read this request's form before checking its idempotency key, so it "
            "could not tell a retry from a new request; nothing was executed."
        )
    return None


def _read(source: t.Any, limit: int) -> bytes:
    """A body of undeclared length (chunked), up to one byte past ``limit``."""
    chunks: list[bytes] = []
    received = 0
    # Read one byte past the limit to tell "exactly at the limit" from "over it".
    ceiling = limit + 1
    while received < ceiling:
        chunk = _guarded(functools.partial(source.read, min(_CHUNK, ceiling - received)))
        if not chunk:
            break
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)


def _guarded(read: t.Callable[[], bytes]) -> bytes:
    try:
        return read()
    except ClientDisconnected:
        raise _incomplete("The client disconnected before the request body was complete.") from None
    except (OSError, ValueError) as exc:
        # gunicorn's NoMoreData, ChunkMissingTerminator, InvalidChunkSize are IOErrors; a
        # reset or timed-out socket is an OSError as well.
        raise _incomplete(
            f"The request body could not be read ({type(exc).__name__}); it may have been "
            "cut off or badly chunked."
        ) from None


def _check(body: bytes, declared: int | None, limit: int) -> None:
    if len(body) > limit:
        raise _too_large(limit)
    if declared is not None and len(body) != declared:
        raise _incomplete(
            f"The request body ended after {len(body)} of the {declared} bytes its "
            "Content-Length announced."
        )


def _too_large(limit: int) -> RequestBodyTooLarge:
    return RequestBodyTooLarge(
        f"The request body is larger than {limit} bytes, the most this endpoint accepts; "
        "nothing was executed."
    )


def _incomplete(detail: str) -> RequestBodyIncomplete:
    return RequestBodyIncomplete(
        f"{detail} Nothing was executed and the key was not used: send the whole body again "
        "with the same key."
    )
