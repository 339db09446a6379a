"""The process's logging belongs to `lockgate serve` (server.log_level), not to Litestar: at WARNING the
per-request log line is not even built, and records are written by a thread of their own."""

from __future__ import annotations

import logging
import queue

import httpx

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from gateway.server import HandOffHandler, log_off_the_loop, uvicorn_config
from tests.conftest import MODEL, OutcomeLog, Tenancy, make_config, serving


async def test_a_warning_log_level_holds_through_the_apps_start_and_silences_the_request_log(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    root = logging.getLogger()
    saved = (root.level, root.handlers[:])
    listener = log_off_the_loop("WARNING")
    try:
        assert [type(h) for h in root.handlers] == [HandOffHandler]
        app = create_app(
            make_config(), engine=sim_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes
        )
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        async with (
            serving(app) as url,
            httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers) as http,
        ):
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
            # Litestar's start did not lower the level (its default would set the root logger to INFO).
            assert root.level == logging.WARNING
            assert not logging.getLogger("lockgate.requests").isEnabledFor(logging.INFO)
            assert logging.getLogger("lockgate.requests").isEnabledFor(logging.WARNING)
    finally:
        listener.stop()
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]


def test_uvicorn_writes_no_access_log_beside_the_request_log() -> None:
    access = logging.getLogger("uvicorn.access")
    saved = (access.level, access.handlers[:], access.propagate)
    try:
        settings = uvicorn_config(make_config(), "gateway.workers:app", factory=True)
        assert settings.access_log is False
        # uvicorn logs a request only where its access logger has a handler; it has none left.
        assert not access.hasHandlers()
        assert settings.timeout_graceful_shutdown is not None
    finally:
        access.setLevel(saved[0])
        access.handlers[:] = saved[1]
        access.propagate = saved[2]


def test_the_hand_off_queues_plain_records_as_they_are_and_formats_the_others_where_logged() -> None:
    queued: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    handler = HandOffHandler(queued)
    logger = logging.getLogger("tests.hand_off")
    logger.propagate = False
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    try:
        logger.info('{"request_id": "r1"}')
        plain = queued.get_nowait()
        assert plain.getMessage() == '{"request_id": "r1"}'
        assert plain.args == ()  # as logged: `QueueHandler.prepare` would have set None on a formatted copy
        # Arguments are formatted now, on the caller's thread: a later change to them is not what is written.
        items = ["first"]
        logger.warning("items: %s", items)
        items.append("second")
        formatted = queued.get_nowait()
        assert formatted.getMessage() == "items: ['first']"
        assert formatted.args is None
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
        failed = queued.get_nowait()
        assert "ValueError: boom" in failed.getMessage()
        assert failed.exc_info is None
    finally:
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
