"""How a log line looks: ``text`` (the default) or ``json``, for the daemon and its workers.

``--log-format`` / ``[daemon] log_format`` picks it; the daemon's own handler (``cli.py``)
and every worker's (``workers/runtime.py``, told on its bootstrap pipe) use it.

``text``: ``2026-01-02 03:04:05,678 INFO mlxceld.api.access: POST /v1/... 200 ...``.

``json``: one object per line, ``{"time": "2026-01-02T03:04:05.678Z", "level": "INFO",
"logger": "mlxceld.api.access", "message": "POST /v1/... 200 ..."}``, and a record's
structured fields beside them (a logging call's ``extra={"fields": {...}}``: the access
log's method, path, status, tokens, duration_ms, request_id, completion_id), and ``exc``
with the traceback when there is one. A field never replaces one of the four.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Final, Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final = ("text", "json")
TEXT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
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


def formatter(kind: LogFormat) -> logging.Formatter:
    return JsonFormatter() if kind == "json" else logging.Formatter(TEXT)
