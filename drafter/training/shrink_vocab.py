"""A smaller draft vocabulary for a trained drafter, without retraining.

A drafter's LM head is the target's, restricted to ``draft_vocab_ids`` (the most frequent reply
tokens of its training data). Its cost per drafted token is mostly that head (8,192 × 576 of the
~11 M weights an MoA draft step reads for SmolLM2), while the rare tokens it holds are almost
never the ones a drafter gets right. ``moa drafter shrink-vocab`` keeps the ``--size`` most
frequent of them (counted over the reply tokens of ``--data``, the drafter's own self-distilled
training conversations; the stop tokens always kept) and writes a new checkpoint with the same
weights. Lossless as before: the verifier decides every token; when sampling, the drafter's q is
over the smaller vocabulary (every other token has q = 0).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import torch

from moa_serve.drafter.checkpoint import DRAFT_VOCAB_KEY, load_drafter, save_drafter
from moa_serve.drafter.spec import resolve_drafter_path
from moa_serve.drafter.training.data import build_examples, load_conversations, response_counts, stop_token_ids
from moa_serve.model_files import load_tokenizer, resolve_model_path


def shrink_draft_vocab(drafter: str, size: int, data_dir: str, out_dir: str, max_len: int = 256) -> dict:
    """Writes ``drafter`` with its ``size`` most frequent draft-vocabulary tokens to ``out_dir``;
    returns what was kept: sizes and the share of ``data_dir``'s reply tokens each vocabulary holds."""
    src = resolve_drafter_path(drafter)
    cfg, state = load_drafter(str(src))
    old = state.get(DRAFT_VOCAB_KEY)
    if old is None:
        raise ValueError(f"{drafter}: drafts over the whole vocabulary (no {DRAFT_VOCAB_KEY}); nothing to shrink")
    if not 1 <= size < len(old):
        raise ValueError(f"--size must be in [1, {len(old) - 1}] (the drafter's vocabulary has {len(old)} tokens)")
    tok = load_tokenizer(resolve_model_path(cfg.target_name_or_path, weights=False))
    examples = build_examples(tok, load_conversations(data_dir), max_len)
    if not examples:
        raise ValueError(f"--data {data_dir}: no conversations with replies in *.jsonl files")
    counts = response_counts(examples)
    total = max(1, sum(counts.values()))
    old_ids = old.long().tolist()
    held = set(old_ids)
    stops = [t for t in stop_token_ids(tok, cfg.target.vocab_size) if t in held]
    by_count = sorted(old_ids, key=lambda t: (-counts[t], t))  # ties: the lower id, deterministic
    keep = sorted(list(dict.fromkeys(stops + by_count))[:size])

    state = {**state, DRAFT_VOCAB_KEY: torch.tensor(keep, dtype=old.dtype)}
    out = save_drafter(out_dir, dataclasses.replace(cfg, draft_vocab_size=size), state)
    report = {
        "from": drafter,  # as given (a packaged name or a path), not where this machine resolved it
        "size_before": len(old_ids),
        "size": size,
        "data": str(data_dir),
        "reply_tokens": total,
        "coverage_before": round(sum(counts[t] for t in old_ids) / total, 4),
        "coverage": round(sum(counts[t] for t in keep) / total, 4),
    }
    training = src / "training.json"
    record = json.loads(training.read_text()) if training.exists() else {}
    record["draft_vocab_shrunk"] = report
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    if (src / "README.md").exists() and not (out / "README.md").exists():
        shutil.copy(src / "README.md", out / "README.md")
    return report


def cmd_shrink_vocab(args) -> int:
    print(json.dumps(shrink_draft_vocab(args.drafter, args.size, args.data, args.out, args.max_len)))
    return 0


def register(dsub) -> None:
    p = dsub.add_parser(
        "shrink-vocab",
        help="keep a trained drafter's most frequent draft-vocabulary tokens (cheaper drafting, same weights)",
    )
    p.add_argument("--drafter", required=True, help="a trained drafter checkpoint with a draft vocabulary")
    p.add_argument("--size", type=int, required=True, help="tokens to keep (e.g. 2048)")
    p.add_argument(
        "--data",
        required=True,
        help="folder of *.jsonl conversations whose replies give the "
        "frequencies (the drafter's self-distilled training data)",
    )
    p.add_argument("--out", required=True, help="folder for the new checkpoint")
    p.add_argument("--max-len", type=int, default=256, help="tokens per conversation window, as in training")
    p.set_defaults(func=cmd_shrink_vocab)
