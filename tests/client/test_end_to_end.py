"""Client-server mode end to end over real HTTP (uvicorn on 127.0.0.1, no Ray): the device's
drafter (only the target parts it borrows), greedy output token-identical to plain target
decoding, lost responses retried without loss or duplication, a server restart resynced through
409, a cut link (``degrade``: offline tokens, then verified or corrected; ``strict``: an error),
the handshake refusing a drafter that is not the server's, and ``moa client generate``."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from moa_serve.cli import main
from moa_serve.client import DeviceDrafter, HandshakeError, LinkPolicy, OfflineError, RemoteGenerator, Transport
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.sampling import SamplingParams
from tests.support.cs_harness import FaultyTransport, OracleProposer, Server, ToySampler, http_client

PROMPTS = ["Once upon a time", "The little dog", "Lily went to the park and"]


def reference(plain, prompt, n):
    return plain.generate([prompt], n, ignore_eos=True)[0].token_ids


def oracle_device(device, prompt, ref, wrong=()):
    return DeviceDrafter(OracleProposer(prompt + ref, 512, set(wrong)), device.tokenizer, device.fingerprints, "oracle")


def generator(dev, url, transport=None, **kw):
    kw.setdefault("link", LinkPolicy(reconnect_backoff_s=0.0))
    t = Transport(http=http_client(url, transport), backoff_s=0.0)
    return RemoteGenerator(dev, t, **kw), t


def test_device_holds_only_the_borrowed_target_parts(server, device):
    srv, _ = server
    parts = device.proposer.parts
    names = {n for n, _ in parts.named_parameters()}
    assert len(parts.tli) == 0 and names <= {"embed_tokens.weight", "lm_head.weight", "norm.weight"}
    target = sum(p.numel() * p.element_size() for p in srv.runner.model.parameters())
    borrowed = sum(p.numel() * p.element_size() for p in parts.parameters())
    assert borrowed < target / 2 and device.weight_bytes() > borrowed


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_is_token_identical_to_plain_target_decoding(server, device, plain, prompt):
    srv, uv = server
    ids = device.tokenizer.encode(prompt)
    ref = reference(plain, ids, 48)
    gen, t = generator(device, uv.url)
    res = gen.generate(ids, 48, ignore_eos=True)
    assert res.token_ids == ref and res.verified_tokens == 48 and res.offline_tokens == 0
    assert res.server_calls == res.rounds and res.bytes_up > 0 and res.bytes_down > 0
    assert res.text == device.tokenizer.decode(ref, skip_special_tokens=True)
    # a drafter that is right except where told: accepted drafts, bonus tokens, rejections
    dev = oracle_device(device, ids, ref, wrong={len(ids) + 5, len(ids) + 6, len(ids) + 20})
    gen, t = generator(dev, uv.url, num_speculative_tokens=4, adaptive_k=False)
    res = gen.generate(ids, 48, ignore_eos=True)
    assert res.token_ids == ref and res.accepted_tokens > 30 and res.rounds < 20
    # the features: every draft call held those of all committed positions but the last
    assert all(held == length - 1 for held, length in dev.proposer.feature_log)


def test_tree_drafts_through_the_link_stay_token_identical(server, device, plain):
    """Greedy tree drafts: the device sends its runners-up beside its chain; accepted alternatives
    commit the target's own tokens (the output is plain decoding's) in fewer rounds."""
    srv, uv = server
    ids = device.tokenizer.encode(PROMPTS[2])
    ref = reference(plain, ids, 48)
    wrong = {len(ids) + 3, len(ids) + 9, len(ids) + 15, len(ids) + 22}
    rounds = {}
    for shape in ((), (3,)):
        dev = oracle_device(device, ids, ref, wrong=wrong)
        before = srv.runner.stats["alternatives_accepted"]
        gen, t = generator(dev, uv.url, num_speculative_tokens=4, adaptive_k=False, branching=shape)
        res = gen.generate(ids, 48, ignore_eos=True)
        assert res.token_ids == ref
        rounds[shape] = res.rounds
        # (a wrong position the target's own token of a round covers is never drafted)
        assert (srv.runner.stats["alternatives_accepted"] - before >= len(wrong) - 1) == bool(shape)
    assert rounds[(3,)] < rounds[()]
    # the trained drafter's own runners-up
    real = DeviceDrafter.load(device.name, None, "float32", 512)
    gen, t = generator(real, uv.url, branching="4-2")
    res = gen.generate(ids, 48, ignore_eos=True)
    assert res.token_ids == ref and res.verified_tokens == 48


def test_auto_branching_drafts_trees_only_over_slow_round_trips(server, device, plain, monkeypatch):
    """``branching="auto"``: chains while the measured round trip is short, the tree once it is long
    (here: the threshold moved around loopback's), token-identical either way; a device reused by
    a later run starts that run with chains again."""
    import moa_serve.client.generate as client
    from moa_serve.drafter.spec import TreeShape

    # a fixed shape: the untrained drafter rates every candidate far below the dynamic tree's bound
    monkeypatch.setattr(client, "AUTO_TREE", TreeShape((3, 2)))
    srv, uv = server
    ids = device.tokenizer.encode(PROMPTS[1])
    ref = reference(plain, ids, 32)
    real = DeviceDrafter.load(device.name, None, "float32", 512)
    trees = {}
    for threshold in (1e9, 0.0):  # never long enough / always long enough
        monkeypatch.setattr(client, "AUTO_MIN_ROUND_TRIP_S", threshold)
        gen, t = generator(real, uv.url, branching="auto")
        res = gen.generate(ids, 32, ignore_eos=True)
        assert res.token_ids == ref and res.verified_tokens == 32
        trees[threshold] = res.tree_rounds
        assert res.as_dict()["tree_rounds"] == res.tree_rounds
    assert trees[1e9] == 0 and trees[0.0] > 0
    assert real.proposer.branching == client.AUTO_TREE.widths  # left on by the last run...
    monkeypatch.setattr(client, "AUTO_MIN_ROUND_TRIP_S", 1e9)
    gen, t = generator(real, uv.url, branching="auto")
    run = gen.start(ids, 4, ignore_eos=True)
    assert real.proposer.branching == ()  # ... and off again when the next run starts
    for _ in run:
        pass


def test_int8_features_and_a_stop_token_end_the_session(server, device, plain):
    srv, uv = server
    ids = device.tokenizer.encode(PROMPTS[0])
    ref = reference(plain, ids, 60)
    stop = next(i for i in range(8, 60) if ref[i] not in ref[:i])  # a token first generated at i
    saved = srv.identity.stop_token_ids
    srv.identity.stop_token_ids = [ref[stop]]  # as if it were the model's end-of-sequence token
    try:
        gen, t = generator(device, uv.url, feature_codec="int8")
        res = gen.generate(ids, 60)
    finally:
        srv.identity.stop_token_ids = saved
    assert res.token_ids == ref[: stop + 1] and res.finish_reason == "stop"
    assert res.server_calls == res.rounds  # the server ended the session itself: no DELETE needed


def test_sampling_through_the_link_equals_the_in_process_engine(server, device, stories_path, stories_drafter):
    """Draft distributions travel as float32 tensors: with the same drafter and seed, the
    client-server run accepts and samples exactly as the in-process engine does."""
    srv, uv = server
    ids = device.tokenizer.encode(PROMPTS[1])
    sampling = SamplingParams(temperature=0.9, top_k=40, seed=7)
    hf = AutoModelForCausalLM.from_pretrained(str(stories_path)).eval()

    def guide(seq):  # the target's own next-token logits: a drafter that is often right
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0, -1].float()

    engine = SpeculativeEngine(srv.runner, ToySampler(512, guide), device.tokenizer, max_batch=1)
    want = engine.generate([ids], 40, sampling, num_speculative_tokens=3, ignore_eos=True)[0]
    dev = DeviceDrafter(ToySampler(512, guide), device.tokenizer, device.fingerprints, "toy")
    gen, t = generator(dev, uv.url, num_speculative_tokens=3, adaptive_k=False)
    res = gen.generate(ids, 40, sampling, ignore_eos=True)
    assert res.token_ids == want.token_ids and res.accepted_tokens == want.accepted_tokens > 0
    assert res.drafted_tokens == want.drafted_tokens > res.accepted_tokens  # some drafts rejected too


def test_a_lost_response_is_retried_without_loss_or_duplication(server, device, plain):
    srv, uv = server
    ids = device.tokenizer.encode(PROMPTS[2])
    ref = reference(plain, ids, 40)
    faulty = FaultyTransport(match="/v1/cs/sessions")
    faulty.drop_response_of = {1, 4, 9}  # the create and two verify rounds: the server ran them
    before = dict(srv.cs.stats)
    gen, t = generator(
        oracle_device(device, ids, ref, wrong={len(ids) + 8}),
        uv.url,
        faulty,
        num_speculative_tokens=3,
        adaptive_k=False,
    )
    res = gen.generate(ids, 40, ignore_eos=True)
    assert res.token_ids == ref and res.retries == 3 and res.server_calls == res.rounds + 3
    after = srv.cs.stats
    assert after["created"] - before["created"] == 1  # the retried create found its session
    assert after["replays"] - before["replays"] == 3  # answered again, not verified again
    assert after["rounds"] - before["rounds"] == res.rounds


def test_a_server_restart_mid_session_resyncs(server, device, plain, stories_path, stories_drafter):
    srv, uv = server
    ids = device.tokenizer.encode(PROMPTS[0])
    ref = reference(plain, ids, 40)
    restarted = Server(stories_path, stories_drafter)  # a new Router replica: it knows no session
    faulty = FaultyTransport()
    faulty.on_call = lambda n, req: restarted.install() if n == 6 else None
    try:
        gen, t = generator(device, uv.url, faulty)
        res = gen.generate(ids, 40, ignore_eos=True)
    finally:
        srv.install()
    assert res.token_ids == ref and res.resyncs == 1
    assert restarted.cs.stats["created"] == 1 and restarted.cs.stats["resyncs"] == 1
    # the new server prefilled everything the client had committed and sent only the features
    # the device lacked
    created = restarted.verify_calls[0][0]
    assert created.base == 0 and len(created.tokens) > len(ids) + 5
    assert restarted.cs.stats["rounds"] == res.rounds - 6  # create + 5 verify rounds before the restart


@pytest.mark.parametrize("wrong_offset", [None, 3])
def test_a_cut_link_keeps_writing_offline_then_verifies_or_corrects(server, device, plain, wrong_offset):
    srv, uv = server
    ids = device.tokenizer.encode(PROMPTS[1])
    ref = reference(plain, ids, 48)
    faulty = FaultyTransport()
    cut_at = 5

    def link(n, req):
        if n == cut_at:
            faulty.cut = True
        if faulty.cut and faulty.refused >= 3 + 2:  # the round's 3 attempts, then 2 failed probes
            faulty.cut = False

    faulty.on_call = link
    verified_at_cut = []
    # every round commits 4 right drafts + the bonus token: the link is cut with 1 + 4 x 5 verified
    at_cut = 21
    dev = oracle_device(device, ids, ref)
    if wrong_offset is not None:  # a wrong draft while offline only
        dev.proposer.wrong = {len(ids) + at_cut + wrong_offset}
    gen, t = generator(
        dev,
        uv.url,
        faulty,
        num_speculative_tokens=4,
        adaptive_k=False,
        link=LinkPolicy(reconnect_backoff_s=0.0, offline_chunk=4),
    )
    run = gen.start(ids, 48, ignore_eos=True)
    events = []
    for ev in run:
        if ev.kind == "offline" and not verified_at_cut:
            verified_at_cut.append(run.generated)
        events.append(ev)
    res = run.result()
    assert res.token_ids == ref and res.offline_tokens == 0 and res.disconnections == 1
    offline = [e for e in events if e.kind == "offline"]
    assert len(offline) == 3 and res.offline_generated == 12  # one chunk per failed probe, and one more
    assert offline[0].position == verified_at_cut[0] == at_cut and all(
        a.position + len(a.tokens) == b.position for a, b in zip(offline, offline[1:])
    )
    corrections = [e for e in events if e.kind == "correction"]
    if wrong_offset is None:  # the drafter wrote what the target would have: all verified
        assert not corrections and res.corrected_tokens == 0
    else:
        first_wrong = at_cut + wrong_offset
        assert len(corrections) == 1 and corrections[0].position == first_wrong
        assert corrections[0].tokens == ref[first_wrong : first_wrong + 1]
        assert res.corrected_tokens == offline[-1].position + len(offline[-1].tokens) - first_wrong
    # replaying the events gives the output
    out = []
    for e in events:
        if e.kind == "correction":
            del out[e.position :]
            out += e.tokens
        elif e.kind == "verified":
            out[e.position : e.position + len(e.tokens)] = e.tokens
        else:
            assert e.position == len(out)
            out += e.tokens
    assert out == ref


def test_a_link_that_never_comes_back(server, device, plain):
    srv, uv = server
    ids = device.tokenizer.encode(PROMPTS[2])
    ref = reference(plain, ids, 30)
    faulty = FaultyTransport()
    faulty.on_call = lambda n, req: setattr(faulty, "cut", True) if n == 4 else None
    gen, t = generator(
        oracle_device(device, ids, ref), uv.url, faulty, link=LinkPolicy(reconnect_backoff_s=0.0, final_reconnects=2)
    )
    res = gen.generate(ids, 30, ignore_eos=True)
    assert res.finish_reason == "offline" and res.offline_tokens > 0
    assert res.verified_tokens + res.offline_tokens == res.num_tokens == 30
    assert res.token_ids == ref  # this drafter was right: the unverified tail happens to be too
    strict = FaultyTransport()
    strict.on_call = lambda n, req: setattr(strict, "cut", True) if n == 4 else None
    gen, t = generator(
        oracle_device(device, ids, ref), uv.url, strict, link=LinkPolicy(reconnect_backoff_s=0.0, offline="strict")
    )
    with pytest.raises(OfflineError, match="unreachable"):
        gen.generate(ids, 30, ignore_eos=True)


class CountingProposer:
    """Counts the draft calls a proposer gets (and the tokens it drafts)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, reqs):
        self.calls += 1
        return self.inner.propose(reqs)


