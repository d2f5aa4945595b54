"""Structured logs: one JSON object per line, with any `extra={...}` fields a log call passes."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

__all__ = ["JSONFormatter", "log_config"]

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged as a field.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName", "color_message"}


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def log_config(level: str = "INFO") -> dict[str, Any]:
    """A `logging.config.dictConfig` for uvicorn and tvcache: JSON lines on stderr."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": sys.stderr}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JSONFormatter}},
        "handlers": {"json": handler},
        "loggers": {
            name: {"handlers": ["json"], "level": level, "propagate": False}
            for name in ("tvcache", "uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }
