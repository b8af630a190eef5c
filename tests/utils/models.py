"""Model settings the tests share."""

# What makes a GPT-2-style ModelConfig Llama-style, as configs/model/llama-7b.yaml sets it: RMSNorm, a SwiGLU MLP,
# rotary positions, no biases, an untied head. Spread into a ModelConfig's keywords: dict(..., **LLAMA_STYLE).
LLAMA_STYLE = dict(norm="rmsnorm", activation="swiglu", position="rope", bias=False, tie_embeddings=False)
