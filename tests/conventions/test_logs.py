"""The processes' log set-up keeps the storage clients' request lines (full URLs, which may be
presigned: a signature in the query is a credential while it lasts) out of the logs."""

from __future__ import annotations

import json
import logging

from conventions import logs


def test_storage_clients_log_warnings_only_whatever_the_process_level(capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level, {n: logging.getLogger(n).level for n in logs.QUIET_LOGGERS}
    try:
        logs.configure("DEBUG")
        logging.getLogger("httpx2").info("HTTP Request: GET https://cdn.example/x?X-Amz-Signature=abc")
        logging.getLogger("botocore").warning("retrying")
        logging.getLogger("lorafleet.adapters").info("adapter downloaded")
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        assert [(e["logger"], e["msg"]) for e in lines] == [("botocore", "retrying"),
                                                            ("lorafleet.adapters", "adapter downloaded")]
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        for name, level in saved[2].items():
            logging.getLogger(name).setLevel(level)
