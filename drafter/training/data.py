"""Training data for drafter distillation: chat conversations -> token ids + response marks.

Conversations are rendered with the target's chat format, with a system prompt only where the
conversation has one (the paper trains without; ``moa regenerate --system-prompt-share`` gives part
of the data the template's default one, as served chat requests have it): for ChatML tokenizers
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, for tokenizers without a chat
template a plain ``User: ... / Assistant: ...`` format. Only assistant tokens are "response"
tokens (the loss is counted where the next token is one); a multi-turn conversation gives one
training window per assistant turn (``encode_turns``).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch


def _is_chatml(tok) -> bool:
    cached = getattr(tok, "_moa_is_chatml", None)
    if cached is None:
        cached = "<|im_start|>" in tok.get_vocab()
        try:
            tok._moa_is_chatml = cached
        except AttributeError:
            pass
    return cached


def render_segments(tok, messages: list[dict], add_generation_prompt: bool = False) -> list[tuple[list[int], bool]]:
    """[(token ids, is_response)] segments of a conversation (no system prompt unless given)."""
    segs: list[tuple[list[int], bool]] = []
    chatml = _is_chatml(tok)
    if not chatml and tok.bos_token_id is not None:
        segs.append(([tok.bos_token_id], False))
    for m in messages:
        role, content = m["role"], m["content"]
        if chatml:
            head = tok.encode(f"<|im_start|>{role}\n", add_special_tokens=False)
            body = tok.encode(f"{content}<|im_end|>", add_special_tokens=False)
            tail = tok.encode("\n", add_special_tokens=False)
        else:
            head = tok.encode(
                ("User: " if role == "user" else "Assistant: " if role == "assistant" else f"{role}: "),
                add_special_tokens=False,
            )
            body = tok.encode(content, add_special_tokens=False) + (
                [tok.eos_token_id] if role == "assistant" and tok.eos_token_id is not None else []
            )
            tail = tok.encode("\n", add_special_tokens=False)
        segs.append((head, False))
        segs.append((body, role == "assistant"))
        if role != "assistant" or m is not messages[-1]:
            segs.append((tail, False))
    if add_generation_prompt:
        head = tok.encode("<|im_start|>assistant\n" if chatml else "Assistant: ", add_special_tokens=False)
        segs.append((head, False))
    return segs


def prompt_ids(tok, messages: list[dict]) -> list[int]:
    """Token ids of a prompt (conversation so far + generation prompt), no system prompt."""
    return [t for ids, _ in render_segments(tok, messages, add_generation_prompt=True) for t in ids]


def default_system_prompt(tok) -> str | None:
    """The system prompt the tokenizer's chat template inserts when a conversation has none (what a
    served chat request is rendered with: SmolLM2's "You are a helpful AI assistant named SmolLM,
    ..."), or None if the template adds none (or there is no template)."""
    if not getattr(tok, "chat_template", None):
        return None
    probe = "\x00probe\x00"
    text = tok.apply_chat_template([{"role": "user", "content": probe}], tokenize=False)
    head = "<|im_start|>system\n"
    if not text.startswith(head) or "<|im_end|>" not in text.split(probe)[0]:
        return None
    return text[len(head) : text.index("<|im_end|>")]


def encode_conversation(tok, messages: list[dict], max_len: int, max_prompt: int = 0) -> tuple[list[int], list[bool]]:
    """Token ids and response marks, truncated to ``max_len``; with ``max_prompt`` the text before
    the first response token is cut from the left to that many tokens (spends the budget on
    response tokens, where the loss is)."""
    ids, resp = [], []
    for seg, is_resp in render_segments(tok, messages):
        ids += seg
        resp += [is_resp] * len(seg)
    return _cut(ids, resp, max_len, max_prompt)


def encode_turns(tok, messages: list[dict], max_len: int, max_prompt: int = 0) -> list[tuple[list[int], list[bool]]]:
    """One (ids, response marks) window per assistant turn: the conversation up to and including
    that turn, only its reply marked as response (earlier replies are context there, and trained in
    their own windows), cut as ``encode_conversation`` cuts. A single-turn conversation gives exactly
    ``encode_conversation``'s window; a multi-turn one no longer loses every turn past ``max_len``."""
    if sum(m["role"] == "assistant" for m in messages) <= 1:
        return [encode_conversation(tok, messages, max_len, max_prompt)]
    segs = render_segments(tok, messages)  # a turn's window is the segments up to its reply's body
    out = []
    for last in (i for i, (_, is_resp) in enumerate(segs) if is_resp):
        ids = [t for seg, _ in segs[: last + 1] for t in seg]
        resp = [i == last for i, (seg, _) in enumerate(segs[: last + 1]) for _ in seg]
        out.append(_cut(ids, resp, max_len, max_prompt))
    return out


def _cut(ids: list[int], resp: list[bool], max_len: int, max_prompt: int) -> tuple[list[int], list[bool]]:
    """``max_prompt``: the text before the first response token cut from the left to that many
    tokens; then at most ``max_len`` tokens."""
    if max_prompt and True in resp:
        cut = max(0, resp.index(True) - max_prompt)
        ids, resp = ids[cut:], resp[cut:]
    return ids[:max_len], resp[:max_len]


@dataclass
class Example:
    ids: list[int]
    response: list[bool]


