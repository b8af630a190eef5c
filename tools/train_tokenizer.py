"""Build the bundled tokenizers as HF `save_pretrained` directories (so AutoTokenizer loads them offline).

    python tools/train_tokenizer.py            # both
    python tools/train_tokenizer.py --only 8k  # the byte-level BPE trained on the corpus
    python tools/train_tokenizer.py --only gpt2

- shakespeare-8k: a byte-level BPE with 8192 tokens (incl. `<|endoftext|>`) trained on the bundled corpus.
- gpt2: the real GPT-2 BPE from its vocab.json + merges.txt. transformers 5 silently builds a one-token
  tokenizer from `GPT2TokenizerFast(vocab_file=..., merges_file=...)`, so we pass the parsed vocab and merges.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "assets", "corpus", "shakespeare.jsonl.gz")
EOS = "<|endoftext|>"


def corpus_texts(path: str = CORPUS):
    with gzip.open(path, "rt") as f:
        for line in f:
            yield json.loads(line)["text"]


def train_bpe(out_dir: str, vocab_size: int = 8192) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_texts(), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                            unk_token=EOS).save_pretrained(out_dir)
    # transformers 5 records its own class name, TokenizersBackend, which 4.x (allowed by pyproject) cannot
    # resolve; PreTrainedTokenizerFast names the same class in 5.x and loads in both.
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def gpt2_dir(out_dir: str) -> None:
    from transformers import GPT2TokenizerFast

    with open(os.path.join(out_dir, "vocab.json")) as f:
        vocab = json.load(f)
    with open(os.path.join(out_dir, "merges.txt")) as f:
        merges = [tuple(line.split()) for line in f.read().splitlines()[1:] if line.strip()]  # skip "#version"
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges)
    ids = tok("Hello world!")["input_ids"]
    assert ids == [15496, 995, 0] and tok.eos_token_id == 50256, (ids, tok.eos_token_id)
    tok.save_pretrained(out_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["8k", "gpt2"], default=None)
    args = ap.parse_args(argv)
    tokenizers = os.path.join(ROOT, "assets", "tokenizers")
    if args.only in (None, "8k"):
        train_bpe(os.path.join(tokenizers, "shakespeare-8k"))
    if args.only in (None, "gpt2"):
        gpt2_dir(os.path.join(tokenizers, "gpt2"))


if __name__ == "__main__":
    main()
