"""The verifier's fixed-shape forward (verifier/torch/static_forward.py: what a GPU replays from CUDA
graphs) gives the tokens of the planned forward, and a verifier's memory stays flat."""

import gc
import random

import pytest
import torch

from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.protocol import VerifyRequest
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner
from moa_serve.verifier.torch.static_forward import StaticForward, packed_layout
from tests.engine.test_lossless import STORY_PROMPTS

NEW_TOKENS = 20


def test_packed_layout_puts_alternatives_at_their_twins_position():
    positions, store = packed_layout([5, 0], [4, 2], [[1], []])
    assert positions == [5, 6, 7, 6, 0, 1]  # chain 5..7, its alternative shares position 6
    assert store == [5, 6, 7, 8, 0, 1]  # and is stored after the chain


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engines(request, stories_path, stories_drafter):
    def load(static):
        return SpeculativeEngine.load(
            str(stories_path), str(stories_drafter), request.param, max_sessions=8, static_forward=static
        )

    return load("off"), load("on")


def test_fixed_shape_forward_gives_the_planned_forwards_tokens(engines):
    planned, static = engines
    assert planned.verifier.static is None and static.verifier.static is not None
    prompts = [static.tokenizer.encode(p) for p in STORY_PROMPTS[:12]]
    want = [o.token_ids for o in planned.generate(prompts, NEW_TOKENS, num_speculative_tokens=3)]
    got = [o.token_ids for o in static.generate(prompts, NEW_TOKENS, num_speculative_tokens=3)]
    assert got == want
    stats = static.verifier.stats
    assert stats["static_calls"] > 0  # the calls ran at fixed sizes (prefill chunks of 12 sessions too)
    # one at a time: a session's tokens do not depend on the others in its rounds
    alone = [static.generate([p], NEW_TOKENS, num_speculative_tokens=3)[0].token_ids for p in prompts[:4]]
    assert alone == want[:4]


def test_a_call_above_every_size_runs_planned(stories_path):
    runner = TorchTargetRunner(
        str(stories_path),
        "float32",
        max_sessions=2,
        options=RunnerOptions(static_forward="on", max_num_batched_tokens=60),
    )
    assert runner.static.sizes[-1] == 48  # the sizes up to the token budget
    runner.verify([VerifyRequest("a", list(range(1, 61)), want_features=False)])  # 60 tokens
    assert runner.stats["eager_calls"] == 1 and runner.stats["static_calls"] == 0
    runner.verify([VerifyRequest("a", [], drafts=[3, 4], base=61, want_features=False)])
    assert runner.stats["static_calls"] == 1


def test_padding_rows_write_only_the_scratch_column(stories_path):
    runner = TorchTargetRunner(str(stories_path), "float32", max_sessions=2, options=RunnerOptions(static_forward="on"))
    runner.verify([VerifyRequest("a", [1, 2, 3], want_features=False)])  # 3 tokens run as 4 rows
    cache = runner.cache
    slot = runner.sessions["a"].slot
    assert cache.k[:, slot, :, 4 : cache.max_len].abs().sum() == 0  # nothing past the session's tokens
    assert cache.k[:, slot, :, cache.max_len].abs().sum() > 0  # the padding row wrote its scratch column


def _live_tensor_bytes() -> int:
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


@pytest.mark.parametrize("static", ["off", "on"])
def test_memory_is_flat_over_a_sweep_of_call_shapes(stories_path, static):
    runner = TorchTargetRunner(
        str(stories_path), "float32", max_sessions=8, options=RunnerOptions(static_forward=static, prefix_caching=False)
    )
    g = random.Random(0)
    ids = [f"s{i}" for i in range(8)]
    runner.verify([VerifyRequest(i, [g.randrange(1, 512) for _ in range(40)], want_features=False) for i in ids])

    def sweep():
        for b in (1, 3, 8, 2, 5):
            for width in (1, 2, 4, 6, 8):
                runner.verify(
                    [
                        VerifyRequest(
                            i, [], drafts=[g.randrange(512) for _ in range(width - 1)], base=40, want_features=False
                        )
                        for i in ids[:b]
                    ]
                )

    sweep()  # every shape seen once: what a replica holds for good
    before = _live_tensor_bytes()
    for _ in range(3):
        sweep()
    assert _live_tensor_bytes() == before


def test_a_forward_outside_inference_mode_leaves_no_autograd_graph_on_the_cache(stories_path):
    """A benchmark timing the model's forward without ``inference_mode`` must not chain every
    forward's activations to the KV cache (each write would keep the last one's graph alive)."""
    runner = TorchTargetRunner(str(stories_path), "float32", max_sessions=2)
    assert not any(p.requires_grad for p in runner.model.parameters())
    from moa_serve.model.kv_cache import PackedBatch

    hidden = runner.model.forward_packed(torch.tensor([1, 2, 3]), PackedBatch(runner.cache, [0], [0], [3]))
    assert runner.cache.k.grad_fn is None and not hidden.requires_grad


def test_static_forward_sizes_stop_at_the_token_budget(stories_path):
    runner = TorchTargetRunner(
        str(stories_path), "float32", max_sessions=2, options=RunnerOptions(static_forward="off")
    )
    static = StaticForward(runner.model, runner.cache, 100, graphs=False)
    assert static.sizes[-1] == 96 and static.size_for(97) is None and static.size_for(5) == 8


def test_the_fixed_shape_forward_refuses_positions_past_the_cache(stories_path):
    """A position past the cache would land in (or beyond) the scratch column: refused before any
    write, as the planned forward refuses it (on a GPU an index past the cache is a device fault)."""
    runner = TorchTargetRunner(
        str(stories_path), "float32", max_sessions=2, max_model_len=16, options=RunnerOptions(static_forward="on")
    )
    with pytest.raises(ValueError, match="exceed the cache"):
        runner.static([1, 2], [0, 0], [15, 16], [15, 16])
    assert runner.stats["static_calls"] == 0


def test_fixed_shape_feature_head_gives_the_planned_features(stories_path, stories_drafter):
    from moa_serve.drafter.registry import load_feature_source

    def runner(static):
        return TorchTargetRunner(
            str(stories_path),
            "float32",
            max_sessions=4,
            features=load_feature_source(str(stories_drafter)),
            options=RunnerOptions(static_forward=static),
        )

    planned, fixed = runner("off"), runner("on")
    assert planned.static_features is None and fixed.static_features is not None
    prompts = {"a": list(range(1, 30)), "b": list(range(5, 12))}
    first = [VerifyRequest(sid, p) for sid, p in prompts.items()]
    held = {}
    for call in range(2):
        requests = (
            first
            if call == 0
            else [
                VerifyRequest(sid, [], drafts=drafts, base=held[sid]) for sid, drafts in (("a", [7, 8, 9]), ("b", [4]))
            ]
        )
        want, got = planned.verify(requests), fixed.verify(requests)
        for w, g in zip(want, got):
            assert (g.tokens, g.feature_start) == (w.tokens, w.feature_start)
            assert g.features.shape == w.features.shape and torch.allclose(g.features, w.features, atol=1e-5)
            held[w.session_id] = held.get(w.session_id, len(prompts[w.session_id])) + len(w.tokens)
    assert fixed.stats["static_feature_calls"] == 2 and "static_feature_calls" not in planned.stats
