"""What a gateway handler raises to refuse a request, and the request body limits: below
gateway/base.py (which maps every error to its JSON reply) so that the cluster's modules, which
sign and forward requests, use them without importing the handlers.
"""

from __future__ import annotations

from http import HTTPStatus

from tornado import web

# Request bodies larger than this get a JSON 413 (checked on Content-Length, then while reading).
MAX_BODY_BYTES = 40 * 1024 * 1024
# Tornado's own cap (its HTTPServer's max_body_size): a body over it ends the connection with a
# bare 400. Up to it, the rest of an over-limit body is read and dropped after the 413 went out
# (BaseHandler.refuse_then_drain).
MAX_DRAINED_BYTES = 2 * MAX_BODY_BYTES


class ApiError(web.HTTPError):
    """A handler's refusal of a request: an HTTP status, a machine code and a sentence for people."""

    def __init__(self, status: int, message: str, code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(status, reason=HTTPStatus(status).phrase)
        self.message = message
        self.code = code or phrase_code(status)
        self.retry_after = retry_after


def phrase_code(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:
        return "error"
