"""How a log line looks: ``text`` (the default) or ``json``, for the daemon and its workers.

``--log-format`` / ``[daemon] log_format`` picks it; the daemon's own handler (``cli.py``)
and every worker's (``workers/runtime.py``, told on its bootstrap pipe) use it.

``text``: ``2026-01-02 03:04:05,678 INFO mlxceld.api.access: POST /v1/... 200 ...``.

``json``: one object per line, ``{"time": "2026-01-02T03:04:05.678Z", "level": "INFO",
"logger": "mlxceld.api.access", "message": "POST /v1/... 200 ..."}``, and a record's
structured fields beside them (a logging call's ``extra={"fields": {...}}``: the access
log's method, path, status, tokens, duration_ms, request_id, completion_id), and ``exc``
with the traceback when there is one. A field never replaces one of the four.

Under systemd, where the daemon's stderr is the journal (``JOURNAL_STREAM`` names its
device and inode, as systemd.exec(5) documents: ``journal_stderr``), a ``text`` line
carries no time of its own (the journal stamps every line) and starts with its syslog
priority as sd-daemon(3) reads it: ``<3>`` error (``<2>`` critical), ``<4>`` warning,
``<6>`` info, ``<7>`` debug; so ``journalctl -p warning`` picks them. Every line of a
record (a traceback's too) carries it. ``json`` lines stay as they are (their own time
included: a prefix would break them). Elsewhere, and when stderr was redirected away
from the journal (``2>file``, a pipe), lines are as above.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import IO, Any, Final, Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final = ("text", "json")
TEXT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_TEXT: Final = "%(levelname)s %(name)s: %(message)s"  # the journal has the time
BASE_KEYS: Final = ("time", "level", "logger", "message")


class JsonFormatter(logging.Formatter):
    """A record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line: dict[str, Any] = {"time": f"{stamp}.{int(record.msecs):03d}Z",
                                "level": record.levelname, "logger": record.name,
                                "message": record.getMessage()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update((k, v) for k, v in fields.items() if k not in BASE_KEYS)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        return json.dumps(line, default=str)


class JournalFormatter(logging.Formatter):
    """A text record for the journal: no time, each line led by its syslog priority."""

    def __init__(self) -> None:
        super().__init__(JOURNAL_TEXT)

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def priority(levelno: int) -> int:
    """sd-daemon's syslog priority of a logging level."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    return 6 if levelno >= logging.INFO else 7


def stderr_is_journal(stream: IO[Any], environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``stream`` is the journal stream systemd connected (``JOURNAL_STREAM``'s
    ``DEVICE:INODE`` is the stream's own), not a file or pipe it was redirected to."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError):  # no descriptor behind it (a test's capture), or closed
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def formatter(kind: LogFormat, *, journal: bool = False) -> logging.Formatter:
    """``kind``'s formatter; ``journal``: the stream is the journal (``text`` only)."""
    if kind == "json":
        return JsonFormatter()
    return JournalFormatter() if journal else logging.Formatter(TEXT)
