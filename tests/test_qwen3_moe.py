"""The Qwen3 MoE family: logits and gradient parity with transformers' Qwen3MoeForCausalLM, HF folders in and out
(the hub's one tensor per expert, both ways), published sizes (total and active), config mapping and refusals, the
grouped-matmul experts against a loop over experts, routing, the FLOPs formula, greedy generation against
transformers', and the debug config trained on one process and on 2 ranks (FSDP, PP, FSDP from an HF folder) with
the same losses.

References run in fp32 on CPU with unit-scale weights (tests/tiny_hf.py `unit_scale_init_`), as tests/test_qwen3.py's,
so a wrong routing, norm or weight mapping moves the logits by far more than the 1e-4 tolerance.
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
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from config import load_config
from errors import ConfigError
from models import family, with_seq_len
from models.hf import from_hf, hf_to_ours, model_args_from_hf, to_hf
from models.qwen3_moe import FAMILY, FLAVORS, Transformer, active_params, num_flops_per_token, num_params
from models.qwen3_moe.hf import PUBLISHED, hf_config
from models.qwen3_moe.model import GroupedExperts, Routing, combine, dispatch
from tests.tiny_hf import (
    batch,
    check_transformers_round_trip,
    logits_and_grads,
    tiny_hf_model,
    unit_scale_init_,
    write_config,
)

TOL = 1e-4  # tests/test_qwen3.py's
# GQA and MHA, tied and untied, norm_topk_prob on and off, 1 to 4 experts per token out of 6 to 16.
CONFIGS = {
    "gqa-untied-top2-of-8": dict(),  # tests/tiny_hf.py QWEN3_MOE_BASE
    "mha-tied-top4-of-6-unnormalized": dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=True, num_experts=6,
        num_experts_per_tok=4, norm_topk_prob=False, moe_intermediate_size=24,
    ),
    "gqa-untied-wide-heads-top1-of-16": dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=1,
        moe_intermediate_size=48, rms_norm_eps=1e-5, rope_theta=10000.0,
    ),
}  # fmt: skip


def hf_as_ours(tensors: dict[str, torch.Tensor], args: object) -> dict[str, torch.Tensor]:
    """transformers' parameters (or their gradients) under our names: its fused experts (gate_up_proj: the gates,
    then the ups, along dim 1) split into w1 and w3."""
    names = hf_to_ours(FAMILY, args)
    ours = {names[name]: t for name, t in tensors.items() if name in names}
    for i in range(args.n_layers):
        experts = f"model.layers.{i}.mlp.experts"
        ours[f"layers.{i}.moe.experts.w1"], ours[f"layers.{i}.moe.experts.w3"] = tensors[
            f"{experts}.gate_up_proj"
        ].chunk(2, dim=1)
        ours[f"layers.{i}.moe.experts.w2"] = tensors[f"{experts}.down_proj"]
    return ours


# ------------------------------------------------------------------ HF parity


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_parity_logits_and_gradients(name: str, tmp_path: Path) -> None:
    ref = tiny_hf_model(family="qwen3_moe", seed=list(CONFIGS).index(name), **CONFIGS[name])
    # The untied cases are saved in several shards, to read model.safetensors.index.json (experts across files) too.
    ref.save_pretrained(tmp_path, **({"max_shard_size": "100KB"} if "untied" in name else {}))
    ours, args = from_hf(tmp_path)
    assert isinstance(ours, Transformer)
    config = ref.config
    assert (args.num_experts, args.top_k, args.norm_topk_prob, args.moe_hidden_dim, args.head_dim) == (
        config.num_experts, config.num_experts_per_tok, config.norm_topk_prob, config.moe_intermediate_size,
        config.head_dim,
    )  # fmt: skip
    assert args.tie_word_embeddings == config.tie_word_embeddings == (ours.output is None)
    tokens, labels = batch(args.vocab_size)

    ref_logits, ref_grads = logits_and_grads(ref, lambda t: ref(t).logits, tokens, labels)
    our_logits, our_grads = logits_and_grads(ours, ours, tokens, labels)
    assert ref_logits.abs().max() > 1  # O(1) logits: the tolerance below is meaningful
    theirs = hf_as_ours(ref_grads, args)
    assert theirs.keys() == our_grads.keys()
    logit_diff = (ref_logits - our_logits).abs().max().item()
    grad_diff = max((theirs[n] - our_grads[n]).abs().max().item() for n in theirs)
    measured = f"ours vs HF Qwen3 MoE {name}: max |logit diff| {logit_diff:.2e}, max |grad diff| {grad_diff:.2e}"
    print(measured)  # pytest -s shows what was measured
    assert logit_diff <= TOL and grad_diff <= TOL, measured


def test_weights_out_to_transformers_and_back_in(tmp_path: Path) -> None:
    """We write the hub's names (one tensor per expert), transformers loads them (fusing its experts) and computes
    our logits; what its save_pretrained writes, we read back bit for bit."""
    args = with_seq_len(
        dataclasses.replace(
            FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=32,
            num_experts=4, top_k=2, vocab_size=256,
        ),
        128,
    )  # fmt: skip
    model = Transformer(args)
    model.init_weights()
    unit_scale_init_(model, seed=3)
    to_hf(model, FAMILY, args, tmp_path / "exported", max_shard_bytes=50_000)  # several shards + index
    weight_map = json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())["weight_map"]
    files = {  # of each stacked parameter's experts
        (i, proj): {weight_map[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"] for e in range(4)}
        for i in range(2)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    assert any(len(f) > 1 for f in files.values())  # a parameter's experts in two files: read back whole
    assert not any("gate_up_proj" in name for name in weight_map)

    check_transformers_round_trip(model, args, tmp_path / "exported", hf_class=Qwen3MoeForCausalLM, tol=TOL)


# ---------------------------------------------------------- published sizes

# The model cards' totals, activated and non-embedding counts (billions, as printed). The cards' non-embedding
# count leaves out the embedding and the output projection. The activated count of 30B-A3B is 3,353,032,704:
# the card prints "3.3B", cut after the digit it shows, not rounded, so the check is on the cut.
CARDS = {
    "qwen3_moe_30b_a3b": ("30.5", "3.3", "29.9"),
    "qwen3_moe_235b_a22b": ("235", "22", "234"),
}


def _within_rounding(count: int, printed: str) -> bool:
    decimals = len(printed.partition(".")[2])
    return abs(count / 1e9 - float(printed)) <= 0.5 * 10**-decimals


def _cut(count: int, printed: str) -> bool:
    decimals = len(printed.partition(".")[2])
    return int(count / 1e9 * 10**decimals) == round(float(printed) * 10**decimals)


@pytest.mark.parametrize("flavor", list(CARDS))
def test_published_parameter_counts(flavor: str, tmp_path: Path) -> None:
    args = FLAVORS[flavor]
    assert (
        flavor in PUBLISHED
        and FAMILY.flavor_aliases[flavor.removeprefix("qwen3_moe_").upper().replace("_", "-")] == flavor
    )
    folder = write_config(tmp_path, hf_config(args, dtype=torch.bfloat16))
    with torch.device("meta"):  # 235B on the meta device costs nothing
        ours = Transformer(with_seq_len(args, 16))
        theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    assert isinstance(theirs, Qwen3MoeForCausalLM)
    count = num_params(args)
    assert sum(p.numel() for p in ours.parameters()) == count
    assert sum(p.numel() for p in theirs.parameters()) == count

    total, activated, non_embedding = CARDS[flavor]
    active = active_params(args)
    expert = 3 * args.dim * args.moe_hidden_dim
    assert count - active == args.n_layers * (args.num_experts - args.top_k) * expert
    assert _within_rounding(count, total), (count, total)
    assert _within_rounding(active, activated) or _cut(active, activated), (active, activated)
    output = args.vocab_size * args.dim
    assert _within_rounding(num_params(args, exclude_embedding=True) - output, non_embedding)


def test_debugmodel_parameter_count_matches_module() -> None:
    args = FLAVORS["debugmodel"]
    with torch.device("meta"):
        model = Transformer(with_seq_len(args, 16))
    assert sum(p.numel() for p in model.parameters()) == num_params(args)
    assert args.vocab_size == 2048 and not args.tie_word_embeddings and args.top_k < args.num_experts
    assert FAMILY.flavor_aliases["debugmodel_moe"] == "debugmodel"


def test_print_config_states_the_active_parameters() -> None:
    """--print-config (and the banner, from the same family field) say how many parameters a token runs through."""
    from train import config_summary

    summary = config_summary(load_config(["--config", "configs/qwen3_moe_30b_a3b.toml"]))
    assert "# parameters: 30,532,122,624 (" in summary and "; 3,353,032,704 active per token" in summary
    assert family("llama3").active_params is None  # a dense family says nothing more


# ------------------------------------------------------------- config mapping


def published(**changes: object) -> dict:
    """Qwen3-30B-A3B-Base's config.json as published (transformers 4.51 layout), with changes."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151643, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 32768, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    }  # fmt: skip
    return {**config, **changes}


