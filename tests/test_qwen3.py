"""The Qwen3 dense family: logits and gradient parity with transformers' Qwen3ForCausalLM, HF folders in
and out, published sizes, config mapping and refusals, the FLOPs formula, QK-norm, the skeleton.

References run in fp32 on CPU with weights scaled for O(1) activations and non-uniform norm gains
(`unit_scale_init_`), so a wrong RoPE, norm or weight mapping moves the logits by far more than the
1e-4 tolerance. The gains matter for QK-norm's placement: RMS normalization commutes with RoPE's
rotation when a head's gains at i and i + head_dim/2 are equal (all ones), so only random gains
tell "norm, then RoPE" (Qwen3) from "RoPE, then norm".
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from errors import ConfigError
from models import family, with_seq_len
from models.hf import from_hf, hf_to_ours, model_args_from_hf, to_hf
from models.qwen3 import FAMILY, FLAVORS, Transformer, num_flops_per_token, num_params
from models.qwen3.hf import PUBLISHED, hf_config
from tests.tiny_hf import (
    batch,
    check_transformers_round_trip,
    logits_and_grads,
    tiny_hf_model,
    unit_scale_init_,
    write_config,
)

TOL = 1e-4
SEQ = 64
# GQA and MHA, tied and untied, head_dim equal to hidden_size / heads and not (Qwen3-0.6B's 2x).
CONFIGS = {
    "gqa-untied-wide-heads": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "gqa-tied": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True),
    "mha-untied": dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=24, intermediate_size=160, rope_theta=10000.0
    ),
    "mha-tied-wide-heads": dict(
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5
    ),
}  # fmt: skip


# ------------------------------------------------------------------ HF parity


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_parity_logits_and_gradients(name: str, tmp_path: Path) -> None:
    ref = tiny_hf_model(family="qwen3", seed=list(CONFIGS).index(name), **CONFIGS[name])
    # The untied cases are saved in several shards, to read model.safetensors.index.json too.
    ref.save_pretrained(tmp_path, **({"max_shard_size": "100KB"} if "untied" in name else {}))
    ours, args = from_hf(tmp_path)
    assert isinstance(ours, Transformer)
    assert (args.head_dim, args.kv_heads, args.hidden_dim) == (
        ref.config.head_dim,
        ref.config.num_key_value_heads,
        ref.config.intermediate_size,
    )
    assert args.tie_word_embeddings == ref.config.tie_word_embeddings == (ours.output is None)
    tokens, labels = batch(args.vocab_size)

    ref_logits, ref_grads = logits_and_grads(ref, lambda t: ref(t).logits, tokens, labels)
    our_logits, our_grads = logits_and_grads(ours, ours, tokens, labels)
    assert ref_logits.abs().max() > 1  # O(1) logits: the tolerance below is meaningful
    to_ours = hf_to_ours(FAMILY, args)
    assert {to_ours[n] for n in ref_grads} == set(our_grads)  # tied: one shared matrix on both sides
    logit_diff = (ref_logits - our_logits).abs().max().item()
    grad_diff = max((ref_grads[n] - our_grads[to_ours[n]]).abs().max().item() for n in ref_grads)
    measured = f"ours vs HF Qwen3 {name}: max |logit diff| {logit_diff:.2e}, max |grad diff| {grad_diff:.2e}"
    print(measured)  # pytest -s shows what was measured
    assert logit_diff <= TOL and grad_diff <= TOL, measured


@pytest.mark.parametrize("tied", [False, True])
def test_weights_out_to_transformers_and_back_in(tied: bool, tmp_path: Path) -> None:
    args = with_seq_len(
        dataclasses.replace(
            FLAVORS["debugmodel"],
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            head_dim=32,
            hidden_dim=128,
            vocab_size=256,
            tie_word_embeddings=tied,
        ),
        128,
    )
    model = Transformer(args)
    model.init_weights()
    unit_scale_init_(model, seed=3)  # QK-norm gains other than ones: their names must map too
    to_hf(model, FAMILY, args, tmp_path / "exported", max_shard_bytes=50_000)  # several shards + index
    assert (tmp_path / "exported" / "model.safetensors.index.json").is_file()

    check_transformers_round_trip(model, args, tmp_path / "exported", hf_class=Qwen3ForCausalLM, tol=TOL)


# ---------------------------------------------------------- published sizes

# The model cards' totals and non-embedding counts (billions, as printed: "within rounding" is half
# a unit of the last printed digit). The cards' non-embedding count leaves out the embedding and,
# when untied, the output projection as well.
CARDS = {
    "qwen3_0.6b": ("0.6", "0.44"),
    "qwen3_1.7b": ("1.7", "1.4"),
    "qwen3_4b": ("4.0", "3.6"),
    "qwen3_8b": ("8.2", "6.95"),
    "qwen3_14b": ("14.8", "13.2"),
    "qwen3_32b": ("32.8", "31.2"),
}


def _within_rounding(count: int, printed: str) -> bool:
    decimals = len(printed.partition(".")[2])
    return abs(count / 1e9 - float(printed)) <= 0.5 * 10**-decimals


@pytest.mark.parametrize("flavor", list(CARDS))
def test_published_parameter_counts(flavor: str, tmp_path: Path) -> None:
    args = FLAVORS[flavor]
    assert flavor in PUBLISHED and FAMILY.flavor_aliases[flavor.removeprefix("qwen3_").upper()] == flavor
    folder = write_config(tmp_path, hf_config(args, dtype=torch.bfloat16))
    with torch.device("meta"):  # 32B on the meta device costs nothing
        ours = Transformer(with_seq_len(args, 16))
        theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    assert isinstance(theirs, Qwen3ForCausalLM)
    count = num_params(args)
    assert sum(p.numel() for p in ours.parameters()) == count
    assert sum(p.numel() for p in theirs.parameters()) == count  # tied: HF counts the shared matrix once
    assert list(ours.layers.keys()) == [str(i) for i in range(args.n_layers)]

    total, non_embedding = CARDS[flavor]
    output = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    assert _within_rounding(count, total), (count, total)
    assert _within_rounding(num_params(args, exclude_embedding=True) - output, non_embedding)


def test_debugmodel_parameter_count_matches_module() -> None:
    args = FLAVORS["debugmodel"]
    with torch.device("meta"):
        model = Transformer(with_seq_len(args, 16))
    assert sum(p.numel() for p in model.parameters()) == num_params(args)
    # What the brief of the debug flavor needs: the shipped tokenizer's vocabulary, untied (TP), and
    # attention wider than dim, as in every published size.
    assert args.vocab_size == 2048 and not args.tie_word_embeddings and args.n_heads * args.head_dim != args.dim


# ------------------------------------------------------------- config mapping


def published(**changes: object) -> dict:
    """Qwen3-0.6B-Base's config.json as published (transformers 4.51 layout), with changes."""
    config = {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
        "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 32768,
        "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    }  # fmt: skip
    return {**config, **changes}


PUBLISHED_CONFIGS = {
    "qwen3_0.6b": published(),
    "qwen3_1.7b": published(hidden_size=2048, intermediate_size=6144),
    "qwen3_4b": published(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, max_window_layers=36, num_attention_heads=32
    ),
    "qwen3_8b": published(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, max_window_layers=36, num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    "qwen3_14b": published(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, max_window_layers=40, num_attention_heads=40,
        tie_word_embeddings=False,
    ),
    # No Base release: the post-trained Qwen/Qwen3-32B, 40960 positions.
    "qwen3_32b": published(
        hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, max_window_layers=64, num_attention_heads=64,
        tie_word_embeddings=False, max_position_embeddings=40960, eos_token_id=151645,
    ),
}  # fmt: skip


@pytest.mark.parametrize("flavor", list(PUBLISHED_CONFIGS))
def test_published_configs_map_onto_flavors(flavor: str, tmp_path: Path) -> None:
    args = model_args_from_hf(FAMILY, write_config(tmp_path / "v4", PUBLISHED_CONFIGS[flavor]))
    assert args == FLAVORS[flavor]
    # transformers 5 writes one rope_parameters dict and the layer_types list: the same model.
    Qwen3Config(**PUBLISHED_CONFIGS[flavor]).save_pretrained(tmp_path / "v5")
    v5 = json.loads((tmp_path / "v5" / "config.json").read_text())
    assert "rope_parameters" in v5 and "layer_types" in v5
    assert model_args_from_hf(FAMILY, tmp_path / "v5") == args
    ours = hf_config(args, dtype=torch.bfloat16)
    assert model_args_from_hf(FAMILY, write_config(tmp_path / "ours", ours)) == args
    # Our config.json says what the published one says, wherever both say it.
    assert {k: v for k, v in ours.items() if k in PUBLISHED_CONFIGS[flavor]} == {
        k: v for k, v in PUBLISHED_CONFIGS[flavor].items() if k in ours
    }


def test_unrepresentable_configs_are_refused_naming_each_field(tmp_path: Path) -> None:
    bad = published(
        attention_bias=True,
        use_sliding_window=True,
        sliding_window=4096,
        hidden_act="gelu",
        attention_dropout=0.1,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    )
    folder = write_config(tmp_path / "bad", bad)
    with pytest.raises(ConfigError) as info:
        model_args_from_hf(FAMILY, folder)
    problems = info.value.problems
    assert len(problems) == 5, problems
    for field in (
        "attention_bias = True",
        "use_sliding_window = True",
        "hidden_act = 'gelu'",
        "attention_dropout = 0.1",
        "rope_scaling.rope_type = 'yarn'",
    ):
        assert sum(field in p for p in problems) == 1, (field, problems)
    assert all(p.startswith(str(folder / "config.json")) for p in problems), problems
    # transformers 5's layout of a sliding-window model: the layer kinds say it.
    sliding = published(layer_types=["full_attention"] * 27 + ["sliding_attention"])
    with pytest.raises(ConfigError, match="layer_types has \\['sliding_attention'\\]"):
        model_args_from_hf(FAMILY, write_config(tmp_path / "sliding", sliding))
    with pytest.raises(ConfigError, match="model_type = 'llama' is not a qwen3 model"):
        model_args_from_hf(FAMILY, write_config(tmp_path / "llama", published(model_type="llama")))


def test_family_match_arm_and_aliases() -> None:
    assert family("qwen3") is FAMILY
    assert set(FAMILY.flavor_aliases.values()) <= set(FAMILY.flavors)
    assert set(PUBLISHED) == set(FAMILY.flavors) - {"debugmodel"}
    block = Transformer(with_seq_len(FLAVORS["debugmodel"], 16)).layers["0"]
    modules = dict(block.named_modules())
    assert set(FAMILY.tp_plan()) <= set(modules) and set(FAMILY.sac_saved_linears) <= set(modules)


# ---------------------------------------------------------------- the model


def tiny(**changes: object) -> Transformer:
    args = dataclasses.replace(
        FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96, vocab_size=128
    )
    return Transformer(with_seq_len(dataclasses.replace(args, **changes), 32))


@pytest.mark.parametrize("tied", [False, True])
def test_flops_formula_matches_counted_flops(tied: bool) -> None:
    """6N + 12 * layers * heads * head_dim * seq_len equals what FlopCounterMode counts, with an
    attention width (n_heads * head_dim = 128) other than dim (64)."""
    torch.manual_seed(0)
    model = tiny(tie_word_embeddings=tied)
    model.init_weights()
    bs, seq = 2, 32
    tokens = torch.randint(0, 128, (bs, seq))
    # The math SDPA backend runs attention as counted matmuls (the fused CPU kernel is not counted)
    # and, like the formula, computes the masked half too.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    counted = counter.get_total_flops() / (bs * seq)
    assert counted == pytest.approx(num_flops_per_token(model.args, seq), rel=1e-9)


def test_qk_norm_is_used() -> None:
    torch.manual_seed(0)
    model = tiny()
    model.init_weights()
    unit_scale_init_(model, seed=1)
    tokens = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        before = model(tokens)
        for norm in ("q_norm", "k_norm"):
            weight = getattr(model.layers["0"].attention, norm).weight
            saved = weight.clone()
            weight.mul_(3.0)  # sharper attention: a norm that is not applied would change nothing
            assert (model(tokens) - before).abs().max().item() > 0.1, norm
            weight.copy_(saved)
        assert torch.equal(model(tokens), before)


def test_meta_init_then_to_empty_then_init_weights() -> None:
    with torch.device("meta"):
        model = tiny()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    attention = model.layers["0"].attention
    assert attention.q_norm.weight.eq(1).all() and attention.k_norm.weight.eq(1).all()
    assert model.layers["0"].attention_norm.weight.eq(1).all()
    assert attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.layers["1"].attention.wo.weight.std() < attention.wo.weight.std()
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters()}  # no stored buffers


def test_block_causal_logits_of_a_packed_window_are_those_of_each_document_alone() -> None:
    torch.manual_seed(0)
    model = tiny(attn_mask_type="block_causal")
    model.init_weights()
    docs = [torch.randint(0, 128, (n,)) for n in (7, 16, 9)]
    tokens = torch.cat(docs)[None]
    segments = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        packed = model(tokens, segments=segments)
        start = 0
        for doc in docs:
            alone = model(doc[None])
            assert (packed[:, start : start + len(doc)] - alone).abs().max().item() < 1e-5
            start += len(doc)
        assert (model(tokens) - packed).abs().max().item() > 1e-3  # the mask is applied


def test_the_shipped_debug_config_trains_on_two_ranks(tmp_path: Path) -> None:
    """README: `make train CONFIG=configs/qwen3_debug.toml` trains Qwen3's debug model as Llama's is trained."""
    from tests.conftest import losses
    from tests.launch import torchrun

    torchrun(
        "train.py",
        "--config",
        "configs/qwen3_debug.toml",
        "--training.steps=6",
        "--training.seq_len=64",
        "--training.local_batch_size=4",
        "--metrics.log_freq=1",
        "--lr_scheduler.warmup_steps=2",
        f"--job.dump_folder={tmp_path}",
        nproc=2,
    )
    logged = losses(tmp_path)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6] and logged[6] < logged[1] - 0.5, logged
