"""Request bodies of the client-server API (``/v1/cs``; pydantic v2). They arrive as plain JSON
or as the JSON header of a binary frame (``moa_serve.client_server.wire``); unknown fields are rejected so
that a typo is a 400 naming the field."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from moa_serve.app.schemas import ChatMessage, _Body, exactly_one_of
from moa_serve.sampling import TEMPERATURE_MAX, SamplingParams, Seed, Temperature, TopK, TopP

SESSION_ID = r"^[A-Za-z0-9_-]{8,64}$"


class Fingerprints(_Body):
    """The client's target / tokenizer / drafter digests (``moa_serve.client_server.fingerprint``)."""

    target: str
    tokenizer: str
    drafter: str | None = None


class CreateSession(_Body):
    model_config = ConfigDict(
        json_schema_extra=exactly_one_of(("prompt", "string"), ("messages", "array"), ("token_ids", "array"))
    )

    session_id: str | None = Field(
        None,
        pattern=SESSION_ID,
        description="chosen by the client: makes a retried create idempotent; default: the server picks one",
    )
    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    token_ids: list[int] | None = Field(
        None,
        min_length=1,
        description="the prompt as token ids, or after a resync every token the client has committed",
    )
    max_tokens: int = Field(128, ge=1, le=32768, description="new tokens this session may commit")
    temperature: Temperature = Field(0.0, le=TEMPERATURE_MAX)
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed = None
    ignore_eos: bool = False
    fingerprints: Fingerprints
    want_features: bool = Field(True, description="the client's drafter reads the verifier's features (MoA, EAGLE)")
    feature_codec: Literal["float16", "int8"] = "float16"
    features_from: int = Field(0, ge=0, description="the client already holds the features of positions before this")

    @model_validator(mode="after")
    def _one_input(self):
        given = [n for n in ("prompt", "messages", "token_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, messages or token_ids")
        return self

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)


class VerifyRound(_Body):
    """One round; the drafter's distribution (when sampling) travels as the frame's
    ``draft_probs`` tensor [len(draft_ids), vocabulary or draft vocabulary]."""

    round: int = Field(ge=1, description="1 for the first verify after create, then +1 per answered round")
    committed_length: int = Field(ge=1, description="tokens the client holds as committed (prompt included)")
    draft_ids: list[int] = Field(default_factory=list)
    alternatives: list[list[int]] = Field(
        default_factory=list,
        description="tree drafts (greedy sessions): "
        "alternatives[i] are token ids verified beside draft_ids[i], as leaves",
    )
    features_from: int | None = Field(
        None, ge=0, description="resend features from this position (the client lost them)"
    )
