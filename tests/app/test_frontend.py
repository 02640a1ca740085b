"""The frontend between HTTP and the round service: incremental detokenization (exactly the full
decode at the end, multi-byte UTF-8 included), stop strings across deltas, tokenization off the
event loop, HTTP 400 naming the field."""

import asyncio
import random
import threading

import pytest
from transformers import AutoTokenizer

from moa_serve.app import state
from moa_serve.app.frontend import INLINE_ENCODE_CHARS, Frontend, IncrementalDetokenizer, InputError, Speculation
from moa_serve.engine.events import TokenEvent
from moa_serve.engine.round_stats import ServiceStats
from moa_serve.sampling import GREEDY
from tests.conftest import SMOLLM, STORIES

TRICKY = [
    "Ça va? L'élève naïve mange une crème brûlée à la façade.",
    "Emoji: 👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵 and 🤖!",
    "日本語のテキストと中文混合, 한국어도.",
    "Math: ∑ xᵢ² ≤ ∞ — “quotes” … «guillemets»",
    "  leading spaces\n\n\ttabs and\r\nnewlines  ",
    "a literal replacement char \ufffd in the middle",
]


@pytest.fixture(scope="module")
def smollm_tok():
    return AutoTokenizer.from_pretrained(str(SMOLLM))


@pytest.fixture(scope="module")
def stories_tok():
    return AutoTokenizer.from_pretrained(str(STORIES))


def incremental(tok, ids, steps) -> tuple[str, list[str]]:
    d, pieces, i = IncrementalDetokenizer(tok), [], 0
    for n in steps:
        pieces.append(d.add(ids[i : i + n]))
        i += n
    pieces.append(d.add(ids[i:]))
    pieces.append(d.finish())
    return "".join(pieces), pieces


@pytest.mark.parametrize("text", TRICKY)
def test_incremental_text_is_the_full_decode(smollm_tok, text):
    rng = random.Random(0)
    ids = smollm_tok.encode(text)
    ids = ids[:3] + [smollm_tok.convert_tokens_to_ids("<|im_end|>")] + ids[3:]  # a special token inside
    full = smollm_tok.decode(ids, skip_special_tokens=True)
    for steps in ([1] * len(ids), [2] * len(ids), [rng.randint(1, 5) for _ in ids]):
        out, pieces = incremental(smollm_tok, ids, steps)
        assert out == full
        if "\ufffd" not in full:  # a split multi-byte character is never streamed half
            assert not any("\ufffd" in p for p in pieces)


def test_random_ids_and_sentencepiece_leading_space(smollm_tok, stories_tok):
    rng = random.Random(1)
    for _ in range(20):  # arbitrary byte tokens: invalid UTF-8 in places
        ids = [rng.randrange(smollm_tok.vocab_size) for _ in range(rng.randint(1, 40))]
        assert incremental(smollm_tok, ids, [1] * len(ids))[0] == smollm_tok.decode(ids, skip_special_tokens=True)
    for text in ("Once upon a time, Lily saw a big dog.", " leading", "héllo wörld"):
        ids = stories_tok.encode(text, add_special_tokens=False)
        assert incremental(stories_tok, ids, [1] * len(ids))[0] == stories_tok.decode(ids, skip_special_tokens=True)


def test_each_step_decodes_a_small_window(smollm_tok):
    ids = smollm_tok.encode(" ".join(TRICKY) * 8)
    seen = []

    class Spy:
        def decode(self, ids, **kw):
            seen.append(len(ids))
            return smollm_tok.decode(ids, **kw)

    d = IncrementalDetokenizer(Spy())
    for t in ids:
        d.add([t])
    assert len(ids) > 300 and max(seen) <= 8


# ---------------------------------------------------------------------- Generation over a stub service
class StubService:
    """Streams scripted token events; records aborts."""

    queue_depth = active_sessions = 0

    def __init__(self, events):
        self.events, self.aborted, self.submitted = events, [], []
        self.stats = ServiceStats()

    def submit(self, session):
        self.submitted.append(session)
        return session

    async def stream(self, tracked):
        for ev in self.events:
            await asyncio.sleep(0)
            yield ev

    def abort(self, tracked):
        self.aborted.append(tracked.id)


def frontend(tok, events, max_model_len=2048):
    return Frontend(
        StubService(events),
        tok,
        max_model_len=max_model_len,
        stop_token_ids=frozenset(),
        speculation=Speculation(enabled=True, num_speculative_tokens=3),
        model_name="m",
    )


