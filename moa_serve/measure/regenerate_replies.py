"""The harness of ``moa regenerate``: the target's own replies to sampled training conversations
(self-distillation data), written shard by shard beside the dataset's, and their compact pack."""

from __future__ import annotations

import gzip
import hashlib
import json
import time
from pathlib import Path

from moa_serve.drafter.outputs import pack_replies
from moa_serve.drafter.training.data import default_system_prompt, load_conversations, prompt_ids, read_rows
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.verifier.vllm.engine import VllmEngine, VllmOptions


def _prompt_key(message: dict) -> str:
    return f"{message.get('role')}\x00{message.get('content')}"


def _first_user(messages: list[dict]) -> dict:
    return next(m for m in messages if m["role"] == "user")


def answered_prompts(self_dir: Path) -> set[str]:
    """The first user messages of the conversations already regenerated into ``self_dir``."""
    return {_prompt_key(_first_user(row["messages"])) for p in sorted(self_dir.glob("*.jsonl")) for row in read_rows(p)}


def gets_system_prompt(message: dict, share: float) -> bool:
    """Whether a conversation whose first user message is ``message`` is rendered with the default
    system prompt: a hash of the message below ``share`` (stable across runs and sample sizes)."""
    h = int(hashlib.sha256(("system\x00" + _prompt_key(message)).encode()).hexdigest()[:8], 16)
    return h < share * 0x100000000


def _dataset_turns(conv: list[dict], n: int) -> list[dict]:
    """``conv``'s messages up to and including its ``n``-th assistant reply."""
    out, seen = [], 0
    for m in conv:
        if seen == n:
            break
        out.append(m)
        seen += m["role"] == "assistant"
    return out


def _new_shard(root: Path) -> tuple[Path, Path]:
    """Paths of the next (self, original) shard pair under ``root`` (folders created)."""
    (root / "self").mkdir(parents=True, exist_ok=True)
    (root / "original").mkdir(parents=True, exist_ok=True)
    shard = len(list((root / "self").glob("regenerated*.jsonl")))
    suffix = "" if shard == 0 else f"-{shard:03d}"
    return root / "self" / f"regenerated{suffix}.jsonl", root / "original" / f"original{suffix}.jsonl"


def _digest(message: dict) -> str:
    return hashlib.sha256(_prompt_key(message).encode()).hexdigest()[:16]


def pack(out: str, path: str) -> int:
    """Writes ``<out>/self``'s conversations as (source, prompt digest, [system,] replies) lines,
    gzipped; returns how many (conversations without a recorded source are left out). A
    first-turn conversation without a system prompt keeps the short line format (``reply``)."""
    n = 0
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for shard in sorted(Path(out, "self").glob("*.jsonl")):
            for row in read_rows(shard):
                src, msgs = row.get("source"), row["messages"]
                if src is None:
                    continue
                replies = [m["content"] for m in msgs if m["role"] == "assistant"]
                system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
                line = {**src, "prompt_sha": _digest(_first_user(msgs))}
                if len(replies) == 1 and system is None:
                    line["reply"] = replies[0]
                else:
                    line["replies"] = replies
                    if system is not None:
                        line["system"] = system
                f.write(json.dumps(line) + "\n")
                n += 1
    return n


