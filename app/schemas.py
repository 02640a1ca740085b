"""Request and response bodies of the HTTP API (pydantic v2). Unknown fields are rejected so
that a typo is a 400 naming the field, not a silently ignored parameter; values are validated
strictly (no ``"1"`` for a number, no ``0`` for false; ``2.0`` is the integer 2, as in JSON
Schema), so what the OpenAPI schema accepts is what the server accepts. Every error is an ``ErrorResponse``:
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moa_serve.app.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, Stop
from moa_serve.grammar import GrammarSpec
from moa_serve.sampling import TEMPERATURE_MAX, SamplingParams, Seed, Temperature, TopK, TopP
from moa_serve.verifier.logprobs import MAX_TOP_LOGPROBS


def _integral(value):
    """JSON Schema's integer includes 2.0: a float without a fraction is the int it equals."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _integral_floats(cls, value):
        return _integral(value)  # strict int fields take 2.0; float fields take the int back as 2.0


def exactly_one_of(*fields: tuple[str, str]) -> dict:
    """``json_schema_extra`` of a body that needs exactly one of some nullable fields given
    non-null: ``(name, JSON type)`` each."""
    return {"oneOf": [{"required": [name], "properties": {name: {"type": kind}}} for name, kind in fields]}


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = None


class SamplingFields(_Body):
    """The sampling parameters, typed once in ``moa_serve.sampling``: NaN, infinities and values out
    of range are a 400 naming the field; a temperature below ``SAMPLING_EPS`` is greedy."""

    temperature: Temperature = Field(0.0, le=TEMPERATURE_MAX)
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed = None
    stop: Stop = Field(
        None,
        description=f"stop strings (not included in the output): at most {MAX_STOP_STRINGS}, "
        f"of at most {MAX_STOP_CHARS} characters each",
    )
    ignore_eos: bool = False
    num_speculative_tokens: int | None = Field(None, ge=1, le=16, description="default: the server's")

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


LOGPROBS_DOC = (
    "the target's log-probabilities (its distribution before temperature, top-p and top-k), from "
    "the logits that verified each token"
)


class GenerateRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra=exactly_one_of(("prompt", "string"), ("messages", "array")))

    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    max_tokens: int = Field(128, ge=1, le=32768)
    stream: bool = False
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description=f"{LOGPROBS_DOC}: each token's, with this many alternatives"
    )

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``: the schema the reply must validate against."""

    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict = Field(alias="schema", description="a JSON Schema (the object the reply must be)")
    strict: bool | None = None


class _Format(BaseModel):
    """A member of the ``response_format`` union, told apart by ``type`` (a discriminator takes no
    ``_Body`` before-validator)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TextFormat(_Format):
    type: Literal["text"]


class JsonObjectFormat(_Format):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Format):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