def events_for(ids, sizes, finish="length"):
    evs, i = [], 0
    for n in sizes:
        evs.append(TokenEvent(ids[i : i + n]))
        i += n
    evs.append(TokenEvent(ids[i:], finish))
    return evs


async def run_generation(fe, stops, prompt="hi"):
    gen = await fe.start(
        prompt=prompt,
        messages=None,
        max_tokens=64,
        sampling=GREEDY,
        stops=stops,
        ignore_eos=False,
        num_speculative_tokens=None,
    )
    deltas = [d async for d in gen.deltas()]
    return gen, deltas


def test_generation_streams_the_full_decode(smollm_tok):
    ids = smollm_tok.encode(TRICKY[1] + " " + TRICKY[0])
    fe = frontend(smollm_tok, events_for(ids, [1, 3, 2, 1, 4] * 5))
    gen, deltas = asyncio.run(run_generation(fe, stops=[]))
    assert gen.text == "".join(d.text for d in deltas) == smollm_tok.decode(ids, skip_special_tokens=True)
    assert [t for d in deltas for t in d.token_ids] == ids and gen.finish_reason == "length"


@pytest.mark.parametrize("stop", ["naïve", "👨", "crème brûlée à", "not there"])
def test_stop_strings_across_deltas(smollm_tok, stop):
    ids = smollm_tok.encode(TRICKY[1] + " " + TRICKY[0])
    full = smollm_tok.decode(ids, skip_special_tokens=True)
    fe = frontend(smollm_tok, events_for(ids, [1] * len(ids)))
    gen, deltas = asyncio.run(run_generation(fe, stops=["zzz", stop]))
    if stop in full:
        assert gen.text == full[: full.index(stop)] and gen.finish_reason == "stop"
        assert fe.service.aborted  # the session's caches are freed at once
    else:
        assert gen.text == full and gen.finish_reason == "length"
    assert "".join(d.text for d in deltas) == gen.text


def test_an_error_event_raises(smollm_tok):
    fe = frontend(smollm_tok, [TokenEvent([42]), TokenEvent([], "error: RuntimeError: boom")])
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(run_generation(fe, stops=[]))


def test_start_tokenizes_short_prompts_inline_long_ones_off_the_event_loop_and_names_bad_fields(smollm_tok):
    fe = frontend(smollm_tok, [], max_model_len=8 * INLINE_ENCODE_CHARS)
    threads = []
    encode = fe.encode_prompt
    fe.encode_prompt = lambda p, m: (threads.append(threading.current_thread()), encode(p, m))[1]
    start = dict(messages=None, max_tokens=4, sampling=GREEDY, stops=[], ignore_eos=False, num_speculative_tokens=None)

    async def main():
        loop_thread = threading.current_thread()
        gen = await fe.start(prompt="hi", **start)
        assert threads[-1] is loop_thread and gen.prompt_tokens >= 1
        await fe.start(prompt="word " * (INLINE_ENCODE_CHARS // 5 + 1), **start)
        assert threads[-1] is not loop_thread
        with fe._encode_lock:  # the tokenizer busy on a worker thread: a short prompt waits there, not here
            task = asyncio.ensure_future(fe.start(prompt="hi", **start))
            await asyncio.sleep(0.05)
        await task
        assert threads[-1] is not loop_thread
        fe.max_model_len = 8
        for kw, param in (({"prompt": ""}, "prompt"), ({"prompt": "word " * 50}, "prompt")):
            with pytest.raises(InputError) as err:
                await fe.start(**{**start, **kw})
            assert err.value.param == param

    asyncio.run(main())


def test_http_routes_await_start_and_answer_400_with_the_field(smollm_tok):
    from fastapi.testclient import TestClient

    from moa_serve.app.http import create_app

    ids = smollm_tok.encode(TRICKY[0])
    fe = frontend(smollm_tok, events_for(ids, [2] * (len(ids) // 2)), max_model_len=16)
    state.install(frontend=fe, ready=None, stats=lambda: {"replicas": {"verifier": {"a": 1}}})
    try:
        client = TestClient(create_app())
        r = client.post("/v1/completions", json={"prompt": "word " * 40, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 40}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = client.post("/v1/generate", json={"prompt": "hi", "max_tokens": 32})
        assert r.status_code == 200 and r.json()["text"] == smollm_tok.decode(ids, skip_special_tokens=True)
        r = client.get("/v1/stats")
        assert r.json()["replicas"] == {"verifier": {"a": 1}} and "mean_round_ms" in r.json()
    finally:
        state.install(frontend=None, stats=None)