def test_a_hybrid_device_drafts_by_lookup_when_greedy_and_with_its_model_when_sampling(
    server, device, plain, stories_path, stories_drafter
):
    """``hybrid:<checkpoint>`` on the device: the server's own drafter (the same fingerprint: lookup
    changes the drafts, not the features); greedy, prompt lookup drafts online and offline, with the
    output still the target's; sampling, the trained drafter drafts alone (lookup drafts carry no
    distribution to send)."""
    from moa_serve.drafter.lookup import HybridProposer

    srv, uv = server
    hybrid = DeviceDrafter.load(f"hybrid:{stories_drafter}", str(stories_path), "float32", 512)
    assert hybrid.uses_lookup and isinstance(hybrid.proposer, HybridProposer)
    assert hybrid.fingerprints == device.fingerprints and hybrid.model is hybrid.proposer.model
    assert not device.uses_lookup and device.model is device.proposer
    ids = device.tokenizer.encode(PROMPTS[2])
    ref = reference(plain, ids, 64)
    gen, t = generator(hybrid, uv.url)
    res = gen.generate(ids, 64, ignore_eos=True)
    assert res.token_ids == ref and res.offline_tokens == 0
    assert hybrid.proposer.stats["lookup_drafts"] > 0  # the tiny model's stories repeat themselves

    # a link cut after 4 calls that never returns: the offline tail is drafted through the hybrid,
    # whose lookup copies the stories' repeats (the target repeats them too)
    hybrid.model = CountingProposer(hybrid.proposer.model)  # the model alone: not asked when greedy
    faulty = FaultyTransport()
    faulty.on_call = lambda n, req: setattr(faulty, "cut", True) if n == 4 else None
    gen, t = generator(hybrid, uv.url, faulty, link=LinkPolicy(reconnect_backoff_s=0.0, final_reconnects=2))
    res = gen.generate(ids, 64, ignore_eos=True)
    assert res.finish_reason == "offline" and res.offline_tokens > 0
    assert res.token_ids[: res.verified_tokens] == ref[: res.verified_tokens]
    assert hybrid.model.calls == 0

    # sampling: every draft call goes to the model, none to the lookup
    before = dict(hybrid.proposer.stats)
    gen, t = generator(hybrid, uv.url)
    res = gen.generate(ids, 24, SamplingParams(temperature=0.8, seed=3), ignore_eos=True)
    assert res.num_tokens == 24 and hybrid.model.calls > 0
    assert hybrid.proposer.stats == before