# OpenAI's ``response_format``: free text, any JSON object, or JSON that validates against ``json_schema.schema``
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` (an extra body field of the openai client): exactly one of a
    JSON schema, any JSON object, a regular expression, or a choice among strings."""

    model_config = ConfigDict(
        json_schema_extra=exactly_one_of(
            ("json", "object"), ("json_object", "boolean"), ("regex", "string"), ("choice", "array")
        )
    )

    json_: dict | None = Field(None, alias="json", description="a JSON Schema the reply validates against")
    json_object: Literal[True] | None = Field(None, description="true: any JSON object")
    regex: str | None = Field(None, min_length=1, description="a regular expression the whole reply matches")
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, description="the reply is exactly one of these strings"
    )

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [self.json_ is not None, self.json_object is not None, self.regex is not None, self.choice is not None]
        if sum(given) != 1:
            raise ValueError("give exactly one of json, json_object: true, regex, choice")
        return self

    def spec(self) -> GrammarSpec:
        if self.json_ is not None:
            return GrammarSpec.json_schema(self.json_)
        if self.json_object:
            return GrammarSpec("json_object")
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        return GrammarSpec.choice(self.choice)


MAX_CHOICES = 16  # n: sessions one request may start (each holds a KV slot while it runs)


# response_format and structured_outputs not both (the schema of every OpenAI body)
ONE_GRAMMAR = {
    "not": {
        "required": ["response_format", "structured_outputs"],
        "properties": {"response_format": {"type": "object"}, "structured_outputs": {"type": "object"}},
    }
}


class _OpenAIFields(SamplingFields):
    model_config = ConfigDict(json_schema_extra=ONE_GRAMMAR)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=32768)
    n: int = Field(
        1,
        ge=1,
        le=MAX_CHOICES,
        description="independent choices of the one prompt (its prefill shared); choice i samples with seed + i; "
        "greedy choices are all the same",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, allow_inf_nan=False, description="not supported; must be 0")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, allow_inf_nan=False, description="not supported; must be 0")
    temperature: Temperature = Field(1.0, le=2.0)  # OpenAI's default and range
    response_format: ResponseFormat | None = Field(
        None, description="json_object or json_schema: the reply is JSON (that validates against the schema)"
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's structured outputs: json, json_object, regex or choice"
    )

    @model_validator(mode="after")
    def _one_grammar(self):
        if self.structured_outputs is not None and self.response_format is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def grammar(self) -> tuple[GrammarSpec, str] | None:
        """The structured output asked for and the field that asked, or None (free text)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.spec(), "structured_outputs"
        fmt = self.response_format
        if fmt is None or isinstance(fmt, TextFormat):
            return None
        if fmt.type == "json_object":
            return GrammarSpec("json_object"), "response_format"
        return GrammarSpec.json_schema(fmt.json_schema.schema_), "response_format"


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
ONE_PROMPT = "exactly one prompt per request is supported"


class CompletionRequest(_OpenAIFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[
            list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1, description=ONE_PROMPT)
        ]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1, description=ONE_PROMPT)]
    )
    max_tokens: int | None = Field(None, ge=0, le=32768, description="0: with echo, score the prompt only")
    echo: bool = Field(False, description="the prompt before the completion (with logprobs: its tokens' too)")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description=f"{LOGPROBS_DOC}: each token's, with this many alternatives"
    )

    def prompt_input(self) -> str | list[int]:
        """The prompt: text, or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return self.prompt
        return self.prompt[0]


class ChatCompletionRequest(_OpenAIFields):
    # top_logprobs only with logprobs: true (as OpenAI's API); one grammar field at most
    model_config = ConfigDict(
        json_schema_extra={
            **ONE_GRAMMAR,
            "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    logprobs: bool = Field(False, description=f"{LOGPROBS_DOC}: each token's")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token (needs logprobs: true)"
    )

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info):
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token when log-probabilities are asked (None: not asked)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeStats(BaseModel):
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    mean_accepted_length: float


class TopLogprob(BaseModel):
    token_id: int
    logprob: float


class TokenLogprob(BaseModel):
    token_id: int
    logprob: float
    top_logprobs: list[TopLogprob]


class GenerateResponse(BaseModel):
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    speculative: SpeculativeStats
    logprobs: list[TokenLogprob] | None = Field(None, description="one per token id, when asked")


class ReadyStatus(BaseModel):
    """``GET /readyz``: 200 when every pool answers, 503 (with each pool's error) before that."""

    model_config = ConfigDict(extra="allow")
    ready: bool


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")  # client-server resyncs add expected_length, expected_round
    message: str
    type: str = Field(
        description="invalid_request_error (400), not_found_error (404), rate_limit_error (429), "
        "service_unavailable (503), server_error (500), http_error (404 route, 405 method), "
        "client-server mode: resync, conflict, finished (409)"
    )
    param: str | None = Field(
        description="the offending field, dotted for nested ones (messages.0.role); "
        "'body' for the body as a whole; null when no field is at fault"
    )
    code: int = Field(description="the HTTP status")


class ErrorResponse(BaseModel):
    """The body of every 4xx and 5xx answer (as OpenAI's API): bad input is a 400 naming the field."""

    error: ErrorDetail
