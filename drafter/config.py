"""Configuration of a MoA drafter: the target dimensions it reads plus its own sizes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from moa_serve.drafter.spec import FORMAT
from moa_serve.model.layers import LayerShape
from moa_serve.model.target import TargetArch

KINDS = ("moa", "eagle", "independent")


@dataclass(frozen=True)
class DrafterConfig:
    target: TargetArch
    target_name_or_path: str = ""
    layer_self_attention_num_key_value_heads: int = 0  # 0 = target's num_kv_heads
    layer_self_attention_intermediate_size: int = 0  # 0 = 2 x LSA width
    self_attention_num_key_value_heads: int = 0
    self_attention_intermediate_size: int = 0  # 0 = target's intermediate size
    cross_attention_num_key_value_heads: int = 0
    cross_attention_intermediate_size: int = 0
    target_layer_inference: int = 0
    draft_vocab_size: int = 0  # 0 = full vocabulary; else the drafter's LM head keeps a subset
    kind: str = "moa"  # "moa" | "eagle" (EAGLE-style baseline) | "independent" (small LM baseline)
    num_layers: int = 0  # decoder layers of the "independent" baseline (0 = 2)
    # MoA beyond the paper: a linear map from the *values* of the target's last N layers straight
    # into the feature, added to the LSA's (0 = the paper's LSA only). Values carry no RoPE, so
    # the map does not depend on the position; see FeatureHead.
    value_readout_layers: int = 0
    # MoA beyond the paper: the CA reads only the freshest verified feature (a draft at distance d
    # reads the feature of the position it was drafted from) instead of every verified one.
    cross_attention_latest_only: bool = False

    def __post_init__(self):
        t = self.target
        defaults = {
            "layer_self_attention_num_key_value_heads": t.num_kv_heads,
            "layer_self_attention_intermediate_size": 2 * t.kv_width,
            "self_attention_num_key_value_heads": t.num_kv_heads,
            "self_attention_intermediate_size": t.intermediate_size,
            "cross_attention_num_key_value_heads": t.num_kv_heads,
            "cross_attention_intermediate_size": t.intermediate_size,
        }
        for name, value in defaults.items():
            if not getattr(self, name):
                object.__setattr__(self, name, value)
        if self.target_layer_inference not in range(0, t.num_layers + 1):
            raise ValueError(
                f"target_layer_inference must be in [0, {t.num_layers}], got {self.target_layer_inference}"
            )
        if not 0 <= self.value_readout_layers <= t.num_layers:
            raise ValueError(f"value_readout_layers must be in [0, {t.num_layers}], got {self.value_readout_layers}")
        if self.kind not in KINDS:
            raise ValueError(f"drafter kind must be one of {KINDS}, got {self.kind!r}")
        if self.draft_vocab_size < 0 or self.draft_vocab_size > t.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [0, {t.vocab_size}]")

    # --- shapes of the three layers (the reference code's config2 variations) ---
    def lsa_shape(self) -> LayerShape:
        t = self.target
        width = t.kv_width
        return self._layer_shape(
            width,
            self.layer_self_attention_num_key_value_heads,
            width // t.num_heads,
            self.layer_self_attention_intermediate_size,
            t.qkv_bias,
        )

    def sa_shape(self) -> LayerShape:
        t = self.target
        return self._layer_shape(
            t.hidden_size,
            self.self_attention_num_key_value_heads,
            t.head_dim,
            self.self_attention_intermediate_size,
            t.qkv_bias,
        )

    def ca_shape(self) -> LayerShape:
        t = self.target
        return self._layer_shape(
            t.hidden_size,
            self.cross_attention_num_key_value_heads,
            t.head_dim,
            self.cross_attention_intermediate_size,
            False,
        )

    def _layer_shape(self, hidden: int, kv_heads: int, head_dim: int, intermediate: int, qkv_bias: bool) -> LayerShape:
        """A drafter layer with the target's query heads and norm epsilon."""
        t = self.target
        return LayerShape(hidden, t.num_heads, kv_heads, head_dim, intermediate, t.rms_norm_eps, qkv_bias)

    @property
    def feature_dim(self) -> int:
        return self.target.hidden_size

    def to_dict(self) -> dict:
        d = asdict(self)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        d = dict(d)
        d.pop("format", None)
        target = TargetArch(**d.pop("target"))
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown drafter config fields: {sorted(unknown)}")
        return cls(target=target, **d)