def read_rows(path: Path) -> list[dict]:
    """The JSON rows of a ``.jsonl`` file (blank lines skipped: row i is the i-th non-blank line)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def load_conversations(
    data_dir: str | Path, per_file: int = 0, seed: int = 0, files: list[str] | None = None, with_source: bool = False
) -> list:
    """Conversations from every ``*.jsonl`` of ``data_dir`` (at most ``per_file`` each, sampled;
    a larger ``per_file`` keeps the smaller one's sample). ``with_source``: (messages,
    ``{"file": name, "row": i}``) pairs instead."""
    rng = random.Random(seed)
    out = []
    paths = sorted(Path(data_dir).glob("*.jsonl"))
    if files:
        paths = [p for p in paths if p.stem in files or p.name in files]
    for p in paths:
        rows = [(r["messages"], {"file": p.name, "row": i}) for i, r in enumerate(read_rows(p))]
        rng.shuffle(rows)
        out += rows[:per_file] if per_file else rows
    rng.shuffle(out)
    return out if with_source else [m for m, _ in out]


def build_examples(tok, conversations, max_len: int, min_response: int = 4, max_prompt: int = 0) -> list[Example]:
    out = []
    for conv in conversations:
        for ids, resp in encode_turns(tok, conv, max_len, max_prompt):
            if sum(resp) >= min_response:
                out.append(Example(ids, resp))
    return out


def response_counts(examples: list[Example]) -> Counter:
    """How often each token occurs in the examples' responses."""
    return Counter(t for e in examples for t, r in zip(e.ids, e.response) if r)


def stop_token_ids(tok, vocab_size: int) -> list[int]:
    """The tokens that end a reply (end of sequence, ChatML's ``<|im_end|>``): a draft vocabulary
    always keeps them."""
    ids = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    return sorted(t for t in ids if isinstance(t, int) and 0 <= t < vocab_size)


def _share(counts: Counter, keep) -> float:
    return sum(counts[t] for t in set(keep)) / max(1, sum(counts.values()))


def top_vocab(examples: list[Example], size: int, always: list[int] = ()) -> tuple[torch.Tensor, float]:
    """Most frequent response tokens (plus ``always``), sorted ids, and their share of response tokens."""
    counts = response_counts(examples)
    keep = list(dict.fromkeys(list(always) + [t for t, _ in counts.most_common(size)]))[:size]
    return torch.tensor(sorted(keep), dtype=torch.long), _share(counts, keep)


def vocab_coverage(examples: list[Example], vocab: torch.Tensor) -> float:
    """Share of the examples' response tokens that ``vocab`` holds."""
    return _share(response_counts(examples), vocab.tolist())


def batch_plan(examples: list[Example], batch_size: int, seed: int, pool: int = 16):
    """Endless stream of batches as lists of example indices: shuffled each epoch, sequences of
    similar length batched together (padding is wasted compute). A function of ``seed`` alone, so
    the n-th batch is the same in every run: the training state records how many were consumed."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        chunk = batch_size * pool
        for c in range(0, len(order), chunk):
            group = sorted(order[c : c + chunk], key=lambda i: len(examples[i].ids))
            bs = [group[i : i + batch_size] for i in range(0, len(group), batch_size)]
            rng.shuffle(bs)
            yield from bs


def batches(examples: list[Example], batch_size: int, seed: int, pool: int = 16, start: int = 0):
    """Endless stream of (tokens [B,S], response [B,S], valid [B,S]) from ``batch_plan``, from its
    ``start``-th batch on (the ones before are skipped without being built)."""
    for n, b in enumerate(batch_plan(examples, batch_size, seed, pool)):
        if n >= start:
            yield collate([examples[i] for i in b])


class BatchStream(torch.utils.data.IterableDataset):
    """``batches`` for a ``torch.utils.data.DataLoader`` (``batch_size=None``): with workers, worker
    w builds batches w, w + n, w + 2n, ... and the loader hands them out in turn, so the order is
    ``batches``' for any number of workers."""

    def __init__(self, examples: list[Example], batch_size: int, seed: int, start: int = 0):
        self.examples, self.batch_size, self.seed, self.start = examples, batch_size, seed, start

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        plan = batch_plan(self.examples, self.batch_size, self.seed)
        for n, b in enumerate(plan):
            if n >= self.start and (n - self.start) % workers == worker:
                yield collate([self.examples[i] for i in b])


def loader(examples: list[Example], batch_size: int, seed: int, start: int, workers: int, pin_memory: bool):
    """Batches from ``start`` on, built by ``workers`` processes ahead of the training step (0: in
    the training process, as it goes), in pinned memory for asynchronous copies to a GPU."""
    stream = BatchStream(examples, batch_size, seed, start)
    extra = dict(prefetch_factor=4) if workers else {}
    # a generator of its own: starting the loader draws a seed, which must not move the global RNG
    # the training step draws from (a resumed run draws what an uninterrupted one does)
    gen = torch.Generator().manual_seed(seed)
    return iter(
        torch.utils.data.DataLoader(
            stream, batch_size=None, num_workers=workers, pin_memory=pin_memory, generator=gen, **extra
        )
    )


def collate(exs: list[Example]):
    s = max(len(e.ids) for e in exs)
    tokens = torch.zeros(len(exs), s, dtype=torch.long)
    resp = torch.zeros(len(exs), s, dtype=torch.bool)
    valid = torch.zeros(len(exs), s, dtype=torch.bool)
    for b, e in enumerate(exs):
        n = len(e.ids)
        tokens[b, :n] = torch.tensor(e.ids)
        resp[b, :n] = torch.tensor(e.response)
        valid[b, :n] = True
    return tokens, resp, valid
