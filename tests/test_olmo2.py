"""The OLMo 2 family: logits and gradient parity with transformers' Olmo2ForCausalLM, HF folders in and out,
published sizes, config mapping and refusals, the FLOPs formula, the post-norms and the whole-projection
QK-norm, the skeleton.

References run in fp32 on CPU with weights scaled for O(1) activations and non-uniform norm gains
(`unit_scale_init_`), so a wrong RoPE, norm placement or weight mapping moves the logits by far more than
the 1e-4 tolerance. Random gains matter twice here: a QK-norm over each head instead of the whole
projection differs from OLMo 2's only when heads' scales differ, and the norm-then-RoPE order only shows
when a head's gains at i and i + head_dim/2 differ.
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
from transformers import AutoConfig, AutoModelForCausalLM, Olmo2Config, Olmo2ForCausalLM

from errors import ConfigError
from models import family, with_seq_len
from models.hf import from_hf, hf_to_ours, model_args_from_hf, to_hf
from models.olmo2 import FAMILY, FLAVORS, Transformer, num_flops_per_token, num_params
from models.olmo2.hf import PUBLISHED, hf_config
from tests.tiny_hf import (
    batch,
    check_transformers_round_trip,
    logits_and_grads,
    tiny_hf_model,
    unit_scale_init_,
    write_config,
)

TOL = 1e-4
# GQA and MHA, tied and untied, and an explicit head_dim other than hidden_size / heads.
CONFIGS = {
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2),
    "mha-untied": dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=160, rope_theta=10000.0),
    "gqa-tied-eps": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "gqa-wide-heads": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


# ------------------------------------------------------------------ HF parity


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_parity_logits_and_gradients(name: str, tmp_path: Path) -> None:
    ref = tiny_hf_model(family="olmo2", seed=list(CONFIGS).index(name), **CONFIGS[name])
    # The untied cases are saved in several shards, to read model.safetensors.index.json too.
    ref.save_pretrained(tmp_path, **({"max_shard_size": "100KB"} if "untied" in name else {}))
    ours, args = from_hf(tmp_path)
    assert isinstance(ours, Transformer)
    assert (args.head_dim, args.kv_heads, args.hidden_dim) == (
        ref.model.layers[0].self_attn.head_dim,
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
    measured = f"ours vs HF Olmo2 {name}: max |logit diff| {logit_diff:.2e}, max |grad diff| {grad_diff:.2e}"
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
            head_dim=16,
            hidden_dim=128,
            vocab_size=256,
            tie_word_embeddings=tied,
        ),
        128,
    )
    model = Transformer(args)
    model.init_weights()
    unit_scale_init_(model, seed=3)  # norm gains other than ones: their names must map too
    to_hf(model, FAMILY, args, tmp_path / "exported", max_shard_bytes=50_000)  # several shards + index
    assert (tmp_path / "exported" / "model.safetensors.index.json").is_file()

    check_transformers_round_trip(model, args, tmp_path / "exported", hf_class=Olmo2ForCausalLM, tol=TOL)


# ---------------------------------------------------------- published sizes


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts(flavor: str, tmp_path: Path) -> None:
    """Ours, counted three ways (the formula, our module, transformers' module of our config.json), agree. No
    check against the model cards: the ones found name the sizes ("7B", "13B") but print no exact count
    (the formula gives 7.30B and 13.72B)."""
    args = FLAVORS[flavor]
    folder = write_config(tmp_path, hf_config(args, dtype=torch.bfloat16))
    with torch.device("meta"):
        ours = Transformer(with_seq_len(args, 16))
        theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    assert isinstance(theirs, Olmo2ForCausalLM)
    count = num_params(args)
    assert sum(p.numel() for p in ours.parameters()) == count
    assert sum(p.numel() for p in theirs.parameters()) == count
    assert list(ours.layers.keys()) == [str(i) for i in range(args.n_layers)]


def test_debugmodel_parameter_count_matches_module() -> None:
    args = FLAVORS["debugmodel"]
    with torch.device("meta"):
        model = Transformer(with_seq_len(args, 16))
    assert sum(p.numel() for p in model.parameters()) == num_params(args)
    # The shipped tokenizer's vocabulary, untied (TP), and q_norm and k_norm of different widths.
    assert args.vocab_size == 2048 and not args.tie_word_embeddings and args.n_heads != args.kv_heads


# ------------------------------------------------------------- config mapping


def published(**changes: object) -> dict:
    """allenai/OLMo-2-1124-7B's config.json as published (transformers 4.47 layout), with changes."""
    config = {
        "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "olmo2",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "pad_token_id": 100277,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 500000, "tie_word_embeddings": False,
        "torch_dtype": "float32", "transformers_version": "4.47.0", "use_cache": True, "vocab_size": 100352,
    }  # fmt: skip
    return {**config, **changes}


PUBLISHED_CONFIGS = {
    "olmo2_7b": published(),
    "olmo2_13b": published(
        hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_hidden_layers=40, num_key_value_heads=40
    ),
    # The 1B (OLMo-2-0425-1B) and 32B (OLMo-2-0325-32B) shapes as Ai2's OLMo-core defines them (olmo2_1B_v2,
    # olmo2_32B); the rest as the 7B's config.json. 1,484,916,736 and 32,234,279,936 parameters.
    "olmo2_1b": published(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_hidden_layers=16, num_key_value_heads=16
    ),
    "olmo2_32b": published(
        hidden_size=5120, intermediate_size=27648, num_attention_heads=40, num_hidden_layers=64, num_key_value_heads=8
    ),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED_CONFIGS))
