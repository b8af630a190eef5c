"""Sample text from a checkpoint: its weights as a transformers model (the conversion `convert_hf.py export`
writes, made in memory) and transformers' `generate`, with the tokenizer its data was made with. A model no
transformers class holds (learned positions with RMSNorm, SwiGLU, no biases or grouped KV heads: the trainer
takes any mix) is sampled with our own model under the same rules (transformers' logits processors), without
a KV cache: each new token re-reads the sequence, fine for the small models such mixes are tried on.

    python tools/generate.py runs/default/checkpoints --prompt "ROMEO:"               # sampled, 100 tokens
    python tools/generate.py runs/default/checkpoints --prompt "ROMEO:" --greedy
    python tools/generate.py <checkpoint> --prompt "..." --max-new-tokens 200 --temperature 0.8 --top-k 50 --num 3

Any checkpoint of any layout (a root with `latest` or a step directory; ZeRO, TP and pipeline ones are merged as
the export merges them). One process on the CPU, or the first GPU when there is one. A model with learned
positions reads at most model.seq_len tokens: the prompt and the new tokens are capped to it (said).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.checkpoint.store import read_meta  # noqa: E402
from megatron_lite.checkpoint.weights import load_model_state, step_dir  # noqa: E402
from megatron_lite.model.gpt import GPT  # noqa: E402
from tools.convert_hf import ConversionError, ours_to_hf, special_tokens, tokenizer_dir  # noqa: E402


def load(checkpoint: str, tokenizer: str | None = None, device: str = "cpu"):
    """(model in eval mode, its tokenizer, our ModelConfig) for a checkpoint: a transformers model, or our GPT
    (with its end-of-document id as `eos_token_id`) where no transformers class holds the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta = read_meta(step_dir(checkpoint))
    tokenizer = tokenizer or tokenizer_dir(meta)
    if tokenizer is None:
        raise SystemExit(
            f"generate: no tokenizer is known for {checkpoint} (an import, or its data is gone); pass --tokenizer DIR"
        )
    try:
        cfg, state = load_model_state(checkpoint)
    except ValueError as err:  # a file that fails the commit's manifest
        raise SystemExit(f"generate: {err}") from None
    special = special_tokens(meta)
    try:
        hf_cfg, hf_state = ours_to_hf(cfg, state, None, special)
    except ConversionError as err:
        print(
            f"generate: no transformers class holds this model ({err}); sampling with megatron_lite's own model, "
            "without a KV cache",
            file=sys.stderr,
        )
        model = GPT(cfg)
        model.load_state_dict(state, strict=True)
        model.eos_token_id = special.get("eos_token_id")
    else:
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
        model.load_state_dict(hf_state, strict=True)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(tokenizer), cfg