def unpack(path: str, data_dir: str, out: str) -> Path:
    """Rebuilds ``<out>/self`` and ``<out>/original`` from a pack and the corpus it refers to."""
    root = Path(out)
    self_path, orig_path = _new_shard(root)
    sources: dict[str, list[dict]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f, self_path.open("w") as f_self, orig_path.open("w") as f_orig:
        for line_no, line in enumerate(f, 1):
            e = json.loads(line)
            if e["file"] not in sources:
                src = Path(data_dir) / e["file"]
                if not src.is_file():
                    raise FileNotFoundError(f"{path} line {line_no}: the corpus file {src} is missing")
                sources[e["file"]] = read_rows(src)
            rows = sources[e["file"]]
            conv = rows[e["row"]]["messages"] if e["row"] < len(rows) else None
            if conv is None or _digest(_first_user(conv)) != e["prompt_sha"]:
                raise ValueError(
                    f"{path} line {line_no}: row {e['row']} of {e['file']} no longer holds the "
                    "prompt that was answered (the corpus changed)"
                )
            replies = pack_replies(e)
            users = [m for m in conv if m["role"] == "user"][: len(replies)]
            if len(users) < len(replies):
                raise ValueError(
                    f"{path} line {line_no}: {len(replies)} replies for {len(users)} user turns "
                    f"in row {e['row']} of {e['file']}"
                )
            system = [{"role": "system", "content": e["system"]}] if "system" in e else []
            regenerated = [m for u, r in zip(users, replies) for m in (u, {"role": "assistant", "content": r})]
            source = {"file": e["file"], "row": e["row"]}
            f_self.write(json.dumps({"messages": system + regenerated, "source": source}) + "\n")
            f_orig.write(json.dumps({"messages": system + _dataset_turns(conv, len(replies)), "source": source}) + "\n")
    return root


def _engine(backend: str, target: str, dtype: str, device: str, batch: int):
    """The batched engine that writes the replies: ours (torch) or stock vLLM, no drafter."""
    if backend == "vllm":
        if device != "cpu":
            raise ValueError("--backend vllm picks its platform itself: leave --device at cpu")
        return VllmEngine(target, None, VllmOptions(dtype=dtype, max_model_len=2048, max_num_seqs=batch))
    if backend != "torch":
        raise ValueError(f"unknown backend {backend!r} (torch or vllm)")
    return SpeculativeEngine.load(target, None, dtype, device, max_sessions=batch, max_model_len=2048)


def answer(engine, convs: list[list[dict]], max_new_tokens: int) -> tuple[list[list[dict]], int]:
    """The target's replies to each conversation's user turns, in order, each turn in the context of
    its own earlier replies (a leading system message is kept); turn t of every conversation that
    has one is one batched ``engine.generate``. Returns the conversations with the target's replies
    in place of the dataset's, and the number of tokens written."""
    heads = [[m for m in c[:1] if m["role"] == "system"] for c in convs]
    users = [[m for m in c if m["role"] == "user"] for c in convs]
    keep = engine.max_model_len - max_new_tokens - 1
    tokens = 0
    for turn in range(max(map(len, users), default=0)):
        idx = [i for i, u in enumerate(users) if len(u) > turn]
        prompts = [prompt_ids(engine.tokenizer, heads[i] + [users[i][turn]])[-keep:] for i in idx]
        for i, res in zip(idx, engine.generate(prompts, max_new_tokens)):
            heads[i] = heads[i] + [users[i][turn], {"role": "assistant", "content": res.text}]
            tokens += res.num_tokens
    return heads, tokens


def regenerate(
    target: str,
    data_dir: str,
    out: str,
    per_file: int,
    max_new_tokens: int = 256,
    batch: int = 16,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    limit: int = 0,
    backend: str = "torch",
    all_turns: bool = False,
    system_prompt_share: float = 0.0,
    max_minutes: float = 0.0,
) -> Path:
    from tqdm import tqdm

    if per_file < 0 or max_new_tokens < 1 or batch < 1 or limit < 0 or max_minutes < 0:
        raise ValueError("max_new_tokens and batch must be >= 1, per_file, limit and max_minutes >= 0")
    if not 0.0 <= system_prompt_share <= 1.0:
        raise ValueError(f"system_prompt_share must be in [0, 1], got {system_prompt_share}")
    root = Path(out)
    done = answered_prompts(root / "self")
    convs = [
        (c if all_turns else _dataset_turns(c, 1), src)
        for c, src in load_conversations(data_dir, per_file, seed, with_source=True)
    ]
    todo = [(c, src) for c, src in convs if _prompt_key(_first_user(c)) not in done]
    already = len(convs) - len(todo)
    if limit:
        todo = todo[:limit]
    print(
        json.dumps(
            {
                "event": "regenerate",
                "sampled": len(convs),
                "already_answered": already,
                "to_answer": len(todo),
                "user_turns": sum(m["role"] == "user" for c, _ in todo for m in c),
            }
        ),
        flush=True,
    )
    if not todo:
        return root
    engine = _engine(backend, target, dtype, device, batch)
    try:
        system = default_system_prompt(engine.tokenizer) if system_prompt_share > 0 else None
        if system_prompt_share > 0 and system is None:
            raise ValueError("--system-prompt-share: the target's chat template inserts no default system prompt")
        self_path, orig_path = _new_shard(root)
        chunk_size = batch * 4  # continuous batching inside a chunk; the chunk bounds lost work on interrupt
        tokens, t0 = 0, time.perf_counter()
        answered = 0
        with (
            self_path.open("w") as f_self,
            orig_path.open("w") as f_orig,
            tqdm(total=len(todo), desc="regenerate", unit="conv") as bar,
        ):
            for i in range(0, len(todo), chunk_size):
                part = todo[i : i + chunk_size]
                chunk = [
                    (
                        [{"role": "system", "content": system}]
                        if system is not None and gets_system_prompt(_first_user(c), system_prompt_share)
                        else []
                    )
                    + c
                    for c, _ in part
                ]
                replies, n = answer(engine, chunk, max_new_tokens)
                for c, r, (_, src) in zip(chunk, replies, part):
                    f_self.write(json.dumps({"messages": r, "source": src}) + "\n")
                    f_orig.write(json.dumps({"messages": c, "source": src}) + "\n")
                tokens += n
                answered += len(part)
                f_self.flush()
                f_orig.flush()
                bar.update(len(chunk))
                bar.set_postfix(tokens=tokens, tok_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")
                if max_minutes and time.perf_counter() - t0 >= 60 * max_minutes:
                    break  # time-boxed after a whole chunk: it stays, and the next run goes on from there
    finally:
        if backend == "vllm":
            engine.close()
    wall = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "event": "done",
                "answered": answered,
                "left": len(todo) - answered,
                "tokens": tokens,
                "wall_s": round(wall, 1),
                "tokens_per_s": round(tokens / wall, 1),
            }
        ),
        flush=True,
    )
    return root
