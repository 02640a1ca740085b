"""Does a drafter use the target's features? Teacher-forced measurements on held-out replies.

``moa drafter diagnose --drafter DIR[,DIR...] --data DIR`` runs the frozen target over the
conversations of ``--data`` (e.g. the target's own replies to Spec-Bench prompts, written by
``moa regenerate``) and reports per drafter, over response positions:

* MoA: top-1 agreement with the target by **draft distance** d (the drafter at position i reads
  the features of positions up to i - d; every ``--period``-th response position is verified, as
  the bounded training mask with a fixed T). A drafter that uses its features predicts better at
  d = 0 and 1 than at d = 5; one that does not is flat.
* MoA: the share of the cross-attention's mass on the freshest feature (beside what uniform
  attention would give), and top-1 with every feature zeroed.
* EAGLE-style: top-1 at d = 1 (the target's hidden state of the previous position).

It measures agreement with the target's greedy token, the quantity acceptance is made of; it is
not τ (``moa bench`` measures that, with the drafter's own tokens fed back).
"""

from __future__ import annotations

import json
import sys

import torch

from moa_serve.drafter.baselines import build_baseline
from moa_serve.drafter.checkpoint import DRAFT_VOCAB_KEY, load_drafter
from moa_serve.drafter.moa_model import MoADrafter, TargetParts
from moa_serve.drafter.spec import resolve_drafter_path
from moa_serve.drafter.training import masks
from moa_serve.drafter.training.data import batches, build_examples, load_conversations
from moa_serve.model.target import TargetModel
from moa_serve.model_files import load_state_dict, load_tokenizer, read_config, resolve_model_path


def _load(spec: str):
    cfg, state = load_drafter(spec)
    vocab = state.pop(DRAFT_VOCAB_KEY, None)
    if cfg.kind == "moa":
        m = MoADrafter(cfg)
        m.load_flat_state_dict(state)
    elif cfg.kind == "eagle":
        m = build_baseline(cfg)
        m.load_state_dict(state)
    else:
        raise ValueError(f"{spec}: diagnose measures MoA and EAGLE-style drafters, not {cfg.kind!r}")
    return cfg, m.float().eval(), (vocab.long() if vocab is not None else None)