def test_published_configs_map_onto_flavors(flavor: str, tmp_path: Path) -> None:
    args = model_args_from_hf(FAMILY, write_config(tmp_path / "v4", PUBLISHED_CONFIGS[flavor]))
    assert args == FLAVORS[flavor]
    # transformers 5 writes one rope_parameters dict: the same model.
    Olmo2Config(**PUBLISHED_CONFIGS[flavor]).save_pretrained(tmp_path / "v5")
    assert "rope_parameters" in json.loads((tmp_path / "v5" / "config.json").read_text())
    assert model_args_from_hf(FAMILY, tmp_path / "v5") == args
    ours = hf_config(args, dtype=torch.float32)
    assert model_args_from_hf(FAMILY, write_config(tmp_path / "ours", ours)) == args
    # Our config.json says what the published one says, wherever both say it.
    assert {k: v for k, v in ours.items() if k in PUBLISHED_CONFIGS[flavor]} == {
        k: v for k, v in PUBLISHED_CONFIGS[flavor].items() if k in ours and k != "transformers_version"
    }


def test_unrepresentable_configs_are_refused_naming_each_field(tmp_path: Path) -> None:
    bad = published(
        attention_bias=True,
        hidden_act="gelu",
        attention_dropout=0.1,
        num_key_value_heads=5,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    )
    folder = write_config(tmp_path / "bad", bad)
    with pytest.raises(ConfigError) as info:
        model_args_from_hf(FAMILY, folder)
    problems = info.value.problems
    assert len(problems) == 5, problems
    for field in (
        "attention_bias = True",
        "hidden_act = 'gelu'",
        "attention_dropout = 0.1",
        "num_key_value_heads = 5 does not divide",
        "rope_scaling.rope_type = 'yarn'",
    ):
        assert sum(field in p for p in problems) == 1, (field, problems)
    assert all(p.startswith(str(folder / "config.json")) for p in problems), problems
    with pytest.raises(ConfigError, match="model_type = 'qwen3' is not a olmo2 model"):
        model_args_from_hf(FAMILY, write_config(tmp_path / "qwen3", published(model_type="qwen3")))


def test_family_match_arm_and_plan_names() -> None:
    assert family("olmo2") is FAMILY
    assert set(PUBLISHED) == set(FAMILY.flavors) - {"debugmodel"}
    block = Transformer(with_seq_len(FLAVORS["debugmodel"], 16)).layers["0"]
    modules = dict(block.named_modules())
    assert set(FAMILY.tp_plan()) <= set(modules) and set(FAMILY.sac_saved_linears) <= set(modules)
    assert FAMILY.torchtitan_interleaved(FLAVORS["debugmodel"]) == {}


# ---------------------------------------------------------------- the model


def tiny(**changes: object) -> Transformer:
    args = dataclasses.replace(
        FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96, vocab_size=128
    )
    return Transformer(with_seq_len(dataclasses.replace(args, **changes), 32))


@pytest.mark.parametrize("tied", [False, True])
def test_flops_formula_matches_counted_flops(tied: bool) -> None:
    """6N + 12 * layers * heads * head_dim * seq_len equals what FlopCounterMode counts."""
    torch.manual_seed(0)
    model = tiny(tie_word_embeddings=tied, head_dim=32)  # attention width 128, twice dim
    model.init_weights()
    bs, seq = 2, 32
    tokens = torch.randint(0, 128, (bs, seq))
    # The math SDPA backend runs attention as counted matmuls (the fused CPU kernel is not counted).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    counted = counter.get_total_flops() / (bs * seq)
    assert counted == pytest.approx(num_flops_per_token(model.args, seq), rel=1e-9)


def test_qk_norm_spans_all_heads() -> None:
    """Scaling one head's slice of wq changes nothing under a per-head norm; under OLMo 2's norm over the whole
    projection it changes every head's scale, so the logits move."""
    torch.manual_seed(0)
    model = tiny()
    model.init_weights()
    unit_scale_init_(model, seed=1)
    tokens = torch.randint(0, 128, (2, 32))
    attention = model.layers["0"].attention
    with torch.no_grad():
        before = model(tokens)
        attention.wq.weight[:16].mul_(4.0)  # head 0's rows
        assert (model(tokens) - before).abs().max().item() > 0.1


