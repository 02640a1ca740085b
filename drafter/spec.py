"""What a drafter is, parsed once: :class:`DrafterSpec` from the config's and the CLI's drafter
text, and :class:`TreeShape` from a tree-draft shape. Both are plain, frozen values (no torch):
the config validates with them, the registry (:mod:`moa_serve.drafter.registry`) builds from them.

Drafter texts:

* a checkpoint folder, a packaged name or a hub id: that trained drafter (MoA, EAGLE-style or
  independent, by its ``config.json``);
* ``lookup``: prompt lookup, no model; ``hybrid:<checkpoint>``: prompt lookup where the text
  repeats, the checkpoint's drafts elsewhere;
* ``+outputs`` after either (``lookup+outputs``, ``hybrid+outputs:<checkpoint>``): the lookup reads
  the target's earlier replies too where the context has no match (:mod:`moa_serve.drafter.outputs`);
* ``None`` or ``"none"``: no drafter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

FORMAT = "moa-serve-drafter"  # ``config.json`` format of the checkpoints written here
PACKAGED = Path(__file__).resolve().parent / "checkpoints"

LOOKUP = "lookup"
OUTPUTS = "+outputs"
HYBRID = "hybrid"


def checkpoint_kind(raw: dict) -> str:
    """A checkpoint's kind from its ``config.json``: "moa", "eagle" or "independent" for ours, "moa"
    for the reference layout (it has no other)."""
    return raw.get("kind", "moa") if raw.get("format") == FORMAT else "moa"


class DrafterNotFoundError(ValueError):
    pass


def resolve_drafter_path(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    for cand in (p, PACKAGED / str(name_or_path)):
        if (cand / "config.json").is_file() and (cand / "model.safetensors").is_file():
            return cand.resolve()
    if str(name_or_path).count("/") == 1 and not p.exists():
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(str(name_or_path)))
        except Exception as exc:
            raise DrafterNotFoundError(
                f"drafter {name_or_path!r} is neither a local checkpoint folder nor one packaged with "
                f"moa-serve ({', '.join(sorted(x.name for x in PACKAGED.glob('*')) or ['none'])}), and the hub "
                f"could not provide it ({type(exc).__name__})"
            ) from exc
    raise DrafterNotFoundError(
        f"drafter {name_or_path!r} not found: expected config.json and model.safetensors in that folder"
    )


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed drafter text. ``lookup``: prompt lookup drafts (alone, or in front of the
    checkpoint: a hybrid); ``outputs``: the lookup reads the output store too; ``checkpoint``: the
    trained drafter loaded (None: none, or prompt lookup alone)."""

    lookup: bool = False
    outputs: bool = False
    checkpoint: str | None = None

    @classmethod
    def parse(cls, text: "str | DrafterSpec | None") -> DrafterSpec:
        if isinstance(text, DrafterSpec):
            return text
        if text is None or str(text) == "none":
            return cls()
        text = str(text)
        if text in (LOOKUP, LOOKUP + OUTPUTS):
            return cls(lookup=True, outputs=text.endswith(OUTPUTS))
        for prefix in (HYBRID + ":", HYBRID + OUTPUTS + ":"):
            if text.startswith(prefix):
                ckpt = text[len(prefix) :]
                if not ckpt:
                    raise DrafterNotFoundError(
                        f"drafter {text!r}: name a checkpoint after {prefix!r}, e.g. {prefix}smollm2-135m-instruct-moa"
                    )
                return cls(lookup=True, outputs=OUTPUTS in prefix, checkpoint=ckpt)
        return cls(checkpoint=text)

    def __bool__(self) -> bool:
        """Whether there is a drafter at all."""
        return self.lookup or self.checkpoint is not None

    def __str__(self) -> str:
        if self.lookup:
            outputs = OUTPUTS if self.outputs else ""
            return LOOKUP + outputs if self.checkpoint is None else f"{HYBRID}{outputs}:{self.checkpoint}"
        return self.checkpoint or "none"

    @property
    def hybrid(self) -> bool:
        return self.lookup and self.checkpoint is not None

    @cached_property
    def checkpoint_config(self) -> dict | None:
        """The checkpoint's ``config.json`` (None without a checkpoint)."""
        if self.checkpoint is None:
            return None
        return json.loads((resolve_drafter_path(self.checkpoint) / "config.json").read_text())

    @property
    def kind(self) -> str | None:
        """ "moa", "eagle" or "independent" from the checkpoint's config alone (the reference layout
        is always MoA); "lookup" for prompt lookup alone; None without a drafter. A hybrid has its
        checkpoint's kind (that is what decides the features it needs)."""
        raw = self.checkpoint_config
        if raw is None:
            return LOOKUP if self.lookup else None
        return checkpoint_kind(raw)

    @property
    def latest_feature_only(self) -> bool:
        """Whether the drafter's cross-attention reads only the freshest verified feature (an MoA
        drafter trained with ``cross_attention_latest_only``): then a position's feature is needed
        only while it is the latest, and the features of older positions need not travel."""
        raw = self.checkpoint_config
        return (
            raw is not None
            and raw.get("format") == FORMAT
            and checkpoint_kind(raw) == "moa"
            and bool(raw.get("cross_attention_latest_only", False))
        )


