"""tools/generate.py: a checkpoint's greedy continuation through transformers' generate (KV cache) equals the
argmax loop of our own model on the same weights, token for token, for both flavours; sampling follows the
seed; a learned-position model is capped at seq_len; bad input is one line; a model no transformers class
holds is sampled by our own loop, which chooses as transformers' generate does."""

import pytest
import torch
from omegaconf import OmegaConf

from megatron_lite.checkpoint.weights import save_model_state
from megatron_lite.cli import compose_config
from megatron_lite.model.gpt import GPT
from tools.generate import generate, load, main

TOKENIZER = "assets/tokenizers/shakespeare-8k"


def checkpoint(tmp_path, preset: str):
    # init_std 0.3: logits far apart, so a tie cannot flip an argmax between the cached and the full forward
    cfg = OmegaConf.to_object(compose_config([f"model={preset}", "model.init_std=0.3"])).model
    ours = GPT(cfg).eval()
    save_model_state(str(tmp_path / preset), cfg, ours.state_dict())
    return ours, str(tmp_path / preset)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_greedy_generation_equals_our_models_argmax_loop(tmp_path, preset):
    ours, path = checkpoint(tmp_path, preset)
    model, tokenizer, cfg = load(path, TOKENIZER)
    prompt, new = generate(model, tokenizer, cfg, "ROMEO: What light", 24, greedy=True)
    ids = prompt
    with torch.no_grad():
        for _ in range(24):
            ids = torch.cat([ids, ours(ids)[:, -1, : cfg.vocab_size].argmax(-1, keepdim=True)], dim=1)
    assert new.shape == (1, 24) and torch.equal(new, ids[:, prompt.shape[1] :])
    assert len(set(new[0].tolist())) > 3  # not one token repeated: the weights are not a degenerate copy


def test_sampling_follows_the_seed_and_positions_are_capped(tmp_path, capsys):
    _, path = checkpoint(tmp_path, "tiny")
    model, tokenizer, cfg = load(path, TOKENIZER)
    runs = [generate(model, tokenizer, cfg, "ROMEO:", 16, num=2, seed=seed)[1] for seed in (1, 1, 2)]
    assert runs[0].shape == (2, 16) and torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    prompt, new = generate(model, tokenizer, cfg, "ROMEO:", cfg.seq_len, greedy=True)  # learned positions
    assert prompt.shape[1] + new.shape[1] == cfg.seq_len
    assert f"new tokens at most (model.seq_len={cfg.seq_len})" in capsys.readouterr().err


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"is not a directory; give a checkpoint root"):
        main([str(tmp_path / "nope")])
    _, path = checkpoint(tmp_path, "tiny")
    with pytest.raises(SystemExit, match=r"no tokenizer is known for .* pass --tokenizer DIR"):
        main([path])  # an import-like weights-only checkpoint records no data
    with pytest.raises(SystemExit, match=r"--temperature > 0"):
        main([path, "--temperature", "0"])
    with pytest.raises(
        SystemExit, match=r"^generate: --greedy gives one continuation \(the most likely\), not --num 2"
    ):
        main([path, "--greedy", "--num", "2", "--tokenizer", TOKENIZER])
    # each a one-line refusal, not transformers' traceback, a FileNotFoundError or 82 s of hub retries
    with pytest.raises(SystemExit, match=r"--top-k >= 0"):
        main([path, "--top-k", "-1"])
    with pytest.raises(SystemExit, match=r"^generate: \S+ is not a checkpoint \(no `latest`, no meta.json\)"):
        main([str(tmp_path)])
    with pytest.raises(SystemExit, match=r"^generate: --tokenizer nosuch is not a directory"):
        main([path, "--tokenizer", "nosuch"])


def test_an_empty_prompt_starts_from_the_tokenizers_end_of_document(tmp_path):
    """A weights-only checkpoint records no end-of-document id; the tokenizer given knows it."""
    _, path = checkpoint(tmp_path, "tiny")
    model, tokenizer, cfg = load(path, TOKENIZER)
    prompt, new = generate(model, tokenizer, cfg, "", 4, greedy=True)
    assert prompt.tolist() == [[tokenizer.eos_token_id]] and new.shape == (1, 4)


def test_our_sampling_loop_chooses_as_transformers_generate_does(tmp_path):
    """The loop for models no transformers class holds applies transformers' rules in its order and draws as it
    does: on a model both can run, sampled continuations (temperature, top-k, top-p, two at once) are the same
    tokens for the same seed (a rule missing, in another order or another draw would part them within a few
    tokens), and so are greedy ones."""
    from tools.generate import _continue_with_ours

    ours, path = checkpoint(tmp_path, "tiny")
    model, tokenizer, cfg = load(path, TOKENIZER)
    for greedy, temperature, top_k, top_p, num in (
        (False, 0.8, 20, 0.9, 2),
        (False, 1.0, 0, 1.0, 1),
        (True, 1.0, 50, 1.0, 1),
    ):
        prompt, theirs = generate(
            model, tokenizer, cfg, "ROMEO: What light", 16, greedy, temperature, top_k, top_p, num, seed=3
        )
        torch.manual_seed(3)
        mine = _continue_with_ours(
            ours, cfg.vocab_size, prompt, 16, greedy, temperature, top_k, top_p, num, tokenizer.eos_token_id
        )
        assert torch.equal(mine, theirs), (greedy, temperature, top_k, top_p, mine, theirs)


@pytest.mark.parametrize("override", ["model.bias=false", "model.norm=rmsnorm", "model.n_kv_heads=2"])
def test_a_model_no_transformers_class_holds_is_sampled_with_ours(tmp_path, capsys, override):
    """Learned positions with no biases, RMSNorm or grouped KV heads: the trainer takes them, neither GPT-2 nor
    Llama holds them, and the export refuses them: our model samples them (said on stderr), greedy equal to its
    own argmax loop."""
    cfg = OmegaConf.to_object(compose_config(["model=tiny", "model.init_std=0.3", override])).model
    ours = GPT(cfg).eval()
    save_model_state(str(tmp_path / "odd"), cfg, ours.state_dict())
    main([str(tmp_path / "odd"), "--tokenizer", TOKENIZER, "--prompt", "ROMEO:", "--greedy", "--max-new-tokens", "8"])
    out = capsys.readouterr()
    assert "no transformers class holds this model" in out.err and out.out.startswith("ROMEO:"), out
    model, tokenizer, _ = load(str(tmp_path / "odd"), TOKENIZER)
    assert isinstance(model, GPT)
    prompt, new = generate(model, tokenizer, cfg, "ROMEO:", 8, greedy=True)
    ids = prompt
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, ours(ids)[:, -1, : cfg.vocab_size].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(new, ids[:, prompt.shape[1] :])
