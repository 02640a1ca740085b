"""One round loop: the in-process engine (``moa generate``, ``moa bench``), client-server sessions
and the cluster's Router all run their rounds in ``RoundLoop.run``, and their greedy output is
the target's own, computed here without it (one verify call per token, straight on the runner)."""

import asyncio

import pytest

from moa_serve.client import DeviceDrafter, LinkPolicy, RemoteGenerator, Transport
from moa_serve.deployments.config import AppConfig
from moa_serve.deployments.pools import PoolReply
from moa_serve.deployments.router import Router
from moa_serve.engine import round_loop
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.engine.round_service import RoundService
from moa_serve.engine.session import Session
from moa_serve.model_files import load_tokenizer
from moa_serve.protocol import VerifyRequest
from moa_serve.verifier.torch.runner import TorchTargetRunner
from tests.support.cs_harness import http_client, serving

PROMPTS = ["Once upon a time", "The little dog", "Lily went to the park and"]


@pytest.fixture
def rounds_run(monkeypatch):
    """The session ids of every round ``RoundLoop.run`` ran, in any thread."""
    calls: list[list[str]] = []
    run = round_loop.RoundLoop.run

    async def counted(self, g, batch, active):
        calls.append([t.session.id for t in batch])
        return await run(self, g, batch, active)

    monkeypatch.setattr(round_loop.RoundLoop, "run", counted)
    return calls


def plain_decoding(runner, prompt: list[int], n: int) -> list[int]:
    """Greedy target decoding, one verify call per token, no round loop."""
    tokens, out, base = list(prompt), [], 0
    while len(out) < n:
        (r,) = runner.verify([VerifyRequest("plain", tokens[base:], base=base, want_features=False)])
        tokens += r.tokens
        out += r.tokens
        base = len(tokens)
    runner.release("plain")
    return out[:n]


def test_moa_generate_runs_its_rounds_in_the_round_loop(stories_path, stories_drafter, rounds_run):
    engine = SpeculativeEngine.load(str(stories_path), str(stories_drafter), "float32", max_sessions=4)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    results = engine.generate(prompts, 24, ignore_eos=True)
    assert rounds_run and max(len(ids) for ids in rounds_run) == len(PROMPTS)  # the sessions share rounds
    for prompt, res in zip(prompts, results):
        assert res.token_ids == plain_decoding(engine.verifier, prompt, 24)
    assert sum(r.drafted_tokens for r in results) > 0


def test_client_server_rounds_run_in_the_round_loop(stories_path, stories_drafter, rounds_run):
    device = DeviceDrafter.load(str(stories_drafter), str(stories_path), "float32", 512)
    ids = device.tokenizer.encode(PROMPTS[0])
    with serving(stories_path, stories_drafter) as (srv, uv):
        gen = RemoteGenerator(
            device, Transport(http=http_client(uv.url), backoff_s=0.0), link=LinkPolicy(reconnect_backoff_s=0.0)
        )
        res = gen.generate(ids, 24, ignore_eos=True)
        ref = plain_decoding(srv.runner, ids, 24)
    assert res.token_ids == ref
    assert len(rounds_run) >= res.rounds > 0  # each of the remote session's rounds is a round of the loop


class _Handle:
    """A deployment handle over an in-process runner: ``handle.verify.remote(...)`` and the like."""

    def __init__(self, runner: TorchTargetRunner):
        self.runner = runner
        self.verify = self._method(lambda reqs: runner.verify(reqs))
        self.release = self._method(lambda ids: [runner.release(i) for i in ids])

    @staticmethod
    def _method(fn):
        class Method:
            @staticmethod
            def remote(arg, group=None):
                async def call():
                    return PoolReply(fn(arg), "local", 0.0, 0.0)

                return call()

        return Method


def test_the_router_runs_its_rounds_in_the_round_loop(stories_path, rounds_run):
    """A Router replica (its Ray Serve class, called directly) over a verifier handle stub."""
    cfg = {
        "target": str(stories_path),
        "drafter": "lookup",
        "dtype": "float32",
        "router": {"max_sessions_per_round": 8, "session_groups": 1},
        "verifier_pool": {"max_sessions": 16, "autoscaling_config": {"max_replicas": 1}},
    }
    runner = TorchTargetRunner(str(stories_path), "float32", "cpu", max_sessions=8, max_model_len=512)
    router = Router.func_or_class(AppConfig.model_validate(cfg), _Handle(runner))
    assert isinstance(router.service, RoundService)
    tokenizer = load_tokenizer(stories_path)
    prompts = [tokenizer.encode(p) for p in PROMPTS]

    async def generate():
        out = []
        for i, prompt in enumerate(prompts):
            tracked = router.service.submit(Session(f"r{i}", prompt, 24, max_model_len=512))
            out.append([tok async for ev in router.service.stream(tracked) for tok in ev.tokens])
        await router.service.stop()
        return out

    outputs = asyncio.run(generate())
    assert rounds_run
    assert outputs == [plain_decoding(runner, p, 24) for p in prompts]
