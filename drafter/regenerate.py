"""Self-distillation data: regenerate the assistant replies of training conversations with the
target itself (greedy, through the batched engine with continuous batching), so the drafter
learns the target's own distribution rather than the dataset authors'.

``moa regenerate --target ID --data-dir ../shared/data/train --per-file 200 --out runs/selfdistill``
writes two directories holding the *same* first-turn conversations, ready for ``data_dir`` of
``moa train``:

- ``<out>/self/regenerated.jsonl``: the replies written by the target;
- ``<out>/original/original.jsonl``: the dataset's own replies (the control arm of a
  self-distillation comparison at equal prompts and budget).
"""

from __future__ import annotations

import json
from pathlib import Path


def regenerate(target: str, data_dir: str, out: str, per_file: int, max_new_tokens: int = 256,
               batch: int = 16, dtype: str = "bfloat16", device: str = "cpu", seed: int = 0) -> Path:
    from tqdm import tqdm

    from moa_serve.drafter.data import load_conversations, prompt_ids
    from moa_serve.engine.engine import SpeculativeEngine

    if per_file < 1 or max_new_tokens < 1 or batch < 1:
        raise ValueError("per_file, max_new_tokens and batch must be >= 1")
    engine = SpeculativeEngine.load(target, None, dtype, device, max_sessions=batch, max_model_len=2048)
    convs = [c[:2] for c in load_conversations(data_dir, per_file, seed)]
    root = Path(out)
    (root / "self").mkdir(parents=True, exist_ok=True)
    (root / "original").mkdir(parents=True, exist_ok=True)
    chunk_size = batch * 4  # continuous batching inside a chunk; the chunk bounds lost work on interrupt
    tokens = 0
    with (root / "self" / "regenerated.jsonl").open("w") as f_self, \
            (root / "original" / "original.jsonl").open("w") as f_orig, \
            tqdm(total=len(convs), desc="regenerate", unit="conv") as bar:
        for i in range(0, len(convs), chunk_size):
            chunk = convs[i:i + chunk_size]
            prompts = [prompt_ids(engine.tokenizer, c[:1])[-(engine.max_model_len - max_new_tokens - 1):]
                       for c in chunk]
            for c, res in zip(chunk, engine.generate(prompts, max_new_tokens)):
                f_self.write(json.dumps({"messages": [c[0], {"role": "assistant", "content": res.text}]}) + "\n")
                f_orig.write(json.dumps({"messages": c}) + "\n")
                tokens += res.num_tokens
            bar.update(len(chunk))
            bar.set_postfix(tokens=tokens, tok_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")
    return root


def register(sub) -> None:
    p = sub.add_parser("regenerate", help="regenerate training replies with the target (self-distillation data)")
    p.add_argument("--target", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--data-dir", default="../shared/data/train")
    p.add_argument("--per-file", type=int, default=30)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=lambda a: print(regenerate(a.target, a.data_dir, a.out, a.per_file, a.max_new_tokens,
                                                   a.batch, a.dtype, a.device, a.seed)) or 0)
