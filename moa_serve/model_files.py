"""Finding and loading target models.

A model is named as a user would name it to Hugging Face (``HuggingFaceTB/SmolLM2-135M-Instruct``)
or by a local path. ``MOA_MODEL_DIR`` maps names to local copies (this environment has no hub):
``$MOA_MODEL_DIR/<name>``, ``$MOA_MODEL_DIR/<basename>`` and its lower-case form are tried, after the
model shapes shipped for synthetic targets (``moa_serve/shapes/<basename>``: a config.json alone).
GGUF-only folders are de-quantized once through transformers and cached as safetensors under
``$MOA_CACHE_DIR`` (default ``~/.cache/moa-serve``).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from moa_serve.kernels import cpu as cpu_kernels
from moa_serve.kernels.packed import gguf_file
from moa_serve.local_cache import cache_dir
from moa_serve.synthetic import SHAPES

log = logging.getLogger(__name__)


class ModelNotFoundError(ValueError):
    pass


# what a hub download fetches: config, tokenizer and safetensors weights (never .bin/.pth/ONNX/GGUF
# copies of the same weights); ``weights=False`` (the router) takes config + tokenizer only
_HUB_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def resolve_model_path(name_or_path: str, weights: bool = True) -> Path:
    """Local folder holding ``config.json`` for a model name or path; downloads from the hub
    when the name is not local (and says clearly when that is impossible)."""
    if not name_or_path or not str(name_or_path).strip():
        raise ModelNotFoundError("model name is empty")
    p = Path(name_or_path).expanduser()
    if (p / "config.json").is_file():
        return p.resolve()
    model_dir = os.environ.get("MOA_MODEL_DIR")
    tried = [str(p)]
    shape = SHAPES / str(name_or_path).rstrip("/").split("/")[-1]  # the shipped shapes of synthetic targets
    if (shape / "config.json").is_file():
        return shape.resolve()
    if model_dir:
        base = Path(model_dir).expanduser()
        short = str(name_or_path).rstrip("/").split("/")[-1]
        for cand in (base / name_or_path, base / short, base / short.lower()):
            tried.append(str(cand))
            if (cand / "config.json").is_file():
                return cand.resolve()
    looks_like_path = p.is_absolute() or str(name_or_path).startswith((".", "~")) or p.exists()
    if not looks_like_path and str(name_or_path).count("/") == 1:
        try:
            from huggingface_hub import snapshot_download

            return Path(
                snapshot_download(str(name_or_path), allow_patterns=_HUB_FILES + (["*.safetensors"] if weights else []))
            )
        except Exception as exc:  # offline, gated, unknown id
            raise ModelNotFoundError(
                f"model {name_or_path!r} is not a local folder (tried {', '.join(tried)}) and could not be "
                f"fetched from the Hugging Face hub ({type(exc).__name__}). Set MOA_MODEL_DIR to a folder of "
                f"local copies or pass a path."
            ) from exc
    raise ModelNotFoundError(f"model {name_or_path!r} not found: no config.json at {', '.join(tried)}")


def read_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def load_tokenizer(path: Path, load_format: str = "auto"):
    """The model's tokenizer; with ``load_format`` dummy (a synthetic target) from a folder that holds
    none, a word-level tokenizer over the config's vocabulary (``moa_serve/synthetic.py``)."""
    from moa_serve import synthetic

    if load_format == "dummy" and not synthetic.has_tokenizer(path):
        cfg = read_config(path)
        eos = getattr(cfg, "eos_token_id", None)
        return synthetic.word_tokenizer(cfg.vocab_size, eos[0] if isinstance(eos, list) else eos)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _safetensors_files(path: Path) -> list[str]:
    return sorted(glob.glob(str(path / "*.safetensors")))


