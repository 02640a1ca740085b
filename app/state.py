"""Process-wide handles the HTTP routes use (set once by the ingress replica at start).

Ray Serve copies the FastAPI app into the replica, so the routes cannot rely on ``app.state``
of the object they were declared on; they look the running objects up here instead."""

from __future__ import annotations

_STATE: dict = {}


def install(**values) -> None:
    _STATE.update(values)


def get(name: str, default=None):
    return _STATE.get(name, default)
