"""Structured logging: one JSON object per line, with the fields passed as ``extra``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, replica: str = "") -> None:
        super().__init__()
        self._replica = replica

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self._replica:
            entry["replica"] = self._replica
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


QUIET_LOGGERS = ("httpx2", "httpx", "httpcore", "urllib3", "botocore", "boto3", "s3transfer", "huggingface_hub")


def configure(level: str, replica: str = "") -> None:
    """Sends every log record of the process to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(replica))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # The HTTP clients of the storage libraries log every request's full URL at INFO, and a download
    # URL may be presigned (a signature in its query is a credential for as long as it lasts).
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """Every server's ``--log-level``: the level its JSON lines start at."""
    parser.add_argument("--log-level", default="INFO", choices=LEVELS, help="least severe level logged")
