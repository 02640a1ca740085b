"""The MoA drafter's masks and cached drafting: the bounded mask hides unverified features, the
proposer's incremental drafting equals the teacher-forced parallel pass, and a latest-only drafter
reads only its freshest feature. (``target``: tests/drafter/conftest.py.)"""

import torch

from moa_serve.drafter.checkpoint import load_drafter, save_drafter
from moa_serve.drafter.config import DrafterConfig
from moa_serve.drafter.moa_model import MoADrafter, TargetParts, init_weights
from moa_serve.drafter.proposer import MoAProposer
from moa_serve.protocol import DraftRequest


def _bounded_mask(visible: torch.Tensor) -> torch.Tensor:
    """Position i sees features of positions j <= start_i, start_i = last visible position <= i."""
    s = visible.shape[-1]
    idx = torch.arange(s)
    start = torch.cummax(torch.where(visible, idx, torch.zeros_like(idx)), -1).values
    return ((idx[None, :] <= start[..., :, None]) & (idx[None, :] <= idx[:, None]))[:, None]


def test_bounded_mask_hides_unverified_features(stories_path, target):
    cfg = DrafterConfig(target=target.arch)
    moa = MoADrafter(cfg)
    init_weights(moa, seed=0)
    parts = TargetParts(target, 0)
    s = 24
    tokens = torch.randint(0, 512, (1, s), generator=torch.Generator().manual_seed(1))
    feats = torch.randn(1, s, cfg.feature_dim)
    visible = torch.zeros(1, s, dtype=torch.bool)
    visible[0, :8] = True  # the prompt
    visible[0, 15] = True  # a cut of the variable future length
    ca = _bounded_mask(visible)
    sa = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    pos = torch.arange(s)[None]
    with torch.no_grad():
        out, _ = moa.draft_head.forward_parallel(parts, tokens, feats, pos, sa, ca)
        changed = feats.clone()
        changed[0, 8:15] += 5.0  # features the positions 8..14 must not see
        changed[0, 16:] -= 3.0
        out2, _ = moa.draft_head.forward_parallel(parts, tokens, changed, pos, sa, ca)
    assert torch.allclose(out[0, :15], out2[0, :15], atol=1e-5)
    assert not torch.allclose(out[0, 16:], out2[0, 16:])  # later positions do see fresh features


def _teacher_forced_drafts(moa, target, committed, drafts, feats, ca_mask_of) -> list[int]:
    """The greedy tokens the teacher-forced pass gives at the drafting positions, the features of
    the committed positions but the last visible (``ca_mask_of(visible)`` builds the CA mask)."""
    n = len(committed) - 1
    seq = committed + drafts[:-1]
    s = len(seq)
    visible = torch.zeros(1, s, dtype=torch.bool)
    visible[0, :n] = True
    allf = torch.cat([feats, torch.zeros(s - n, feats.shape[-1])])[None]
    sa = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        h, _ = moa.draft_head.forward_parallel(
            TargetParts(target, 0), torch.tensor([seq]), allf, torch.arange(s)[None], sa, ca_mask_of(visible)
        )
        return target.lm_head(h[0, n:]).argmax(-1).tolist()


def test_incremental_drafting_equals_parallel_pass(stories_path, stories_drafter, target):
    """The proposer's cached drafting computes what the teacher-forced pass computes with the
    bounded mask (position n sees features of 0..n-1)."""
    proposer = MoAProposer.load(str(stories_drafter), target_model=target, max_sessions=2, max_model_len=64)
    cfg, state = load_drafter(str(stories_drafter))
    moa = MoADrafter(cfg)
    moa.load_flat_state_dict(state)
    committed = list(range(40, 60))
    n = len(committed) - 1
    feats = torch.randn(n, cfg.feature_dim)
    (res,) = proposer.propose([DraftRequest("x", tokens=committed, num_drafts=3, feature_start=0, features=feats)])
    assert _teacher_forced_drafts(moa, target, committed, res.drafts, feats, _bounded_mask) == res.drafts


def test_latest_only_drafter_reads_only_its_freshest_feature(tmp_path, stories_path, stories_drafter, target):
    """cross_attention_latest_only (with a value readout): the proposer's cached drafting equals the
    teacher-forced pass with the latest-only mask, and its drafts ignore every feature but the
    last verified position's."""
    import dataclasses

    from moa_serve.drafter.training import masks

    cfg, state = load_drafter(str(stories_drafter))
    cfg = dataclasses.replace(cfg, cross_attention_latest_only=True, value_readout_layers=2)
    moa = MoADrafter(cfg)
    init_weights(moa, seed=3)
    moa.load_flat_state_dict({k: v for k, v in state.items() if not k.startswith("draft_vocab")}, new_readout=True)
    folder = save_drafter(tmp_path / "latest", cfg, moa.flat_state_dict())
    committed = list(range(40, 60))
    n = len(committed) - 1
    feats = torch.randn(n, cfg.feature_dim, generator=torch.Generator().manual_seed(1))

    def drafts(features):
        proposer = MoAProposer.load(str(folder), target_model=target, max_sessions=2, max_model_len=64)
        (res,) = proposer.propose(
            [DraftRequest("x", tokens=committed, num_drafts=3, feature_start=0, features=features)]
        )
        return res.drafts

    got = drafts(feats)
    assert _teacher_forced_drafts(moa, target, committed, got, feats, masks.latest_cross_mask) == got
    changed_last = []
    for seed in range(4):
        gen = torch.Generator().manual_seed(10 + seed)
        older = feats.clone()
        older[:-1] = 5 * torch.randn(n - 1, cfg.feature_dim, generator=gen)
        assert drafts(older) == got  # only the last verified feature counts
        fresher = feats.clone()
        fresher[-1] = 20 * torch.randn(cfg.feature_dim, generator=gen)
        changed_last.append(drafts(fresher) != got)
    assert any(changed_last)  # and it does count