PUBLISHED_CONFIGS = {
    "qwen3_moe_30b_a3b": published(),
    # No Base release: the post-trained Qwen/Qwen3-235B-A22B, 40960 positions.
    "qwen3_moe_235b_a22b": published(
        hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
        max_window_layers=94, num_attention_heads=64, max_position_embeddings=40960, eos_token_id=151645,
    ),
}  # fmt: skip


@pytest.mark.parametrize("flavor", list(PUBLISHED_CONFIGS))
def test_published_configs_map_onto_flavors(flavor: str, tmp_path: Path) -> None:
    args = model_args_from_hf(FAMILY, write_config(tmp_path / "v4", PUBLISHED_CONFIGS[flavor]))
    assert args == FLAVORS[flavor]
    # transformers 5 writes rope_parameters, layer_types and num_local_experts: the same model.
    Qwen3MoeConfig(**PUBLISHED_CONFIGS[flavor]).save_pretrained(tmp_path / "v5")
    v5 = json.loads((tmp_path / "v5" / "config.json").read_text())
    assert "rope_parameters" in v5 and "num_local_experts" in v5
    assert model_args_from_hf(FAMILY, tmp_path / "v5") == args
    ours = hf_config(args, dtype=torch.bfloat16)
    assert model_args_from_hf(FAMILY, write_config(tmp_path / "ours", ours)) == args
    # Our config.json says what the published one says, wherever both say it.
    assert {k: v for k, v in ours.items() if k in PUBLISHED_CONFIGS[flavor]} == {
        k: v for k, v in PUBLISHED_CONFIGS[flavor].items() if k in ours
    }