@torch.no_grad()
def diagnose(
    target_name: str,
    drafters: list[str],
    data_dir: str,
    batches_: int = 30,
    batch_size: int = 8,
    period: int = 6,
    max_len: int = 128,
    max_prompt: int = 48,
    progress: bool = True,
) -> list[dict]:
    from tqdm import tqdm

    path = resolve_model_path(target_name)
    target = TargetModel.from_state_dict(read_config(path), load_state_dict(path), torch.float32).eval()
    tok = load_tokenizer(path)
    convs = load_conversations(data_dir, 0, 0, None)
    if not convs:
        raise ValueError(f"--data {data_dir!r}: no conversations in *.jsonl files")
    examples = build_examples(tok, convs, max_len, max_prompt=max_prompt)
    n = min(batches_, max(1, len(examples) // batch_size))
    parts = TargetParts(target, 0)
    loaded = []
    for spec in drafters:
        cfg, m, vocab = _load(spec)
        loaded.append((spec, cfg, m, vocab, parts.lm_head.weight if vocab is None else parts.lm_head.weight[vocab]))
    acc = {
        spec: {"hits": torch.zeros(period), "count": torch.zeros(period), "zeroed": 0, "fresh": 0.0, "uniform": 0.0}
        for spec in drafters
    }
    stream = batches(examples, batch_size, 123)
    for _ in tqdm(range(n), desc="diagnose", disable=not progress, file=sys.stderr):
        tokens, resp, valid = next(stream)
        b, s = tokens.shape
        t = {k: v.float() for k, v in target.forward_train(tokens, valid, 0, None).items()}
        want = t["logits"].argmax(-1)
        scored = torch.zeros_like(resp)
        scored[:, :-1] = resp[:, 1:] & valid[:, 1:]
        positions = torch.arange(s)[None].expand(b, s)
        visible = masks.every_t_visible(~resp, torch.full((b,), period)) | ~valid
        visible[:, 0] = True
        start = masks.last_visible(visible)
        dist = positions - start
        cos, sin = parts.rotary(positions, torch.float32)
        for spec, cfg, m, vocab, head_w in loaded:
            a = acc[spec]

            def top1(hidden, vocab=vocab, head_w=head_w):
                """The draft token (mapped back from the draft vocabulary) == the target's."""
                ids = (hidden @ head_w.T).argmax(-1)
                return (vocab[ids] if vocab is not None else ids) == want

            if cfg.kind == "eagle":
                prev = torch.zeros_like(t["hidden"])
                prev[:, 1:] = t["hidden"][:, :-1]
                ok = top1(m.forward_parallel(parts, tokens, prev, positions, masks.causal_mask(b, s)))
                a["hits"][1] += (ok & scored).sum()
                a["count"][1] += scored.sum()
                continue
            sa = masks.self_mask(visible, torch.zeros(b, dtype=torch.bool))
            ca = (
                masks.latest_cross_mask(visible)
                if cfg.cross_attention_latest_only
                else masks.bounded_cross_mask(visible)
            )
            sel = visible & valid
            fv = m.feature_head(t["per_layer_kv"][sel])
            feats = torch.zeros(b, s, fv.shape[-1]).index_put((sel,), fv)
            dh = m.draft_head
            hidden, _ = dh.forward_parallel(parts, tokens, feats, positions, sa, ca)
            ok = top1(hidden)
            for d in range(period):
                mk = scored & (dist == d)
                a["hits"][d] += (ok & mk).sum()
                a["count"][d] += mk.sum()
            zeroed, _ = dh.forward_parallel(parts, tokens, torch.zeros_like(feats), positions, sa, ca)
            a["zeroed"] += int((top1(zeroed) & scored).sum())
            # the CA's attention (mean over heads) on the freshest feature
            x = dh.self_attention(parts.embed_tokens(tokens), cos, sin, lambda k, v: (k, v, sa))
            keys, _ = dh.cross_attention.project_features(feats, cos, sin)
            q = dh.cross_attention.self_attn.query(dh.cross_attention.input_layernorm(x), cos, sin)
            keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], 1)
            p = ((q @ keys.transpose(-1, -2)) / q.shape[-1] ** 0.5).masked_fill(~ca, float("-inf")).softmax(-1)
            fresh = p.gather(-1, start.clamp_min(0)[:, None, :, None].expand(b, p.shape[1], s, 1))[..., 0].mean(1)
            a["fresh"] += float(fresh[scored].sum())
            a["uniform"] += float((1.0 / ca[:, 0].sum(-1).clamp_min(1))[scored].sum())
    out = []
    for spec, cfg, *_ in loaded:
        a = acc[spec]
        by_d = (a["hits"] / a["count"].clamp_min(1)).tolist()
        row = {
            "drafter": str(resolve_drafter_path(spec)),
            "kind": cfg.kind,
            "data": data_dir,
            "positions": int(a["count"].sum()),
        }
        if cfg.kind == "eagle":
            row["top1_d1"] = round(by_d[1], 3)
        else:
            total = int(a["count"].sum())
            row.update(
                {
                    "top1_by_distance": [round(x, 3) for x in by_d],
                    "top1_all_distances": round(float(a["hits"].sum()) / max(1, total), 3),
                    "top1_features_zeroed": round(a["zeroed"] / max(1, total), 3),
                    "ca_mass_on_freshest": round(a["fresh"] / max(1, total), 3),
                    "ca_mass_if_uniform": round(a["uniform"] / max(1, total), 3),
                }
            )
        out.append(row)
    return out


def cmd_diagnose(args) -> int:
    rows = diagnose(
        args.target,
        [d for d in args.drafter.split(",") if d],
        args.data,
        args.batches,
        args.batch_size,
        args.period,
        args.max_len,
        args.max_prompt,
    )
    for row in rows:
        print(json.dumps(row))
    return 0


def register(dsub) -> None:
    p = dsub.add_parser("diagnose", help="teacher-forced top-1 by draft distance, and whether MoA reads its features")
    p.add_argument("--drafter", required=True, help="comma-separated checkpoints (MoA or EAGLE-style)")
    p.add_argument("--data", required=True, help="folder of *.jsonl conversations (e.g. moa regenerate's self/)")
    p.add_argument("--target", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--period", type=int, default=6, help="every T-th response position is verified (distances 0..T-1)")
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=48)
    p.set_defaults(func=cmd_diagnose)
