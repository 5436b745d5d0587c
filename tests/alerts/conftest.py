"""Fixtures of the alerts tests: a real webhook receiver and a URL where nothing listens."""

from __future__ import annotations

import socket

import pytest

from tests.support.webhooks import SECRET, WebhookServer


@pytest.fixture
def webhook_server():
    server = WebhookServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook/{SECRET}"
