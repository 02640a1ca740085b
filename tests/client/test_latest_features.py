"""Client-server mode with a drafter that reads only the freshest feature (MoA trained with
``cross_attention_latest_only``): the server sends one feature per round instead of every newly
committed position's, the device stands zeros in for the others — and drafts exactly what it
drafts when it receives them all, so the output stays the target's and only bytes change."""

import pytest

from moa_serve.client import DeviceDrafter
from moa_serve.drafter.checkpoint import init_drafter
from moa_serve.drafter.spec import DrafterSpec
from moa_serve.engine.in_process import SpeculativeEngine
from tests.client.test_end_to_end import generator
from tests.support.cs_harness import serving

PROMPTS = ["Once upon a time", "The little dog"]


@pytest.fixture(scope="module")
def latest_drafter(tmp_path_factory, stories_path):
    return init_drafter(
        str(stories_path), tmp_path_factory.mktemp("latest-only"), seed=3, cross_attention_latest_only=True
    )


@pytest.fixture(scope="module")
def server(stories_path, latest_drafter):
    with serving(stories_path, latest_drafter) as s:
        yield s


def test_only_the_freshest_feature_travels_and_the_drafts_do_not_change(
    server, stories_path, latest_drafter, stories_drafter
):
    srv, uv = server
    assert (
        DrafterSpec.parse(str(latest_drafter)).latest_feature_only
        and not DrafterSpec.parse(str(stories_drafter)).latest_feature_only
    )
    assert srv.identity.feature_positions == "latest"
    plain = SpeculativeEngine.load(str(stories_path), None, "float32")
    device = DeviceDrafter.load(str(latest_drafter), str(stories_path), "float32", 512)
    for prompt in PROMPTS:
        ids = device.tokenizer.encode(prompt)
        ref = plain.generate([ids], 40, ignore_eos=True)[0].token_ids
        runs = {}
        for mode in ("latest", "all"):
            srv.identity.feature_positions = mode  # sessions created from now on
            gen, _ = generator(device, uv.url, num_speculative_tokens=3, adaptive_k=False)
            run = gen.start(ids, 40, ignore_eos=True)
            events = [(e.kind, e.position, tuple(e.tokens)) for e in run]
            runs[mode] = (run.result(), events, run.features)
        (lat, lat_ev, lat_f), (full, full_ev, full_f) = runs["latest"], runs["all"]
        assert lat.token_ids == full.token_ids == ref  # lossless either way
        assert lat_ev == full_ev and lat.accepted_tokens == full.accepted_tokens  # the same drafts
        assert lat.bytes_down < full.bytes_down
        assert lat_f.end == full_f.end
        got, want = lat_f.since(0), full_f.since(0)
        sent = got.abs().sum(-1) > 0
        assert int(sent.sum()) <= lat.rounds + 1 < len(got)  # one feature per answered round at most
        assert (got[sent] - want[sent]).abs().max() < 1e-3  # the ones sent are the server's (float16 codec)
    srv.identity.feature_positions = "latest"
