"""Locust load test for MoA-Serve — and for any OpenAI-compatible server (e.g. ``vllm serve``).

Run directly::

    locust -f loadtest/locustfile.py --headless -u 4 -r 4 -t 60s --host http://127.0.0.1:8000 ChatStreamUser

or through the runner (``moa loadtest``), which also collects the custom metrics.

User classes (closed loop: each user sends its next request as soon as the last one ends):

============================  =========================================================
``GenerateUser``              ``POST /v1/generate`` (MoA-Serve only), whole response
``GenerateStreamUser``        ``POST /v1/generate`` with ``"stream": true`` (SSE)
``ChatUser``                  ``POST /v1/chat/completions`` (OpenAI), whole response
``ChatStreamUser``            ``POST /v1/chat/completions`` streaming, with
                              ``stream_options.include_usage`` for exact token counts
``CompletionsStreamUser``     ``POST /v1/completions`` streaming (OpenAI)
============================  =========================================================

The OpenAI classes send nothing beyond the OpenAI API, so the same test measures a peer
server; our extras (``speculative`` next to ``usage``) are read when present and reported as
null otherwise.

Per request, besides Locust's own stats, the file records (JSON lines, to the file named by
``--metrics-file`` / ``$MOA_LOADTEST_METRICS``): time to first token, end-to-end latency,
mean inter-token latency (``(latency - ttft) / (tokens - 1)``), output tokens, output
tokens/s and the speculative decoding statistics (accepted length) of the response.

Prompts: Spec-Bench (``../shared/data/specbench/question.jsonl`` beside the repository) by
default; ``--prompts FILE`` takes any JSONL whose lines have ``turns`` (first turn used),
``prompt``, ``messages``, ``question``, ``instruction`` or ``text``. ``--categories`` keeps only
the named Spec-Bench categories.
"""

from __future__ import annotations

import json
import random
import threading
import time

import requests
from locust import User, constant, events, task

from moa_serve.app.auth import client_headers
from moa_serve.loadtest.prompts import DEFAULT_PROMPTS, load_prompts, messages_to_prompt

# Also accepted from the environment (configargparse), so the runner and CI can set them.
_OPTIONS = [
    # name, env var, default, type, help
    ("--prompts", "MOA_LOADTEST_PROMPTS", "", str, "JSONL prompt file (default: Spec-Bench questions)"),
    ("--categories", "MOA_LOADTEST_CATEGORIES", "", str, "comma-separated categories to keep (Spec-Bench 'category')"),
    ("--max-tokens", "MOA_LOADTEST_MAX_TOKENS", 128, int, "max_tokens of each request"),
    ("--temperature", "MOA_LOADTEST_TEMPERATURE", 0.0, float, "sampling temperature (0 = greedy)"),
    (
        "--ignore-eos",
        "MOA_LOADTEST_IGNORE_EOS",
        "false",
        str,
        "true: ask for exactly max_tokens tokens (our 'ignore_eos'; vLLM accepts it too)",
    ),
    ("--model", "MOA_LOADTEST_MODEL", "", str, "model name for OpenAI routes (default: first id of GET /v1/models)"),
    (
        "--num-speculative-tokens",
        "MOA_LOADTEST_NUM_SPECULATIVE_TOKENS",
        0,
        int,
        "per-request num_speculative_tokens for /v1/generate (0 = server default)",
    ),
    ("--metrics-file", "MOA_LOADTEST_METRICS", "", str, "append per-request metrics here as JSON lines"),
    ("--request-timeout", "MOA_LOADTEST_REQUEST_TIMEOUT", 300.0, float, "seconds before a request counts as failed"),
    ("--prompt-seed", "MOA_LOADTEST_SEED", 0, int, "seed of the prompt choice"),
]


@events.init_command_line_parser.add_listener
def _add_options(parser):
    for name, env, default, typ, help_ in _OPTIONS:
        parser.add_argument(name, type=typ, default=default, env_var=env, help=help_, include_in_web_ui=False)


