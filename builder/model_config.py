"""The model description the builder exports from, independent of the checkpoint format."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


class UnsupportedModelError(ValueError):
    """The checkpoint names an architecture, or lacks a tensor, that the builder cannot export."""


@dataclass
class ModelConfig:
    """Decoder-only transformer hyper-parameters.

    ``family`` is ``"llama"`` (Llama, SmolLM2, Mistral, Qwen2: RMSNorm, rotary, gated SiLU MLP)
    or ``"gpt2"`` (LayerNorm, learned positions, GELU-tanh MLP). ``architecture`` keeps the
    checkpoint's own name (e.g. ``"Qwen2ForCausalLM"``).
    """

    architecture: str
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.family not in ("llama", "gpt2"):
            raise UnsupportedModelError(f"unsupported model family {self.family!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = (3 if self.family == "llama" else 2) * h * i
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + emb
