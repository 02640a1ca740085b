"""The application config that ``build_app(args)`` validates: the ``args`` block of a
``serve run`` YAML (deployments/configs/*.yaml) and of the KubeRay ``serveConfigV2``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AutoscalingConfig(_Strict):
    """Ray Serve ``autoscaling_config`` (the fields we set; Ray validates the rest)."""
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _range(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling_config.min_replicas must be <= max_replicas")
        return self


class RayActorOptions(_Strict):
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    memory: int | None = Field(None, ge=0, description="bytes")
    runtime_env: dict | None = None


class PoolConfig(_Strict):
    autoscaling_config: AutoscalingConfig = AutoscalingConfig()
    ray_actor_options: RayActorOptions = RayActorOptions()
    max_ongoing_requests: int = Field(8, ge=1)
    max_sessions: int = Field(16, ge=1, description="sessions whose caches one replica holds")
    torch_threads: int | None = Field(None, ge=1, description="default: ray_actor_options.num_cpus")


class RouterConfig(_Strict):
    autoscaling_config: AutoscalingConfig = AutoscalingConfig()
    ray_actor_options: RayActorOptions = RayActorOptions(num_cpus=0.5)
    max_ongoing_requests: int = Field(256, ge=1)
    max_queued_requests: int = Field(64, ge=0, description="waiting requests beyond which new ones get 429")
    max_sessions_per_round: int = Field(16, ge=1)
    session_groups: int = Field(2, ge=1, description="round loops; >= 2 lets one group draft while another verifies")
    retry_after_s: int = Field(2, ge=1)


class AppConfig(_Strict):
    target: str = Field(description="Hugging Face id or local path of the target LLM")
    drafter: str | None = Field(None, description="MoA drafter checkpoint folder; null = no speculation")
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    device: Literal["cpu", "cuda"] = "cpu"
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    adaptive_speculation: bool = Field(True, description="per session, draft about as many tokens as recently accepted (at most num_speculative_tokens)")
    max_model_len: int = Field(2048, ge=16)
    model_name: str | None = Field(None, description="name served by /v1/models; default: the target")
    router: RouterConfig = RouterConfig()
    verifier_pool: PoolConfig = PoolConfig()
    drafter_pool: PoolConfig = PoolConfig(ray_actor_options=RayActorOptions(num_cpus=0.5))