def generate(
    model,
    tokenizer,
    cfg,
    prompt: str,
    max_new_tokens: int,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int = 50,
    top_p: float = 1.0,
    num: int = 1,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the prompt's token ids as read (1, p), `num` continuations' new token ids (num, n))."""
    device = next(model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    eos = model.eos_token_id if isinstance(model, GPT) else model.config.eos_token_id
    eos = eos if eos is not None else tokenizer.eos_token_id
    if ids.shape[1] == 0:  # nothing to condition on: start from the end-of-document token, as the data does
        if eos is None:
            raise SystemExit("generate: an empty --prompt needs an end-of-document token, and none is known")
        ids = torch.tensor([[eos]], device=device)
    if cfg.position == "learned":  # positions beyond seq_len have no embedding
        if ids.shape[1] >= cfg.seq_len:
            print(
                f"generate: the prompt's {ids.shape[1]} tokens are cut to their last {cfg.seq_len - 1} "
                f"(model.seq_len={cfg.seq_len})",
                file=sys.stderr,
            )
            ids = ids[:, -(cfg.seq_len - 1) :]
        if ids.shape[1] + max_new_tokens > cfg.seq_len:
            max_new_tokens = cfg.seq_len - ids.shape[1]
            print(f"generate: {max_new_tokens} new tokens at most (model.seq_len={cfg.seq_len})", file=sys.stderr)
    torch.manual_seed(seed)
    if isinstance(model, GPT):
        return ids, _continue_with_ours(
            model, cfg.vocab_size, ids, max_new_tokens, greedy, temperature, top_k, top_p, num, eos
        )
    sampling = {} if greedy else {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=not greedy,
            num_return_sequences=num,
            pad_token_id=eos if eos is not None else 0,
            **sampling,
        )
    return ids, out[:, ids.shape[1] :]


@torch.no_grad()
def _continue_with_ours(
    model: GPT,
    vocab: int,
    ids: torch.Tensor,
    max_new_tokens: int,
    greedy: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    num: int,
    eos: int | None,
) -> torch.Tensor:
    """`num` continuations' new token ids, chosen as transformers' generate chooses them (its logits processors,
    in its order: the end of document held back until max_new_tokens, then temperature, top-k, top-p; softmax
    and one multinomial draw per step, or the argmax) from our model's last-position logits."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    rules = LogitsProcessorList()
    if eos is not None:
        rules.append(MinNewTokensLengthLogitsProcessor(ids.shape[1], max_new_tokens, eos, device=ids.device))
    if not greedy and temperature != 1.0:
        rules.append(TemperatureLogitsWarper(temperature))
    if not greedy and top_k != 0:
        rules.append(TopKLogitsWarper(top_k))
    if not greedy and top_p < 1.0:
        rules.append(TopPLogitsWarper(top_p))
    start, ids = ids.shape[1], ids.repeat(num, 1)
    for _ in range(max_new_tokens):
        scores = rules(ids, model(ids)[:, -1, :vocab].float())
        chosen = scores.argmax(-1) if greedy else torch.multinomial(scores.softmax(-1), num_samples=1).squeeze(1)
        ids = torch.cat([ids, chosen[:, None]], dim=1)
    return ids[:, start:]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a checkpoint root (with `latest`) or a step directory")
    ap.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--greedy", action="store_true", help="the most likely token each time (no sampling)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--num", type=int, default=1, help="continuations to print")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default=None, help="a local HF tokenizer (default: the one the data was made with)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        raise SystemExit(f"generate: {args.checkpoint} is not a directory; give a checkpoint root or step directory")
    if (
        args.max_new_tokens < 1
        or args.num < 1
        or not 0 < args.temperature < float("inf")
        or args.top_k < 0
        or not 0 < args.top_p <= 1
    ):
        raise SystemExit(
            "generate: --max-new-tokens and --num must be >= 1, --temperature > 0 and finite, "
            "--top-k >= 0 (0: no top-k cut), 0 < --top-p <= 1"
        )
    if args.greedy and args.num > 1:
        raise SystemExit(f"generate: --greedy gives one continuation (the most likely), not --num {args.num}; drop one")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        raise SystemExit(
            f"generate: --tokenizer {args.tokenizer} is not a directory; give a local HF tokenizer "
            "directory, or leave it out to use the one the checkpoint's data was made with"
        )
    try:
        step = step_dir(args.checkpoint)
    except FileNotFoundError as err:
        raise SystemExit(f"generate: {err}; give a checkpoint root or step directory") from None
    if not os.path.isfile(os.path.join(step, "meta.json")):
        raise SystemExit(
            f"generate: {args.checkpoint} is not a checkpoint (no `latest`, no meta.json); give a "
            "checkpoint root (e.g. runs/default/checkpoints) or one of its step_<N> directories"
        )
    model, tokenizer, cfg = load(args.checkpoint, args.tokenizer, "cuda" if torch.cuda.is_available() else "cpu")
    _, new = generate(
        model,
        tokenizer,
        cfg,
        args.prompt,
        args.max_new_tokens,
        args.greedy,
        args.temperature,
        args.top_k,
        args.top_p,
        args.num,
        args.seed,
    )
    for k, row in enumerate(new):
        if len(new) > 1:
            print(f"--- {k + 1}")
        print(args.prompt + tokenizer.decode(row))


if __name__ == "__main__":
    main()
