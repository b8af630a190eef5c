"""make bench-gpu's baselines (tools/bench_gpu.py): a step of HF transformers' GPT2LMHeadModel and of a minimal
GPT-2 in plain PyTorch as nanoGPT writes it, torch.compile'd, each as a plain training loop (fp32 weights under
bf16 autocast, fused AdamW, clipping), on CUDA. Each `*_step(model_cfg, micro, seq, accumulate)` returns the
step to time."""

from __future__ import annotations

import torch


class _Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class MinimalGPT(torch.nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def _plain_loop(model, micro: int, seq: int, vocab: int, lm_shift: bool, accumulate: int = 1):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    batches = [torch.randint(0, vocab, (micro, seq + 1), device="cuda") for _ in range(accumulate)]

    def step():
        for batch in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if lm_shift:  # HF shifts the labels itself
                    loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
                else:
                    loss = model(batch[:, :-1], batch[:, 1:])
            (loss / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def hf_step(model_cfg, micro: int, seq: int, accumulate: int):
    from tools.bench_throughput import hf_gpt2

    with torch.device("cuda"):  # initialised on the GPU: a 1.3B model's init on the host takes a minute
        model = hf_gpt2(model_cfg, torch.device("cuda"), torch.float32)
    return _plain_loop(model, micro, seq, model_cfg.vocab_size, True, accumulate)


def compiled_step(model_cfg, micro: int, seq: int, accumulate: int):
    m = model_cfg
    with torch.device("cuda"):
        model = MinimalGPT(m.vocab_size, seq, m.d_model, m.n_heads, m.n_layers)
    return _plain_loop(torch.compile(model), micro, seq, m.vocab_size, False, accumulate)
