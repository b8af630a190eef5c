"""model.*: the shape and options of the network."""

from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.validation.rules import choice, divisors, fail, positive


def check_model(m: ModelConfig) -> None:
    for key in ("n_layers", "n_heads", "d_model", "vocab_size", "vocab_multiple", "seq_len"):
        if getattr(m, key) <= 0:
            fail(f"model.{key}", getattr(m, key), "must be positive", "pick a positive integer")
    if m.d_model % m.n_heads:
        fail("model.n_heads", m.n_heads, f"must divide model.d_model={m.d_model}", f"try {divisors(m.d_model)}")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        fail("model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads}", f"try {divisors(m.n_heads)}")
    if m.ffn_hidden is not None and m.ffn_hidden <= 0:
        fail("model.ffn_hidden", m.ffn_hidden, "must be positive", "pick a positive integer or null for 4*d_model")
    choice("model.norm", m.norm, ("layernorm", "rmsnorm"))
    choice("model.activation", m.activation, ("gelu", "swiglu"))
    choice("model.position", m.position, ("learned", "rope"))
    if m.position == "rope" and m.head_dim % 2:
        fail(
            "model.position",
            m.position,
            f"needs an even head dim, got {m.head_dim}",
            "change model.d_model or model.n_heads",
        )
    if not 0.0 <= m.dropout < 1.0:
        fail("model.dropout", m.dropout, "must be in [0, 1)", "use e.g. 0.0 or 0.1")
    for key, example in (("norm_eps", "1e-5"), ("init_std", "0.02"), ("rope_theta", "10000.0")):
        positive(f"model.{key}", getattr(m, key), example)  # a negative norm_eps trains on NaN from step 1
