"""The target as the harnesses load it in one process: its weights (or a synthetic model), dtype,
tokenizer and stop tokens, and the packed CPU kernels a verifier replica runs it on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moa_serve.kernels.packed import pack_target
from moa_serve.model.target import TargetModel
from moa_serve.model_files import (
    load_state_dict,
    load_tokenizer,
    parse_dtype,
    read_config,
    resolve_model_path,
    stop_token_ids,
)
from moa_serve.synthetic import random_target


@dataclass
class LoadedTarget:
    path: Path
    model: TargetModel
    dtype: torch.dtype
    tokenizer: object
    stops: list[int]
    packing: dict  # what pack_target did ({"packed": 0, ...}: the model runs unpacked)


def load_target(
    target: str,
    dtype: str,
    device: str,
    load_format: str = "auto",
    packed_weights: str = "auto",
    matmul_precision: str = "highest",
) -> LoadedTarget:
    """``target``'s model in ``dtype`` on ``device``; ``load_format`` dummy: random weights of its
    config (never packed); ``packed_weights`` auto: its linear layers on the packed kernels."""
    path = resolve_model_path(target)
    dt = parse_dtype(dtype, device, path)
    if load_format == "dummy":
        model = random_target(read_config(path), dt, device)
        packing = {"packed": 0, "reason": "--load-format dummy"}
    else:
        model = TargetModel.from_state_dict(read_config(path), load_state_dict(path), dt, device)
        packing = (
            pack_target(model, path, matmul_precision)
            if packed_weights == "auto"
            else {"packed": 0, "reason": "--packed-weights off"}
        )
    tokenizer = load_tokenizer(path, load_format)
    return LoadedTarget(path, model, dt, tokenizer, stop_token_ids(path, tokenizer), packing)