def test_unrepresentable_configs_are_refused_naming_each_field(tmp_path: Path) -> None:
    bad = published(
        decoder_sparse_step=2,
        mlp_only_layers=[0, 47],
        attention_bias=True,
        hidden_act="gelu",
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    )
    folder = write_config(tmp_path / "bad", bad)
    with pytest.raises(ConfigError) as info:
        model_args_from_hf(FAMILY, folder)
    problems = info.value.problems
    assert len(problems) == 5, problems
    for field in (
        "decoder_sparse_step = 2",
        "mlp_only_layers = [0, 47]",
        "attention_bias = True",
        "hidden_act = 'gelu'",
        "rope_scaling.rope_type = 'yarn'",
    ):
        assert sum(field in p for p in problems) == 1, (field, problems)
    assert all(p.startswith(str(folder / "config.json")) for p in problems), problems
    with pytest.raises(ConfigError, match="num_experts = 0 must be a positive integer"):  # transformers: all dense
        model_args_from_hf(FAMILY, write_config(tmp_path / "dense", published(num_experts=0)))
    with pytest.raises(ConfigError, match="model_type = 'qwen3' is not a qwen3_moe model"):
        model_args_from_hf(FAMILY, write_config(tmp_path / "dense", published(model_type="qwen3")))


def test_what_the_family_cannot_train_yet_is_refused_one_line_each() -> None:
    base = ["--config", "configs/qwen3_moe_debug.toml"]
    with pytest.raises(ConfigError) as info:
        load_config(
            [
                *base,
                "--parallelism.tensor_parallel_degree=2",
                "--parallelism.expert_parallel_degree=1",
                "--optimizer.name=Muon",
            ]
        )
    mine = [p for p in info.value.problems if "qwen3_moe" in p]
    assert len(mine) == 2 and mine[0].startswith("parallelism.tensor_parallel_degree: 2"), mine
    assert mine[1].startswith("optimizer.name: Muon"), mine
    assert load_config(base).model.name == "qwen3_moe"  # the debug config itself passes
    dense = load_config([*base, "--model.name=qwen3", "--parallelism.expert_parallel_degree=1"])
    assert family("qwen3").config_problems(dense) == []  # dense: nothing


def test_family_match_arm_and_aliases() -> None:
    assert family("qwen3_moe") is FAMILY
    assert set(FAMILY.flavor_aliases.values()) <= set(FAMILY.flavors)
    assert set(PUBLISHED) == set(FAMILY.flavors) - {"debugmodel"}
    block = Transformer(with_seq_len(FLAVORS["debugmodel"], 16)).layers["0"]
    modules = dict(block.named_modules())
    assert set(FAMILY.tp_plan()) <= set(modules) and set(FAMILY.sac_saved_linears) <= set(modules)


