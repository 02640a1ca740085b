"""Request and response bodies of the HTTP API (pydantic v2). Unknown fields are rejected so
that a typo is a 400 naming the field, not a silently ignored parameter."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moa_serve.engine.sampling import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = None


class SamplingFields(_Body):
    temperature: float = Field(0.0, ge=0.0, le=10.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = off")
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = Field(None, description="stop strings (not included in the output)")
    ignore_eos: bool = False
    num_speculative_tokens: int | None = Field(None, ge=1, le=16, description="default: the server's")

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class GenerateRequest(SamplingFields):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int = Field(128, ge=1, le=32768)
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        return self


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAIFields(SamplingFields):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=32768)
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported; must be 0")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported; must be 0")
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default


class CompletionRequest(_OpenAIFields):
    prompt: str | list[str]
    echo: bool = Field(False, description="not supported; must be false")

    @model_validator(mode="after")
    def _single_prompt(self):
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt: exactly one prompt per request is supported")
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatCompletionRequest(_OpenAIFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeStats(BaseModel):
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    mean_accepted_length: float


class GenerateResponse(BaseModel):
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    speculative: SpeculativeStats