def test_the_handshake_refuses_a_drafter_that_is_not_the_servers(server, device, stories_path, tiny_model, tmp_path):
    from moa_serve.drafter.checkpoint import init_drafter

    srv, uv = server
    other = DeviceDrafter.load(str(init_drafter(str(stories_path), tmp_path / "d1", seed=1)), str(stories_path))
    with pytest.raises(HandshakeError, match="drafter"):
        generator(other, uv.url)[0].handshake()
    tiny = DeviceDrafter.load(str(init_drafter(str(tiny_model), tmp_path / "d2", seed=0)), str(tiny_model))
    with pytest.raises(HandshakeError, match="target"):
        generator(tiny, uv.url)[0].handshake()
    gen, _ = generator(other, uv.url)
    gen.identity = {**gen.transport.info(), "drafter": other.fingerprints["drafter"]}  # skip the local check
    with pytest.raises(HandshakeError, match="refused"):
        gen.generate(device.tokenizer.encode("Hi"), 4)


def test_cli_client_generate_json(capsys, server, device, plain, stories_path, stories_drafter, tmp_path):
    srv, uv = server
    argv = [
        "client",
        "generate",
        "--server",
        uv.url,
        "--target",
        str(stories_path),
        "--drafter",
        str(stories_drafter),
        "--dtype",
        "float32",
        "--prompt",
        PROMPTS[0],
        "--max-new-tokens",
        "24",
        "--ignore-eos",
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "text",
        "token_ids",
        "num_tokens",
        "verified_tokens",
        "offline_tokens",
        "server_calls",
        "bytes_up",
        "bytes_down",
        "mean_accepted_length",
        "tokens_per_s",
    ):
        assert key in out
    assert out["token_ids"] == reference(plain, device.tokenizer.encode(PROMPTS[0]), 24)
    assert out["num_tokens"] == out["verified_tokens"] == 24 and out["offline_tokens"] == 0
    assert out["first_offline_s"] is None  # never offline
    assert main(argv + ["--timeout", "0"]) == 2
    assert "--timeout" in capsys.readouterr().err
    from moa_serve.drafter.checkpoint import init_drafter

    other = init_drafter(str(stories_path), tmp_path / "other", seed=5)
    assert main([str(other) if a == str(stories_drafter) else a for a in argv]) == 2
    assert "drafter" in capsys.readouterr().err