# ---------------------------------------------------------------- the model


def tiny(**changes: object) -> Transformer:
    args = dataclasses.replace(
        FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, moe_hidden_dim=48,
        num_experts=6, top_k=2, vocab_size=128,
    )  # fmt: skip
    return Transformer(with_seq_len(dataclasses.replace(args, **changes), 32))


def test_grouped_experts_equal_a_loop_over_experts() -> None:
    """dispatch, the grouped matmuls and combine equal each expert's SwiGLU applied to its tokens one expert at a
    time, outputs and gradients, with an expert that gets no token."""
    torch.manual_seed(0)
    args = tiny().args
    experts = GroupedExperts(args)
    experts.init_weights(0.02)
    unit_scale_init_(experts, seed=0)
    x = torch.randn(40, args.dim, requires_grad=True)
    expert_ids = torch.randint(0, args.num_experts - 1, (40, args.top_k))  # the last expert gets nothing
    weights = torch.rand(40, args.top_k)
    counts = torch.bincount(expert_ids.flatten(), minlength=args.num_experts)
    routed, order = dispatch(x, expert_ids)
    grouped = combine(experts(routed, counts), order, weights)
    g = torch.randn_like(grouped)
    (grouped * g).sum().backward()
    grads = [x.grad.clone(), *(w.grad.clone() for w in (experts.w1, experts.w2, experts.w3))]
    x.grad = None
    experts.zero_grad()

    looped = torch.zeros(40, args.dim)
    for e in range(args.num_experts):
        token, choice = torch.where(expert_ids == e)
        h = F.silu(x[token] @ experts.w1[e].T) * (x[token] @ experts.w3[e].T)
        looped = looped.index_add(0, token, (h @ experts.w2[e].T) * weights[token, choice, None])
    (looped * g).sum().backward()
    assert (grouped - looped).abs().max().item() <= 1e-5
    for ours, loop in zip(grads, [x.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad], strict=True):
        assert (ours - loop).abs().max().item() <= 1e-5
    assert grads[1][-1].abs().max() == 0  # the idle expert's weights get no gradient


@pytest.mark.parametrize("normalized", [True, False])
def test_routing_with_and_without_norm_topk_prob(normalized: bool) -> None:
    """The router's softmax over every expert in float32, its top_k, renormalized or not; what a caller's forward hook
    on the router sees (the block records nothing)."""
    torch.manual_seed(0)
    model = tiny(norm_topk_prob=normalized)
    model.init_weights()
    seen: list[Routing] = []
    model.layers["1"].moe.router.register_forward_hook(lambda module, args, out: seen.append(out))
    tokens = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        model(tokens)
    (routing,) = seen
    assert routing.probs.dtype == routing.weights.dtype == torch.float32 and routing.probs.shape == (64, 6)
    assert torch.allclose(routing.probs.sum(-1), torch.ones(64))
    top, ids = routing.probs.topk(2, dim=-1)
    assert torch.equal(routing.expert_ids, ids)
    expected = top / top.sum(-1, keepdim=True) if normalized else top
    assert torch.allclose(routing.weights, expected)
    assert torch.equal(routing.tokens_per_expert, torch.bincount(ids.flatten(), minlength=6))
    assert routing.tokens_per_expert.sum() == 64 * 2  # no token dropped
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters()}  # no buffers, no state


def test_flops_formula_matches_counted_flops() -> None:
    """6 x the ACTIVE matmul weights (top_k experts a token, the router) + attention, what FlopCounterMode counts."""
    torch.manual_seed(0)
    model = tiny()
    model.init_weights()
    bs, seq = 2, 32
    tokens = torch.randint(0, 128, (bs, seq))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    counted = counter.get_total_flops() / (bs * seq)
    assert counted == pytest.approx(num_flops_per_token(model.args, seq), rel=1e-9)


