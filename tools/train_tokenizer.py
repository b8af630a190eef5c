"""Build the bundled tokenizers, or train one on your documents, as HF `save_pretrained` directories (so
AutoTokenizer loads them offline).

    python tools/train_tokenizer.py            # both bundled ones
    python tools/train_tokenizer.py --only 8k  # the byte-level BPE trained on the corpus
    python tools/train_tokenizer.py --only gpt2
    python tools/train_tokenizer.py --input my_docs/ --out tokenizers/mine --vocab-size 32000   # your own

--input takes what tools/prepare_data.py takes (files or directories of .txt / .json / .jsonl / .parquet,
optionally gzipped; --text-key) and reads it the same way.

- shakespeare-8k: a byte-level BPE with 8192 tokens (incl. `<|endoftext|>`) trained on the bundled corpus.
- gpt2: the real GPT-2 BPE from its vocab.json + merges.txt. transformers 5 silently builds a one-token
  tokenizer from `GPT2TokenizerFast(vocab_file=..., merges_file=...)`, so we pass the parsed vocab and merges.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CORPUS = os.path.join(ROOT, "assets", "corpus", "shakespeare.jsonl.gz")
EOS = "<|endoftext|>"


def corpus_texts(path: str = CORPUS):
    with gzip.open(path, "rt") as f:
        for line in f:
            yield json.loads(line)["text"]


def train_bpe(out_dir: str, vocab_size: int = 8192, texts=None) -> None:
    """A byte-level BPE of vocab_size tokens (incl. the eos) over texts (default: the bundled corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts() if texts is None else texts, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS).save_pretrained(out_dir)
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


def train_on_documents(inputs: list[str], out_dir: str, vocab_size: int, text_key: str = "text") -> None:
    """Train train_bpe's tokenizer on your documents, read as tools/prepare_data.py reads them."""
    from tools.prepare_data import collect_files, load_documents

    if vocab_size < 257:
        raise SystemExit(
            f"train_tokenizer: --vocab-size {vocab_size} is below the 256 bytes plus eos a byte-level "
            "BPE starts from; use e.g. 8192 or 32000"
        )
    with tempfile.TemporaryDirectory() as cache:
        docs = load_documents(collect_files(inputs, "train_tokenizer"), text_key, cache, "train_tokenizer")
        if len(docs) == 0:
            raise SystemExit(f"train_tokenizer: --input {' '.join(inputs)} holds no documents")
        train_bpe(out_dir, vocab_size, (text for batch in docs.iter(batch_size=1000) for text in batch["text"]))
    from transformers import AutoTokenizer

    built = len(AutoTokenizer.from_pretrained(out_dir))
    short = (
        f" (not the {vocab_size} asked for: the documents hold no more merges to learn)" if built < vocab_size else ""
    )
    print(
        f"wrote {out_dir}: a byte-level BPE of {built} tokens{short} over {len(docs)} documents; prepare data "
        f"with it: python tools/prepare_data.py --input {' '.join(inputs)} --tokenizer {out_dir} --out <data dir>"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["8k", "gpt2"], default=None)
    ap.add_argument("--input", nargs="+", help="your documents, as tools/prepare_data.py takes them (needs --out)")
    ap.add_argument("--text-key", default="text", help="the field holding the text in .json/.jsonl/.parquet")
    ap.add_argument("--out", help="directory to write your tokenizer to")
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args(argv)
    if args.input or args.out:
        if not (args.input and args.out) or args.only:
            raise SystemExit("train_tokenizer: --input and --out go together (your own tokenizer), without --only")
        train_on_documents(args.input, args.out, args.vocab_size, args.text_key)
        return
    tokenizers = os.path.join(ROOT, "assets", "tokenizers")
    if args.only in (None, "8k"):
        train_bpe(os.path.join(tokenizers, "shakespeare-8k"))
    if args.only in (None, "gpt2"):
        gpt2_dir(os.path.join(tokenizers, "gpt2"))


if __name__ == "__main__":
    main()
