"""``StepLoop``: one thread drives a step-wise engine (``VllmEngine``) for requests that arrive
from any thread, and hands each step's new tokens to the request's sink.

vLLM's in-process ``LLMEngine`` is not thread-safe, so only this thread touches it: requests and
aborts are queued as commands and applied between two steps. The thread steps while any request
runs and sleeps otherwise. A step that raises errors the requests in flight (each sink gets an
``error: ...`` finish) and the loop goes on with the next requests: a serving replica never dies
with its engine's first exception.

Framework-free: the Ray Serve deployment (``deployments/vllm_pool.py``) wraps it, tests drive it
with a stub engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from moa_serve.protocol import Update
from moa_serve.sampling import GREEDY, SamplingParams

log = logging.getLogger(__name__)


Sink = Callable[[Update], None]


class StepEngine(Protocol):
    def add(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        ignore_eos: bool,
        request_id: str | None = None,
    ) -> str: ...
    def step(self) -> list[tuple[str, list[int], str | None]]: ...
    def abort(self, request_ids: list[str]) -> None: ...
    def has_unfinished(self) -> bool: ...
    def request_counts(self, request_id: str) -> tuple[int, int]: ...


@dataclass
class LoopStats:
    steps: int = 0
    step_s: float = 0.0  # seconds inside engine steps
    submitted: int = 0
    finished: int = 0
    aborted: int = 0
    rejected: int = 0  # requests the engine refused (e.g. a prompt too long)
    step_failures: int = 0
    max_running: int = 0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["step_s"] = round(self.step_s, 4)
        d["mean_step_ms"] = round(1e3 * self.step_s / self.steps, 3) if self.steps else 0.0
        return d


class StepLoop:
    def __init__(self, engine: StepEngine, name: str = "engine-steps"):
        self.engine = engine
        self.stats = LoopStats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> "StepLoop":
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def submit(
        self,
        request_id: str,
        prompt: list[int],
        max_new_tokens: int,
        sink: Sink,
        sampling: SamplingParams = GREEDY,
        ignore_eos: bool = False,
    ) -> None:
        """Queues a request; its updates go to ``sink`` (called on the loop thread: keep it short)."""
        if self._stopping.is_set():
            raise RuntimeError("the engine loop is stopped")
        self._commands.put(("add", request_id, (list(prompt), max_new_tokens, sampling, ignore_eos), sink))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stops a request (unknown or finished ones: nothing happens); its sink gets ``abort``."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    @property
    def running(self) -> int:
        return len(self._sinks)

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._apply_commands()
            if not self._sinks and not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            self._step()
        for rid, sink in list(self._sinks.items()):  # stopped with requests in flight
            sink(Update([], "abort"))
        self._sinks.clear()

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, args, sink = cmd
                try:
                    self.engine.add(*args, request_id=rid)
                except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                    self.stats.rejected += 1
                    sink(Update([], f"error: {type(exc).__name__}: {exc}"))
                    continue
                self.stats.submitted += 1
                self._sinks[rid] = sink
                self.stats.max_running = max(self.stats.max_running, len(self._sinks))
            else:
                sink = self._sinks.pop(cmd[1], None)
                if sink is not None:
                    self.engine.abort([cmd[1]])
                    self.stats.aborted += 1
                    sink(Update([], "abort"))

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            moved = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
            self.stats.step_failures += 1
            log.exception("engine step failed: %d requests in flight fail", len(self._sinks))
            failed, self._sinks = self._sinks, {}
            try:
                self.engine.abort(list(failed))
            except Exception:  # noqa: BLE001
                log.exception("aborting the failed step's requests failed too")
            for sink in failed.values():
                sink(Update([], f"error: {type(exc).__name__}: {exc}"))
            return
        self.stats.steps += 1
        self.stats.step_s += time.perf_counter() - t0
        for rid, tokens, reason in moved:
            sink = self._sinks.get(rid)
            if sink is None:  # aborted meanwhile
                continue
            drafted, accepted = self.engine.request_counts(rid)
            if reason is not None:
                del self._sinks[rid]
                self.stats.finished += 1
            sink(Update(list(tokens), reason, drafted, accepted))