def test_greedy_generation_equals_transformers(tmp_path: Path) -> None:
    """generate.py's Generator on the model read from a transformers folder: the tokens of transformers' greedy
    generate for prompts of different lengths, no host read per token (what tests/test_generate.py checks of the
    dense families)."""
    from generate import STOP_CHECK_EVERY, Generator
    from tests.test_generate import NEW_TOKENS, HostReads, hf_greedy, prompts_of

    reference = tiny_hf_model(family="qwen3_moe", seed=1)
    reference.save_pretrained(tmp_path)
    ours, _ = from_hf(tmp_path)
    prompts = prompts_of(reference.config.vocab_size)
    generator = Generator(ours.eval())
    assert generator.generate(prompts, max_new_tokens=NEW_TOKENS) == hf_greedy(reference, prompts, eos=None)
    with HostReads() as reads:  # the first call's decode state, reused
        generator.generate(prompts, max_new_tokens=NEW_TOKENS)
    assert reads.counts == {"__bool__": -(-(NEW_TOKENS - 1) // STOP_CHECK_EVERY), "tolist": 1}, reads.counts


# ---------------------------------------------------------------- training

TRAIN = [
    "--config", "configs/qwen3_moe_debug.toml", "--training.steps=4", "--training.seq_len=64",
    "--training.global_batch_size=8", "--training.local_batch_size=2", "--debug.deterministic", "--metrics.log_freq=1",
    "--lr_scheduler.warmup_steps=1", "--parallelism.expert_parallel_degree=1",  # the config's EP 2: a run below
]  # fmt: skip


def test_the_debug_config_trains_alike_on_one_process_fsdp_ep_pp_and_from_an_hf_folder(tmp_path: Path) -> None:
    """One seed; one process; then one launch of 2 ranks running FSDP, FSDP with expert parallel 2 (the config's
    own layout), PP and FSDP from the seed written as a Hugging Face folder (experts out one tensor each, and read
    back sharded): the same losses, falling."""
    from checkpoint import export_hf_folder
    from tests.conftest import losses
    from tests.launch import python, torchrun

    seed = tmp_path / "seed"
    made = python("train.py", *TRAIN, f"--job.dump_folder={seed}", "--checkpoint.create_seed_checkpoint")
    assert made.returncode == 0, made.stderr[-3000:]
    step0 = seed / "checkpoint" / "step-0"
    export_hf_folder(step0, tmp_path / "hf", family=FAMILY, args=FLAVORS["debugmodel"], dtype=None)
    one = python("train.py", *TRAIN, f"--job.dump_folder={tmp_path / 'one'}", f"--checkpoint.initial_load_path={step0}")
    assert one.returncode == 0, one.stderr[-3000:]
    runs = {
        "fsdp": [f"--checkpoint.initial_load_path={step0}"],
        "ep": [f"--checkpoint.initial_load_path={step0}", "--parallelism.expert_parallel_degree=2"],
        "pp": [
            f"--checkpoint.initial_load_path={step0}", "--parallelism.pipeline_parallel_degree=2",
            "--parallelism.pipeline_parallel_microbatch_size=1",
        ],
        "fsdp_hf": [f"--checkpoint.initial_load_path={tmp_path / 'hf'}", "--checkpoint.initial_load_in_hf"],
    }  # fmt: skip
    (tmp_path / "runs.json").write_text(
        json.dumps([[*TRAIN, f"--job.dump_folder={tmp_path / name}", *extra] for name, extra in runs.items()])
    )
    torchrun("tests/config_worker.py", str(tmp_path / "runs.json"), nproc=2)
    reference = losses(tmp_path / "one")
    assert sorted(reference) == [1, 2, 3, 4] and reference[4] < reference[1] - 0.3, reference
    for name in runs:
        got = losses(tmp_path / name)
        assert sorted(got) == [1, 2, 3, 4] and max(abs(got[s] - reference[s]) for s in got) <= 1e-5, (name, got)


def test_the_estimator_counts_the_experts_in_what_ac_recomputes() -> None:
    """planning/trace.py looks the FLOP formulas up at each op, so the family's grouped matmuls (custom ops registered
    when the family imports) count: full AC recomputes one block's forward as FlopCounterMode counts it, plus the
    attention forward that the flash backward reruns (without the experts it counted 2/3 of a debug block)."""
    from planning.flags import job
    from planning.job import CPU
    from planning.trace import block_costs

    args, batch, seq = with_seq_len(FLAVORS["debugmodel"], 64), 2, 64
    shape = dict(model="qwen3_moe", flavor="debugmodel", seq_len=seq, local_batch_size=batch, param_dtype="float32")
    full = block_costs(job(1, machine=CPU, args=args, **shape), "full")
    model = Transformer(args)
    model.init_weights()
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, args.vocab_size, (batch, seq)))
    output = 2 * batch * seq * args.dim * args.vocab_size
    attention = 4 * batch * seq * seq * args.n_heads * args.head_dim
    assert full.recompute_flops == (counter.get_total_flops() - output) // args.n_layers + attention
