"""HF parity: random local HF GPT-2 / Llama models import with identical logits and loss, and export back."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from megatron_lite.checkpoint.weights import load_model_state
from megatron_lite.model.gpt import GPT
from tools.convert_hf import ConversionError, hf_config_to_model_config, hf_to_ours, main, ours_to_hf

VOCAB = 1000  # not a multiple of 64: exercises the padded embedding rows


def gpt2(tied: bool = True, **kw):
    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_head=4,
            n_embd=64,
            vocab_size=VOCAB,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=tied,
            **kw,
        )
    )


def llama(tied: bool, bias: bool = False, **kw):
    return LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=176,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            tie_word_embeddings=tied,
            rope_theta=500000.0,
            attention_bias=bias,
            mlp_bias=bias,
            **kw,
        )
    )


MODELS = {
    "gpt2": gpt2,
    "gpt2-untied": lambda **kw: gpt2(tied=False, **kw),
    "llama-untied": lambda **kw: llama(False, **kw),
    "llama-tied": lambda **kw: llama(True, **kw),
    "llama-bias": lambda **kw: llama(False, bias=True, **kw),
}


def _randomize(model):
    """Weights that matter: gains N(1, 0.2), biases N(0, 0.1), matrices N(0, 0.1) give logits of std ~0.8, so a
    swapped gate/up or k/v moves them by > 1 and a 1% RoPE theta error by ~1e-2 (all far above the 1e-5 bar)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            else:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1 if name.endswith("bias") else 0.2)
    return model.eval()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", MODELS)
def test_import_gives_identical_logits_and_loss(name, attn):
    hf = _randomize(MODELS[name](attn_implementation=attn))
    assert hf.config._attn_implementation == attn
    cfg, sd = hf_to_ours(hf.state_dict(), hf.config)
    ours = GPT(cfg).eval()
    ours.load_state_dict(sd, strict=True)
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 48))
    with torch.no_grad():
        theirs = hf(input_ids=tokens, labels=tokens)  # HF shifts labels inside
        logits = ours(tokens)
        loss = ours(tokens[:, :-1], tokens[:, 1:])
    assert (logits - theirs.logits).abs().max().item() <= 1e-5
    assert abs(loss.item() - theirs.loss.item()) <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_export_round_trips_exactly(name):
    hf = _randomize(MODELS[name]())
    cfg, sd = hf_to_ours(hf.state_dict(), hf.config)
    hf_cfg, back = ours_to_hf(cfg, sd)
    original = hf.state_dict()
    assert set(back) == set(original)
    for key, value in original.items():
        assert torch.equal(back[key], value), key
    assert hf_config_to_model_config(hf_cfg) == cfg  # the exported config reads back as the same model


def test_buffers_are_skipped_and_stray_weights_refused():
    hf = _randomize(llama(False))
    sd = dict(hf.state_dict())
    sd["model.rotary_emb.inv_freq"] = torch.ones(8)  # transformers 4.x GPT-2 / Llama buffers in old state dicts
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    hf_to_ours(sd, hf.config)
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    with pytest.raises(ConversionError, match="q_norm.*no place in our model"):
        hf_to_ours(sd, hf.config)
    g = _randomize(gpt2())
    sd = dict(
        g.state_dict(),
        **{
            "transformer.h.0.attn.bias": torch.ones(1, 1, 64, 64),
            "transformer.h.0.attn.masked_bias": torch.tensor(-1e4),
        },
    )
    hf_to_ours(sd, g.config)


@pytest.mark.parametrize("name", ["gpt2", "llama-untied"])
def test_cli_import_export_through_a_checkpoint(tmp_path, name, capsys):
    hf = _randomize(MODELS[name](bos_token_id=5, eos_token_id=7))
    hf.save_pretrained(tmp_path / "hf_in")
    main(["import", str(tmp_path / "hf_in"), str(tmp_path / "ckpt")])
    hint = capsys.readouterr().out.split("train from it with: python train.py ", 1)[1].split()
    assert hint[0] == f"checkpoint.dir={tmp_path / 'ckpt'}" and f"model.vocab_size={VOCAB}" in hint
    from omegaconf import OmegaConf

    from megatron_lite.cli import compose_config  # the printed overrides give the imported shape

    assert OmegaConf.to_object(compose_config(hint[1:])).model == hf_config_to_model_config(hf.config)
    cfg, sd = load_model_state(str(tmp_path / "ckpt"))  # via `latest`
    assert (tmp_path / "ckpt" / "step_0000000").is_dir() and cfg == hf_config_to_model_config(hf.config)
    main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf_out")])
    assert (tmp_path / "hf_out" / "model.safetensors").is_file()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", dtype=torch.float32)
    assert type(again) is type(hf)
    for key, value in hf.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    assert (again.config.bos_token_id, again.config.eos_token_id) == (5, 7)  # the import's, not the flavour's defaults
    assert (again.generation_config.bos_token_id, again.generation_config.eos_token_id) == (5, 7)
    # A damaged file is named, not exported (the commit's checksums: checkpoint/weights.load_model_state)
    weights = tmp_path / "ckpt" / "step_0000000" / "model.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x40
    weights.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=r"model.pt fails its CRC-32 check \(corrupted\)"):
        main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf_bad")])
    assert not (tmp_path / "hf_bad").exists()