def test_post_norms_follow_each_branch() -> None:
    """A branch's output scale is the post-norm's business: scaling wo (or w2) changes nothing but eps's share,
    and scaling the post-norm's gain does change the logits."""
    torch.manual_seed(0)
    model = tiny()
    model.init_weights()
    unit_scale_init_(model, seed=2)
    tokens = torch.randint(0, 128, (2, 32))
    block = model.layers["0"]
    with torch.no_grad():
        before = model(tokens)
        block.attention.wo.weight.mul_(3.0)
        block.feed_forward.w2.weight.mul_(3.0)
        assert (model(tokens) - before).abs().max().item() < 1e-3
        block.post_attention_norm.weight.mul_(3.0)
        assert (model(tokens) - before).abs().max().item() > 0.1


@pytest.mark.parametrize("sum_of_shards", ["autograd", "dtensor"])
def test_tp_moves_only_the_qk_norm_statistic(sum_of_shards: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TP (models/olmo2/plans.py) the QK-norm over a column-split projection costs one all-reduce of
    (bs, seqlen, 1) fp32 per norm in forward and one in backward, nothing of the projection's width; every
    other collective of the block is Llama's (sequence parallel's all-gathers and reduce-scatters). So in
    generation's plan, whose weights of the norm stay split like wq's. "dtensor": without `_SumOfShards`,
    DTensor's own redistribute, backward reduce-scatters the full-width gradient of each norm's input.
    The values (torch's fake backend, one process) are not what is checked here: the parity table's olmo2_tp2 checks
    them (tests/parity_worker.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from models.olmo2 import model as olmo2_model
    from parallelisms.tp import apply_tp, apply_tp_inference
    from tests.instruments import CollectiveLog, observe_ops

    if sum_of_shards == "dtensor":
        redistribute = staticmethod(lambda partial: partial.redistribute(placements=[Replicate()]))
        monkeypatch.setattr(olmo2_model._SumOfShards, "apply", redistribute)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = tiny(n_layers=1)
        model.init_weights()
        apply_tp(model, init_device_mesh("cpu", (2,)), block_plan=FAMILY.tp_plan, loss_parallel=False, seq_len=32)
        block, bs, seq, log = model.layers["0"], 2, 32, CollectiveLog({(0, 1): "tp"})
        x = torch.randn(bs, seq // 2, 64, requires_grad=True)  # this rank's sequence shard of the residual
        with observe_ops(log):
            block(x, model.rope_cos_sin, None).sum().backward()
        # Generation's plan (no sequence parallel) keeps the split norm: it is a ColwiseParallel by type.
        generating = tiny(n_layers=1)
        apply_tp_inference(generating, init_device_mesh("cpu", (2,)), block_plan=FAMILY.tp_plan)
        q_norm = generating.layers["0"].attention.q_norm.weight
        inference_log = CollectiveLog({(0, 1): "tp"})
        with torch.no_grad(), observe_ops(inference_log):
            generating.layers["0"](torch.randn(bs, seq, 64), generating.rope_cos_sin, None)
    finally:
        dist.destroy_process_group()
    statistic = bs * seq * 1 * 4  # (bs, seqlen, 1) fp32
    activation = bs * seq * 64 * 4  # (bs, seqlen, dim) fp32: the sequence-parallel gathers and scatters
    ops = [(c.op, c.payload_bytes) for c in log.records]
    llamas = [("all_gather", activation)] * 4 + [("reduce_scatter", activation)] * 4
    if sum_of_shards == "autograd":
        assert sorted(ops) == sorted([("all_reduce", statistic)] * 4 + llamas), ops
    else:  # q's gradient at its full width (4 heads of 16 = dim), k's (2 heads of 16)
        full_width = [("reduce_scatter", activation), ("reduce_scatter", activation // 2)]
        assert sorted(ops) == sorted([("all_reduce", statistic)] * 2 + full_width + llamas), ops
    assert q_norm.placements == (Shard(0),) and q_norm.to_local().shape == (32,)
    # Two statistics, then the row-wise wo and w2 all-reduce their (bs, seqlen, dim) outputs.
    inference_ops = sorted((c.op, c.payload_bytes) for c in inference_log.records)
    assert inference_ops == sorted([("all_reduce", statistic)] * 2 + [("all_reduce", activation)] * 2), inference_ops


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
    assert model.layers["0"].post_attention_norm.weight.eq(1).all()
    assert attention.wq.weight.std().item() == pytest.approx(64**-0.5, rel=0.1)  # fan-in: dim 64
    assert model.layers["0"].feed_forward.w2.weight.std().item() == pytest.approx(96**-0.5, rel=0.1)  # hidden 96
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
    """configs/olmo2_debug.toml trains OLMo 2's debug model as Llama's is trained (2 CPU ranks, FSDP)."""
    from tests.conftest import losses
    from tests.launch import torchrun

    torchrun(
        "train.py",
        "--config",
        "configs/olmo2_debug.toml",
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