MAX_BRANCHING = 16


@dataclass(frozen=True)
class TreeShape:
    """Tree drafts: ``widths`` = candidates per draft depth (``(4, 2)``: the drafter's top 4 at the
    first depth, its top 2 at the second, the top 1 beyond; the top one is drafted on, the others
    are verified beside it as leaves); ``min_value`` > 0 makes the tree dynamic (EAGLE-2's idea): a
    candidate goes only if the drafter's own estimate that it is the target's token there (the
    product of the chain's top-1 probabilities before its depth, times its probability) reaches it."""

    widths: tuple[int, ...] = ()
    min_value: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.widths)

    @property
    def label(self) -> str:
        if not self.widths:
            return "chain"
        return "-".join(map(str, self.widths)) + (f"@{self.min_value:g}" if self.min_value > 0 else "")


def parse_branching(text: "str | TreeShape | tuple | list | None") -> TreeShape:
    """``"4-2-2"`` (fixed widths per depth), ``"8-3-2@0.05"`` (the same, candidates worth less than
    0.05 dropped: ``TreeShape.min_value``); ``""``, ``"1"`` or ``"chain"``: a plain chain."""
    if isinstance(text, TreeShape):
        return text
    if text is None:
        return TreeShape()
    min_value = 0.0
    if isinstance(text, (tuple, list)):
        widths = [int(w) for w in text]
    else:
        text = str(text).strip()
        if text in ("", "chain"):
            return TreeShape()
        shape, _, value = text.partition("@")
        try:
            widths = [int(w) for w in shape.split("-")]
            min_value = float(value) if value else 0.0
        except ValueError:
            raise ValueError(
                f"branching must look like 4-2-2 or 8-3-2@0.05 (candidates per draft depth, "
                f"optionally the least worth of a candidate); got {text!r}"
            ) from None
    if any(not 1 <= w <= MAX_BRANCHING for w in widths):
        raise ValueError(f"branching widths must be between 1 and {MAX_BRANCHING}; got {widths}")
    if not 0.0 <= min_value < 1.0:
        raise ValueError(f"branching: a candidate's least worth (after @) must be in [0, 1); got {min_value}")
    while widths and widths[-1] == 1:
        widths.pop()
    return TreeShape(tuple(widths), min_value if widths else 0.0)


def parse_branchings(text: str | None, keywords: tuple[str, ...] = ()) -> list:
    """Comma-separated shapes (``"chain,4-2,8-3-2@0.05"``), each once, in order; empty: a chain.
    A word in ``keywords`` (a caller's own choice, e.g. the client's ``auto``) stays that string."""
    return list(
        dict.fromkeys(b.strip() if b.strip() in keywords else parse_branching(b) for b in (text or "chain").split(","))
    )
