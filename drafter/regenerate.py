"""Self-distillation data: regenerate the assistant replies of training conversations with the
target itself (greedy, through the batched engine), so the drafter learns the target's own
distribution rather than the dataset authors'.

``moa regenerate --target ID --data-dir ../shared/data/train --per-file 30 --out runs/selfdistill``
writes ``<out>/regenerated.jsonl`` (same ``{"messages": [...]}`` format; point ``data_dir`` of
``moa train`` at ``<out>``). Multi-turn conversations keep their first user turn only.
"""

from __future__ import annotations

import json
from pathlib import Path


def regenerate(target: str, data_dir: str, out: str, per_file: int, max_new_tokens: int = 256,
               batch: int = 8, dtype: str = "bfloat16", device: str = "cpu", seed: int = 0) -> Path:
    from tqdm import tqdm

    from moa_serve.drafter.data import load_conversations, prompt_ids
    from moa_serve.engine.engine import SpeculativeEngine

    engine = SpeculativeEngine.load(target, None, dtype, device, max_sessions=batch, max_model_len=2048)
    convs = load_conversations(data_dir, per_file, seed)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    dst = path / "regenerated.jsonl"
    with dst.open("w") as f, tqdm(total=len(convs), desc="regenerate") as bar:
        for i in range(0, len(convs), batch):
            chunk = convs[i:i + batch]
            prompts = [prompt_ids(engine.tokenizer, c[:1])[-(2048 - max_new_tokens - 1):] for c in chunk]
            for c, res in zip(chunk, engine.generate(prompts, max_new_tokens)):
                f.write(json.dumps({"messages": [c[0], {"role": "assistant", "content": res.text}]}) + "\n")
            bar.update(len(chunk))
    return dst


def register(sub) -> None:
    p = sub.add_parser("regenerate", help="regenerate training replies with the target (self-distillation data)")
    p.add_argument("--target", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--data-dir", default="../shared/data/train")
    p.add_argument("--per-file", type=int, default=30)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", required=True)
    p.set_defaults(func=lambda a: print(regenerate(a.target, a.data_dir, a.out, a.per_file, a.max_new_tokens,
                                                   a.batch, a.dtype, a.device)) or 0)