def _truthy(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------------------
# prompts


class _State:
    prompts: list[dict] = []
    model: str | None = None
    metrics_fh = None
    lock = threading.Lock()
    rng = random.Random(0)


@events.init.add_listener
def _on_init(environment, **_kw):
    opts = environment.parsed_options
    if opts is None:  # library use without a command line
        return
    path = opts.prompts or str(DEFAULT_PROMPTS)
    cats = {c.strip() for c in opts.categories.split(",") if c.strip()} or None
    _State.prompts = load_prompts(path, cats)
    _State.rng = random.Random(opts.prompt_seed)
    if opts.metrics_file:
        _State.metrics_fh = open(opts.metrics_file, "a", encoding="utf-8")


def _write_metrics(rec: dict) -> None:
    fh = _State.metrics_fh
    if fh is None:
        return
    with _State.lock:
        fh.write(json.dumps(rec) + "\n")
        fh.flush()


@events.test_start.add_listener
def _on_test_start(environment, **_kw):
    _write_metrics({"event": "test_start", "t": time.time()})


@events.test_stop.add_listener
def _on_test_stop(environment, **_kw):
    _write_metrics({"event": "test_stop", "t": time.time()})


@events.request.add_listener
def _on_request(request_type, name, response_time, response_length, exception=None, context=None, **_kw):
    """Every request of our user classes carries its custom metrics in ``context``."""
    if not context or "moa" not in context:
        return
    rec = dict(context["moa"])
    rec.update(
        event="request", name=name, ok=exception is None, error=None if exception is None else str(exception)[:300]
    )
    _write_metrics(rec)


# ---------------------------------------------------------------------------------------
# users


class RequestFailed(Exception):
    pass


def _speculative_stats(obj: dict | None) -> dict:
    spec = (obj or {}).get("speculative") if isinstance(obj, dict) else None
    if not isinstance(spec, dict):
        return {"accepted_length": None, "rounds": None}
    return {"accepted_length": spec.get("mean_accepted_length"), "rounds": spec.get("rounds")}


def _error_text(resp: requests.Response) -> str:
    try:
        body = resp.json()
        msg = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body
    except Exception:
        msg = resp.text[:200]
    return f"HTTP {resp.status_code}: {msg}"


class _LLMUser(User):
    """A closed-loop user; subclasses say which route and how to read the answer."""

    abstract = True
    wait_time = constant(0)
    route = ""
    stream = False
    openai = True

    def on_start(self):
        self.session = requests.Session()
        self.session.headers["Content-Type"] = "application/json"
        self.session.headers.update(client_headers())  # $MOA_API_KEY for a server with keys (docs/security.md)
        self.opts = self.environment.parsed_options
        if self.openai and _State.model is None:
            _State.model = self.opts.model or self._discover_model()

    def on_stop(self):
        self.session.close()

    def _discover_model(self) -> str:
        try:
            r = self.session.get(self.host.rstrip("/") + "/v1/models", timeout=30)
            r.raise_for_status()
            return r.json()["data"][0]["id"]
        except Exception as exc:  # the request itself will then fail visibly
            return f"<unknown model: {exc}>"

    # -- request body -------------------------------------------------------------------
    def body(self, messages: list[dict]) -> dict:
        o = self.opts
        b: dict = {"max_tokens": o.max_tokens, "temperature": o.temperature}
        if _truthy(o.ignore_eos):
            b["ignore_eos"] = True
        if self.stream:
            b["stream"] = True
        return b

    # -- the task -----------------------------------------------------------------------
    @task
    def request(self):
        self._one_request()

    def _one_request(self):
        prompt = _State.rng.choice(_State.prompts)
        body = self.body(prompt["messages"])
        name = f"{self.route}{' [stream]' if self.stream else ''}"
        metrics = {
            "t_start": time.time(),
            "category": prompt["category"],
            "stream": self.stream,
            "ttft_ms": None,
            "latency_ms": None,
            "itl_ms": None,
            "output_tokens": 0,
            "tokens_per_s": None,
            "accepted_length": None,
            "rounds": None,
        }
        t0 = time.perf_counter()
        exc: Exception | None = None
        length = 0
        try:
            with self.session.post(
                self.host.rstrip("/") + self.route, json=body, stream=self.stream, timeout=self.opts.request_timeout
            ) as resp:
                if resp.status_code != 200:
                    raise RequestFailed(_error_text(resp))
                if self.stream:
                    length = self._read_stream(resp, t0, metrics)
                else:
                    data = resp.json()
                    length = len(resp.content)
                    self._read_whole(data, metrics)
        except Exception as e:  # noqa: BLE001 — every error is a failed request
            exc = e
        elapsed = time.perf_counter() - t0
        metrics["latency_ms"] = elapsed * 1000.0
        n = metrics["output_tokens"]
        if exc is None and n == 0:
            exc = RequestFailed("no output tokens")
        if exc is None:
            metrics["tokens_per_s"] = n / elapsed if elapsed > 0 else None
            if metrics["ttft_ms"] is not None and n > 1:
                metrics["itl_ms"] = (metrics.pop("_last_token_ms") - metrics["ttft_ms"]) / (n - 1)
        metrics.pop("_last_token_ms", None)
        self.environment.events.request.fire(
            request_type="POST",
            name=name,
            response_time=elapsed * 1000.0,
            response_length=length,
            exception=exc,
            context={"moa": metrics},
            response=None,
            url=self.route,
            start_time=metrics["t_start"],
        )

    def _read_whole(self, data: dict, metrics: dict) -> None:
        usage = data.get("usage") or {}
        n = usage.get("completion_tokens")
        metrics["output_tokens"] = int(n if n is not None else self._tokens_without_usage(data))
        metrics.update(_speculative_stats(data))

    def _tokens_without_usage(self, data: dict) -> int:
        """The output tokens of a whole response that reports no usage."""
        raise NotImplementedError

    def _events(self, resp: requests.Response):
        """Parsed JSON payloads of an SSE stream (stops at [DONE])."""
        for raw in resp.iter_lines(decode_unicode=False):
            if not raw or not raw.startswith(b"data:"):
                continue
            payload = raw[5:].strip()
            if payload == b"[DONE]":
                return
            obj = json.loads(payload)
            if isinstance(obj, dict) and "error" in obj:
                err = obj["error"]
                raise RequestFailed(f"stream error: {err.get('message') if isinstance(err, dict) else err}")
            yield obj

    def _read_stream(self, resp, t0: float, metrics: dict) -> int:
        """Reads a stream: when the first and the last token came, the output tokens (the usage's
        count where the server sends one, else those the events carried) and the speculative
        stats; returns the number of events."""
        tokens = 0
        usage_tokens = None
        n_events = 0
        for obj in self._events(resp):
            now_ms = (time.perf_counter() - t0) * 1000.0
            n_events += 1
            carried = self._event_tokens(obj)
            if carried:
                tokens += carried
                if metrics["ttft_ms"] is None:
                    metrics["ttft_ms"] = now_ms
                metrics["_last_token_ms"] = now_ms
            if self._closing_event(obj):
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                metrics.update(_speculative_stats(obj))
        metrics["output_tokens"] = int(usage_tokens) if usage_tokens is not None else tokens
        return n_events

    def _event_tokens(self, obj: dict) -> int:
        """The output tokens one stream event carries (0: none)."""
        raise NotImplementedError

    def _closing_event(self, obj: dict) -> bool:
        """Whether the event is the one with the usage and the speculative stats."""
        raise NotImplementedError


class _OpenAIUser(_LLMUser):
    abstract = True

    def body(self, messages):
        b = super().body(messages)
        b["model"] = _State.model
        if self.stream:
            b["stream_options"] = {"include_usage": True}
        return b

    def _delta_text(self, choice: dict) -> str:
        raise NotImplementedError

    def _tokens_without_usage(self, data):
        return 0

    def _event_tokens(self, obj):
        # without a usage chunk, one token per text chunk
        return sum(1 for choice in obj.get("choices") or [] if self._delta_text(choice))

    def _closing_event(self, obj):
        return bool(obj.get("usage"))


class ChatUser(_OpenAIUser):
    """``POST /v1/chat/completions``, whole response."""

    route = "/v1/chat/completions"

    def body(self, messages):
        b = super().body(messages)
        b["messages"] = messages
        return b

    def _delta_text(self, choice):
        return (choice.get("delta") or {}).get("content") or ""


class ChatStreamUser(ChatUser):
    """``POST /v1/chat/completions`` streaming (the default of ``moa loadtest``)."""

    stream = True


class CompletionsStreamUser(_OpenAIUser):
    """``POST /v1/completions`` streaming: the raw prompt, no chat template."""

    route = "/v1/completions"
    stream = True

    def body(self, messages):
        b = super().body(messages)
        b["prompt"] = messages_to_prompt(messages)
        return b

    def _delta_text(self, choice):
        return choice.get("text") or ""


class GenerateUser(_LLMUser):
    """``POST /v1/generate`` (MoA-Serve's native route), whole response."""

    route = "/v1/generate"
    openai = False

    def body(self, messages):
        b = super().body(messages)
        b["messages"] = messages
        if self.opts.num_speculative_tokens:
            b["num_speculative_tokens"] = self.opts.num_speculative_tokens
        return b

    def _tokens_without_usage(self, data):
        return len(data.get("token_ids") or [])

    def _event_tokens(self, obj):
        ids = obj.get("token_ids") or []
        return len(ids) if ids else int(bool(obj.get("text")))

    def _closing_event(self, obj):
        return obj.get("finish_reason") is not None or "usage" in obj


class GenerateStreamUser(GenerateUser):
    """``POST /v1/generate`` streaming (server-sent events)."""

    stream = True


USER_CLASSES = ["ChatStreamUser", "ChatUser", "CompletionsStreamUser", "GenerateStreamUser", "GenerateUser"]
