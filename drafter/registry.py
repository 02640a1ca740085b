"""From a drafter spec to the objects that serve it: :func:`load_proposer` builds the drafting side
(MoA, EAGLE-style or independent by the checkpoint's kind, prompt lookup, or a hybrid of lookup
and a checkpoint, with the output store for ``+outputs``); :func:`load_feature_source` builds the
verifier-side half (the features the drafter reads from the target). The composition roots (pools,
engines, CLI, benchmarks) call these and hand the results to a verifier, which never imports a
drafter."""

from __future__ import annotations

from moa_serve.drafter import outputs
from moa_serve.drafter.baselines import EagleProposer, IndependentProposer
from moa_serve.drafter.checkpoint import DRAFT_VOCAB_KEY, load_drafter
from moa_serve.drafter.feature_sources import HiddenFeatures, MoAFeatures
from moa_serve.drafter.lookup import HybridProposer, PromptLookupProposer
from moa_serve.drafter.moa_model import MoADrafter
from moa_serve.drafter.proposer import MoAProposer, ProposerBase
from moa_serve.drafter.spec import DrafterSpec

PROPOSERS = {"moa": MoAProposer, "eagle": EagleProposer, "independent": IndependentProposer}


def load_proposer(
    drafter: "str | DrafterSpec",
    target: str | None = None,
    dtype="float32",
    device="cpu",
    max_sessions: int = 16,
    max_model_len: int = 2048,
    target_model=None,
) -> ProposerBase:
    """The proposer of a drafter spec: a checkpoint by its config's ``kind`` (MoA, EAGLE-style or
    independent), ``lookup`` (prompt lookup) or ``hybrid:<checkpoint>`` (both); ``lookup+outputs`` /
    ``hybrid+outputs:<checkpoint>`` add the target's earlier replies to the lookup. With ``target_model``
    (the in-process engine) it shares that model's embeddings / LM head / layers; without (a drafter
    replica) it reads only those tensors from ``target`` (default: the checkpoint's
    ``target_name_or_path``), never the whole target."""
    spec = DrafterSpec.parse(drafter)
    if not spec:
        raise ValueError("no drafter to load: the spec names neither prompt lookup nor a checkpoint")
    if spec.lookup:
        model = (
            None
            if spec.checkpoint is None
            else load_proposer(spec.checkpoint, target, dtype, device, max_sessions, max_model_len, target_model)
        )
        store, gate = lookup_store(spec, target or (model.cfg.target_name_or_path if model is not None else None))
        # the lookup copy never evicts before the model's (it would force needless resyncs)
        lk = PromptLookupProposer(
            max_sessions=4 * max_sessions, max_model_len=max_model_len, store=store, store_gate=gate
        )
        return lk if model is None else HybridProposer(lk, model)
    return PROPOSERS[spec.kind].load(
        spec.checkpoint,
        target=target,
        dtype=dtype,
        device=device,
        max_sessions=max_sessions,
        max_model_len=max_model_len,
        target_model=target_model,
    )


def lookup_store(spec: DrafterSpec, target: str | None) -> tuple[outputs.OutputStore | None, tuple | None]:
    """The output store a spec's prompt lookup reads (``+outputs``: the target's earlier replies;
    otherwise none) and its gate: looked up alone, or before a checkpoint's drafts."""
    if not spec.outputs:
        return None, None
    gate = outputs.GATE_ALONE if spec.checkpoint is None else outputs.GATE_BEFORE_MODEL
    return outputs.output_store_for(target), gate


def load_feature_source(drafter: "str | DrafterSpec | None") -> MoAFeatures | HiddenFeatures | None:
    """The verifier-side half of a drafter spec's checkpoint: MoA's feature head (LSA + Ekv2E),
    the EAGLE-style hidden-state reader, or None (prompt lookup, an independent drafter, none)."""
    spec = DrafterSpec.parse(drafter)
    if spec.checkpoint is None:  # prompt lookup needs no features
        return None
    cfg, state = load_drafter(spec.checkpoint)
    if cfg.kind != "moa":  # baselines: EAGLE-style reads the target's hidden states, independent nothing
        return HiddenFeatures() if cfg.kind == "eagle" else None
    moa = MoADrafter(cfg)
    moa.load_flat_state_dict({k: v for k, v in state.items() if k != DRAFT_VOCAB_KEY})
    # the drafter's CA reads only the freshest verified feature: the verifier computes no other one
    return MoAFeatures(moa.feature_head, latest_only=cfg.cross_attention_latest_only)
