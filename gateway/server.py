"""The server process's settings, shared by `lockgate serve` in one process (`gateway.cli`) and by each of
`--workers N` processes (`gateway.workers`): uvicorn's configuration and logging off the event loop."""

from __future__ import annotations

import logging
import logging.handlers
import math
import queue
from collections.abc import Callable
from typing import Any

import uvicorn

from gateway.config import Config


def uvicorn_config(config: Config, app: Callable[..., Any] | str, **options: Any) -> uvicorn.Config:
    """uvicorn's settings for serving `app` (an ASGI app, or with `factory=True` its import path) as
    `config` says; `options` adds to them.

    No access log: the request log (`lockgate.requests`) already writes one line per request, off the event
    loop, and says more; uvicorn's would be a second, formatted and written to stdout on the loop itself.
    """
    return uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        log_level=config.server.log_level,
        access_log=False,
        lifespan="on",
        # SIGTERM: stop accepting, let in-flight requests run this long, then cancel them (the lifespan
        # shutdown then aborts what is left in the engine and stops it).
        timeout_graceful_shutdown=math.ceil(config.server.drain_timeout),
        **options,
    )


def log_off_the_loop(level: str) -> logging.handlers.QueueListener:
    """Root logging at `level`: records are queued where they are logged (the event loop) and formatted
    and written to stderr by a thread of their own, so a slow stderr never blocks the loop."""
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    stderr = logging.StreamHandler()
    stderr.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s"))
    listener = logging.handlers.QueueListener(records, stderr)
    root = logging.getLogger()
    root.handlers[:] = [HandOffHandler(records)]
    root.setLevel(level)
    listener.start()
    return listener


class HandOffHandler(logging.handlers.QueueHandler):
    """Queues records for the listener's thread. A record whose message is already a plain string (no
    arguments, no exception: the request log's lines) is queued as it is; `QueueHandler.prepare` would
    format it and copy it first, on the event loop, to make it what it already is."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """The record to queue: `record` itself when nothing in it needs formatting on this thread."""
        if (
            isinstance(record.msg, str)
            and not record.args
            and record.exc_info is None
            and not record.stack_info
        ):
            return record
        prepared: logging.LogRecord = super().prepare(record)
        return prepared