def _converted_gguf(path: Path, gguf: str) -> Path:
    """De-quantize a GGUF once (through transformers) into a cached safetensors file."""
    st = os.stat(gguf)
    key = hashlib.sha256(f"{os.path.abspath(gguf)}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    out = cache_dir() / "converted" / f"{path.name}-{key}"
    target = out / "model.safetensors"
    if target.is_file():
        return target
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    log.warning("de-quantizing %s once into %s (about 15 s)", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(str(path), gguf_file=os.path.basename(gguf), dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"model.safetensors.tmp{os.getpid()}"
    save_file(state, str(tmp))
    os.replace(tmp, target)
    return target


def hf_folder(path: Path) -> Path:
    """A Hugging Face folder (config, tokenizer, safetensors) for loaders that read folders only
    (vLLM): ``path`` itself when it holds safetensors; for a GGUF-only folder, a cached folder of
    links to its config/tokenizer files and to the de-quantized float32 safetensors."""
    path = Path(path)
    if _safetensors_files(path):
        return path
    ggufs = sorted(glob.glob(str(path / "*.gguf")))
    if not ggufs:
        raise ModelNotFoundError(f"{path}: neither safetensors nor GGUF weights")
    weights = _converted_gguf(path, ggufs[0])
    out = weights.parent / "hf"
    out.mkdir(exist_ok=True)
    for f in list(path.iterdir()) + [weights]:
        if f.suffix == ".gguf" or f.is_dir():
            continue
        link = out / f.name
        if not link.exists():
            try:
                link.symlink_to(f.resolve())
            except FileExistsError:  # another process made it
                pass
    return out


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of a causal LM folder (safetensors, GGUF, or anything
    ``from_pretrained`` reads), on CPU in the stored dtype."""
    from safetensors.torch import load_file

    files = _safetensors_files(path)
    if not files:
        ggufs = sorted(glob.glob(str(path / "*.gguf")))
        if ggufs:
            files = [str(_converted_gguf(path, ggufs[0]))]
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        return state
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path)).state_dict()


def load_selected_tensors(path: Path, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """Only the tensors of a causal LM folder whose names satisfy ``keep``, on CPU in the stored
    dtype. Safetensors files (sharded or not) are read selectively (``safe_open``: the other
    tensors are never read); a GGUF-only folder is converted once into the cached safetensors
    file (as ``load_state_dict`` does), then read the same way. Anything else is loaded whole
    through transformers and filtered."""
    from safetensors import safe_open

    files = _safetensors_files(path)
    if not files:
        ggufs = sorted(glob.glob(str(path / "*.gguf")))
        if ggufs:
            files = [str(_converted_gguf(path, ggufs[0]))]
    if not files:
        return {k: v for k, v in load_state_dict(path).items() if keep(k)}
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                if keep(k):
                    out[k] = st.get_tensor(k)
    return out


def _runs_packed(path: Path) -> bool:
    """Whether a float32 target in ``path`` would run through the packed GGUF cpu_kernels."""
    return path.is_dir() and gguf_file(path) is not None and cpu_kernels.library() is not None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX). Without it (e.g. AVX2-only
    CPUs) PyTorch emulates bf16 matmuls, several times slower than float32 ones."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def parse_dtype(
    name: str | torch.dtype, device: str | torch.device = "cpu", target: str | Path | None = None
) -> torch.dtype:
    """A dtype by name. ``auto`` is bfloat16 on GPUs; on a CPU it is float32 when the ``target``
    folder holds a GGUF (in float32 the target runs through the packed kernels over the file's
    quantized blocks, faster than bf16 even on CPUs with native bf16: docs/benchmarks.md#kernels),
    else bfloat16 on CPUs with native bf16 and float32 on the others (where bf16 is
    emulated and slower than float32)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        if torch.device(device).type != "cpu":
            return torch.bfloat16
        if target is not None and _runs_packed(Path(target)):
            return torch.float32
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {name!r}")
    return table[name]


def target_dtype(
    name: str | torch.dtype,
    device: str | torch.device = "cpu",
    path: Path | None = None,
    model: torch.nn.Module | None = None,
) -> torch.dtype:
    """:func:`parse_dtype` for a target: ``auto`` takes the dtype of an already built ``model``
    (an in-process engine's), else decides from the target folder ``path``."""
    if name == "auto" and model is not None:
        return next(model.parameters()).dtype
    return parse_dtype(name, device, path)


def stop_token_ids(path, tokenizer) -> frozenset[int]:
    """The target's end-of-sequence ids: its generation config's and its tokenizer's."""
    from transformers import GenerationConfig

    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(str(path)).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