def test_import_refuses_a_directory_that_holds_checkpoints(tmp_path):
    """An import commits step 0 and moves `latest`: into a run's checkpoint dir, the next run there would start
    over its checkpoints. Refused in one line, the directory untouched."""
    _randomize(MODELS["gpt2"]()).save_pretrained(tmp_path / "hf_in")
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_0000020").mkdir(parents=True)
    (ckpt / "latest").write_text("step_0000020")
    with pytest.raises(
        SystemExit,
        match=r"^convert_hf: checkpoint_dir=\S+ already holds checkpoints \(latest, "
        r"step_0000020\); import into a new or empty directory",
    ):
        main(["import", str(tmp_path / "hf_in"), str(ckpt)])
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_0000020"]
    assert (ckpt / "latest").read_text() == "step_0000020"


def test_a_trained_checkpoints_export_names_its_datas_end_of_document(tmp_path):
    """A trained checkpoint records no tokenizer ids; its data's meta.json has the end-of-document id, which the
    export gives as bos and eos. Unknown data: None, never transformers' defaults for another tokenizer."""
    from tools.convert_hf import special_tokens

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text('{"eos_id": 0}')
    trained = {"kind": "deepspeed", "config": {"data": {"path": str(tmp_path / "data")}}}
    assert special_tokens(trained) == {"bos_token_id": 0, "eos_token_id": 0}
    blend = {"kind": "deepspeed", "config": {"data": {"path": [str(tmp_path / "data"), "elsewhere"]}}}
    assert special_tokens(blend) == {"bos_token_id": 0, "eos_token_id": 0}
    assert special_tokens({"kind": "deepspeed", "config": {"data": {"path": str(tmp_path / "gone")}}}) == {}
    cfg, sd = hf_to_ours(llama(False).state_dict(), llama(False).config)
    hf_cfg, _ = ours_to_hf(cfg, sd)
    assert (hf_cfg.bos_token_id, hf_cfg.eos_token_id, hf_cfg.pad_token_id) == (None, None, None)
    assert ours_to_hf(cfg, sd, special=special_tokens(trained))[0].eos_token_id == 0


def test_a_trained_checkpoints_export_takes_its_datas_tokenizer(tmp_path):
    from tools.convert_hf import tokenizer_dir

    tok = "assets/tokenizers/shakespeare-8k"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text(f'{{"eos_id": 0, "tokenizer": "{tok}"}}')
    trained = {"kind": "deepspeed", "config": {"data": {"path": str(tmp_path / "data"), "tokenizer": None}}}
    assert tokenizer_dir(trained).endswith(tok)  # what the data records (data.tokenizer=null)
    named = {
        "kind": "deepspeed",
        "config": {"data": {"path": str(tmp_path / "data"), "tokenizer": "assets/tokenizers/gpt2"}},
    }
    assert tokenizer_dir(named).endswith("assets/tokenizers/gpt2")
    (tmp_path / "data" / "meta.json").write_text('{"eos_id": 0, "tokenizer": "/moved/away"}')
    assert tokenizer_dir(trained) is None and tokenizer_dir({"kind": "weights"}) is None


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"mlp_bias": True}, "attention_bias/mlp_bias=False/True"),
        ({"attention_bias": True}, "attention_bias/mlp_bias=True/False"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type=linear"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "rope_theta": 5e5,
                }
            },
            "rope_type=llama3",
        ),
        ({"hidden_act": "gelu"}, "hidden_act=gelu"),
        ({"head_dim": 32}, "head_dim=32"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1"),  # ours would also drop on the residual branches
    ],
)
def test_unsupported_llamas_are_refused_in_one_line(kw, match):
    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=100, **kw)
    with pytest.raises(ConversionError, match=match) as err:
        hf_to_ours({}, cfg)
    assert "\n" not in str(err.value)


def test_rope_theta_is_read_from_transformers_4_and_5_layouts():
    v5 = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 123.0})
    assert hf_config_to_model_config(v5).rope_theta == 123.0
    v4 = LlamaConfig.from_dict({"rope_theta": 321.0, "rope_scaling": None})  # a 4.x config.json
    assert hf_config_to_model_config(v4).rope_theta == 321.0


def test_dropout_goes_both_ways():
    """GPT-2's three dropouts are our one model.dropout (transformers' default 0.1, which the import dropped)."""
    assert hf_config_to_model_config(GPT2Config()).dropout == 0.1
    with pytest.raises(ConversionError, match=r"attn_pdrop/resid_pdrop/embd_pdrop=0.1/0.2/0.1 .* set the three equal"):
        hf_config_to_model_config(GPT2Config(resid_pdrop=0.2))
    cfg, sd = hf_to_ours(gpt2().state_dict(), gpt2().config)
    cfg.dropout = 0.05
    hf_cfg, _ = ours_to_hf(cfg, sd)
    assert (hf_cfg.attn_pdrop, hf_cfg.resid_pdrop, hf_cfg.embd_pdrop) == (0.05, 0.05, 0.05)


def test_unsupported_gpt2s_and_exports_are_refused():
    with pytest.raises(ConversionError, match="activation_function=relu"):
        hf_config_to_model_config(GPT2Config(activation_function="relu"))
    with pytest.raises(ConversionError, match="scale_attn_weights"):
        hf_config_to_model_config(GPT2Config(scale_attn_by_inverse_layer_idx=True))
    cfg, sd = hf_to_ours(llama(False).state_dict(), llama(False).config)
    with pytest.raises(ConversionError, match="position=rope"):
        ours_to_hf(cfg, sd, "gpt2")
    with pytest.raises(ConversionError, match="flavour=mistral"):
        ours_to_hf(cfg, sd, "mistral")
