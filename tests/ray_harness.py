"""Helpers for the tests that run a real Ray Serve cluster."""

from __future__ import annotations

import ray


def kill_replica(deployment: str) -> None:
    """Kills one replica of the ``moa`` application's ``deployment`` (no restart by Ray itself:
    Serve replaces it)."""
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"moa#{deployment}#" in a["name"]]
    assert names, ray.util.list_named_actors(all_namespaces=True)
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
