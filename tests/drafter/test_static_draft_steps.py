"""A MoA draft call's steps as fixed shapes, its first step included (drafter/static_steps.py: what
a GPU replays from one CUDA graph per call), draft the planned loop's tokens."""

import pytest
import torch

from moa_serve.engine.in_process import SpeculativeEngine
from tests.engine.test_lossless import STORY_PROMPTS


def _engine(stories_path, stories_drafter, static: bool, single: bool):
    spec = SpeculativeEngine.load(str(stories_path), str(stories_drafter), "float32", max_sessions=8)
    proposer = spec.proposer
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a drafter whose drafts vary with the context (the random init barely does)
        for p in proposer.head.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    proposer.single_feature_ca = single
    if static:
        assert proposer.use_static_steps(graphs=False)
    drafted = []
    propose = proposer.propose

    def recording(requests):
        out = propose(requests)
        drafted.extend((r.session_id, r.drafts) for r in out)
        return out

    proposer.propose = recording
    return spec, drafted


@pytest.mark.parametrize("single", [False, True], ids=["cross-attention", "single-feature"])
def test_static_draft_steps_draft_the_planned_tokens(stories_path, stories_drafter, single):
    planned, planned_drafts = _engine(stories_path, stories_drafter, False, single)
    static, static_drafts = _engine(stories_path, stories_drafter, True, single)
    prompts = [planned.tokenizer.encode(p) for p in STORY_PROMPTS[:10]]
    want = [o.token_ids for o in planned.generate(prompts, 20, num_speculative_tokens=4)]
    got = [o.token_ids for o in static.generate(prompts, 20, num_speculative_tokens=4)]
    assert got == want
    assert static_drafts == planned_drafts
    assert len({tuple(d) for _, d in static_drafts}) > 20  # drafts that differ, not one repeated token
    assert static.proposer.static_steps.stats["static_draft_calls"] > 10
    assert static.proposer.static_steps.stats["static_first_steps"] > 10  # first steps from the fixed shapes too


def test_sampling_sessions_keep_the_planned_steps(stories_path, stories_drafter):
    from moa_serve.sampling import SamplingParams

    spec, _ = _engine(stories_path, stories_drafter, True, False)
    prompts = [spec.tokenizer.encode(p) for p in STORY_PROMPTS[:2]]
    spec.generate(prompts, 8, sampling=SamplingParams(temperature=0.8, seed=1), num_speculative_tokens=3)
    assert spec.proposer.static_steps.stats["static_draft_calls"] == 0
