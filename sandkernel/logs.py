"""Logging set-up for the command line: one line per event, with structured fields.

Library modules log through ``logging.getLogger(__name__)`` and pass fields as ``extra``
(session, kernel, container); this formatter appends them as ``key=value`` so logs stay
greppable, or emits JSON lines with ``--log-format json``.
"""

from __future__ import annotations

import json
import logging
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def _fields(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        return f"{line} {extra}" if extra else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name}
        data.update(message=record.getMessage(), **_fields(record))
        return json.dumps(data, default=str)


def configure(level: str = "WARNING", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class Throttle:
    """Lets a repeated log line through at most once every ``seconds``, counting the rest.

    Why: a sandbox can make the host repeat a warning as fast as it can send (mis-signed kernel
    messages, a thousand a second), and one line each would fill the operator's log disk."""

    def __init__(self, seconds: float = 10.0) -> None:
        self.seconds = seconds
        self._next = 0.0
        self._suppressed = 0

    def allow(self) -> int | None:
        """None to stay quiet; else how many were kept quiet since the last line let through."""
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return None
        self._next = now + self.seconds
        skipped, self._suppressed = self._suppressed, 0
        return skipped
