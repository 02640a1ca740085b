"""Self-distillation data: regenerate the assistant replies of training conversations with the
target itself (greedy, through the batched engine with continuous batching), so the drafter
learns the target's own distribution rather than the dataset authors'.

``moa regenerate --target ID --data-dir ../shared/data/train --per-file 200 --out runs/selfdistill``
writes two directories holding the *same* first-turn conversations, ready for ``data_dir`` of
``moa train``:

- ``<out>/self/regenerated*.jsonl``: the replies written by the target;
- ``<out>/original/original*.jsonl``: the dataset's own replies (the control arm of a
  self-distillation comparison at equal prompts and budget).

``--all-turns`` answers every user turn of a multi-turn conversation, each in the context of the
target's own earlier replies (turn by turn, batched across conversations); by default only the
first turn. ``--system-prompt-share F`` renders that share of the conversations (chosen by a hash of
their first prompt, so the choice is stable across runs) with the system prompt the chat template
inserts when a request has none — the way a served chat request reaches the target — and keeps it
in the written conversation; the paper's recipe (and the default) has no system prompt.

It adds to what ``<out>`` already holds: prompts already answered there (by any run) are
skipped and the new ones go to a new shard, written chunk by chunk, so an interrupted or
time-boxed run (``--limit``) loses at most one chunk and the next one goes on from there. The
sample is deterministic (``--per-file``, ``--seed``) and a larger ``--per-file`` holds the smaller
one, so raising it only adds prompts.

``--backend vllm`` writes the replies with stock vLLM (no drafter; ``pip install -e ".[vllm]"``)
instead of the project's engine: its offline batching is the faster of the two on a CPU.

``--pack FILE`` stores what ``<out>/self`` holds compactly (gzip): per conversation its source
(file and row of the corpus), the system prompt if it had one and the target's replies — no text of
the corpus, which stays where it is. ``--unpack FILE`` rebuilds ``<out>`` from it and the corpus
(``--data-dir``), checking that each referenced row still holds the prompt it held, so a later
session trains on hours of regenerated replies without regenerating them, and goes on from there.
"""

from __future__ import annotations

import json

from moa_serve.measure.regenerate_replies import pack, regenerate, unpack
from moa_serve.verifier.vllm.engine import release_process_state


def register(sub) -> None:
    p = sub.add_parser("regenerate", help="regenerate training replies with the target (self-distillation data)")
    p.add_argument("--target", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--data-dir", default="../shared/data/train")
    p.add_argument(
        "--per-file", type=int, default=30, help="conversations sampled per corpus file (0: every conversation)"
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--backend",
        choices=["torch", "vllm"],
        default="torch",
        help="the engine that writes the replies: ours, or stock vLLM (pip install -e '.[vllm]')",
    )
    p.add_argument(
        "--all-turns",
        action="store_true",
        help="answer every user turn of multi-turn conversations (default: the first turn only)",
    )
    p.add_argument(
        "--system-prompt-share",
        type=float,
        default=0.0,
        metavar="F",
        help="render this share of the conversations (by prompt hash) with the chat template's "
        "default system prompt, as served (default 0: none, the paper's recipe)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--limit",
        type=int,
        default=0,
        help="answer at most this many prompts not yet in --out (0: all); a later run goes on",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="stop starting chunks after this many minutes of writing (0: no limit); a later run goes on",
    )
    p.add_argument("--out", required=True)
    p.add_argument(
        "--pack",
        metavar="FILE",
        help="instead: store --out's regenerated replies compactly (gzip; sources + replies, no corpus text)",
    )
    p.add_argument("--unpack", metavar="FILE", help="instead: rebuild --out from a pack and --data-dir")
    p.set_defaults(func=_cmd)


def _cmd(a) -> int:
    if a.pack and a.unpack:
        raise SystemExit("moa regenerate: --pack and --unpack are exclusive")
    if a.pack:
        print(json.dumps({"event": "packed", "conversations": pack(a.out, a.pack), "file": a.pack}))
    elif a.unpack:
        print(unpack(a.unpack, a.data_dir, a.out))
    else:
        print(
            regenerate(
                a.target,
                a.data_dir,
                a.out,
                a.per_file,
                a.max_new_tokens,
                a.batch,
                a.dtype,
                a.device,
                a.seed,
                a.limit,
                a.backend,
                a.all_turns,
                a.system_prompt_share,
                a.max_minutes,
            )
        )
        if a.backend == "vllm":
            release_process_state()
    return 0
