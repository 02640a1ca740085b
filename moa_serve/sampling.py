"""Sampling parameters of one request, validated once at the edge and carried per session, and the
sampling primitives every side shares: warping logits into probabilities, seeded generators that
depend only on (seed, position, stream) so replicas and rounds agree, and drawing a token.

The field types below (``Temperature``, ``TopP``, ``TopK``, ``Seed``) are the one definition of
what each sampling parameter accepts: ``SamplingParams`` and every request body that carries
sampling parameters (``app/schemas.py``, ``app/client_server_schemas.py``) use them, so the HTTP routes, the
client-server protocol and the CLIs refuse the same values with an error naming the field. A float
field takes finite numbers only (NaN and infinities are refused, never compared); a positive
temperature below ``SAMPLING_EPS`` is greedy decoding (dividing logits by it would overflow
float32 and turn the distribution into NaN)."""

from __future__ import annotations

import hashlib
from typing import Annotated

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

SAMPLING_EPS = 1e-5  # as vLLM's vllm.sampling_params._SAMPLING_EPS: a temperature below it is greedy
# the largest integer every JSON parser holds exactly (I-JSON): a bound that a schema validator comparing
# as doubles checks as the server does; well within the 64-bit seeds of torch and vLLM generators
SEED_MAX = 2**53 - 1
TEMPERATURE_MAX = 10.0


def _greedy_below_eps(temperature: float) -> float:
    return 0.0 if temperature < SAMPLING_EPS else temperature


Temperature = Annotated[
    float,
    Field(
        ge=0.0,
        allow_inf_nan=False,
        description=(f"0 = greedy; a temperature below {SAMPLING_EPS:g} is greedy too (as in vLLM)"),
    ),
    AfterValidator(_greedy_below_eps),
]
TopP = Annotated[
    float,
    Field(
        gt=0.0,
        le=1.0,
        allow_inf_nan=False,
        description=(
            "nucleus sampling: the smallest set of most likely tokens whose probability reaches top_p (at least the "
            "most likely token); 1 = off"
        ),
    ),
]
TopK = Annotated[int, Field(ge=0, description="0 = no top-k filtering; at least the vocabulary = off")]
Seed = Annotated[int | None, Field(ge=0, le=SEED_MAX, description="makes sampling reproducible")]


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: Temperature = Field(0.0, le=TEMPERATURE_MAX)
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] (float32) after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        drop_sorted = before >= params.top_p  # keeps the smallest prefix whose mass reaches top_p
        drop_sorted[..., 0] = False  # ... never empty: a top_p that rounds to 0 in float32 keeps the top token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def generator_for(params: SamplingParams, position: int, stream: str, device="cpu") -> torch.Generator | None:
    """A generator that depends only on (seed, position, stream): reproducible across replicas
    and rounds; ``None`` (global RNG) when the request has no seed."""
    if params.seed is None:
        return None
    digest = hashlib.blake2b(f"{params.seed}:{position}:{stream}".encode(), digest_size=8).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF)
    return gen


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))
