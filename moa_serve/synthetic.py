"""Synthetic targets for benchmarks at a real model's shape (``load_format: dummy``, as vLLM's):
the architecture from a ``config.json``, the weights drawn at random on the device (no checkpoint
is read or moved), and, where the folder holds no tokenizer, a word-level tokenizer over the
config's vocabulary (token ``i`` is the word ``<i>``). The output is noise; what it measures is
the cost of serving that shape.

``moa_serve/shapes/`` ships the shapes (``llama-3-8b-shape``: Meta-Llama-3-8B-Instruct's
``config.json``); any Hugging Face model folder works too.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from moa_serve.model.layers import RMSNorm, Rotary
from moa_serve.model.target import TargetArch, TargetModel, rotary_for

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")  # auto: the folder's weights; dummy: random weights of its config
SHAPES = Path(__file__).resolve().parent / "shapes"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# the synthetic tokenizer's chat template: the messages' contents, one after another
_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def describe(load_format: str) -> str:
    """What ``/v1/models``, ``moa generate --json`` and the logs say of the weights."""
    return "synthetic: random weights (load_format dummy)" if load_format == "dummy" else "checkpoint"


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """N(0, 0.02) matrices and embeddings, zero biases, unit norms, drawn on the module's device."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.normal_(0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()


def random_target(hf_config, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> TargetModel:
    """A TargetModel of ``hf_config``'s architecture with random weights allocated and drawn on
    ``device`` (nothing crosses the bus), its rotary embedding set as a loaded model's is."""
    arch = TargetArch.from_hf_config(hf_config)
    with torch.device("meta"):
        model = TargetModel(arch, Rotary(torch.zeros(arch.head_dim // 2)))
    model = model.to(dtype).to_empty(device=torch.device(device))
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    randomize_(model, seed)
    model.rotary = rotary_for(hf_config, arch).to(device=device, dtype=dtype)
    log.warning(
        "target %s: %s, %d layers x %d wide, vocabulary %d: its output is noise",
        getattr(hf_config, "name_or_path", "") or arch.model_type,
        describe("dummy"),
        arch.num_layers,
        arch.hidden_size,
        arch.vocab_size,
    )
    return model.eval()


def has_tokenizer(path: Path) -> bool:
    return any((Path(path) / f).is_file() for f in _TOKENIZER_FILES)


def word_tokenizer(vocab_size: int, eos_token_id: int | None = None):
    """A fast tokenizer whose token ``i`` is the word ``<i>`` (``vocab_size`` of them): text splits
    on whitespace, an unknown word is ``<0>``; decoding gives the ``<i>`` words back."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = f"<{eos_token_id}>" if eos_token_id is not None and 0 <= eos_token_id < vocab_size else None
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", eos_token=eos)
    fast.chat_template = _CHAT_TEMPLATE
    return fast
