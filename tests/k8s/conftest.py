"""The overlays built once per test module (``k8s/kustomize_lite.py``)."""

from __future__ import annotations

import pytest

from tests.support.k8s_manifests import KUSTOMIZATIONS, kl


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict]]:
    return {name: kl.build(path) for name, path in KUSTOMIZATIONS.items()}
