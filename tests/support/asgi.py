"""The ASGI scope of one HTTP request, for tests that drive the application's ASGI callable
directly (a client that disconnects, stalls or streams its body in pieces)."""

from __future__ import annotations


def http_scope(
    path: str, headers: list[tuple[bytes, bytes]], client: str = "127.0.0.1", asgi: dict | None = None
) -> dict:
    """A POST of ``path`` from ``client`` to 127.0.0.1:8000 over HTTP/1.1."""
    return {
        "type": "http",
        "asgi": asgi or {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": (client, 1),
        "server": ("127.0.0.1", 8000),
    }
