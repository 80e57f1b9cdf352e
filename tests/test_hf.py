"""Hugging Face and torchtitan interop: config mapping, logits and gradient parity, round trips,
and a 2-rank FSDP fine-tune that starts from a converted HF checkpoint.

Reference models run in fp32 on CPU with weights scaled for O(1) activations (tests/tiny_hf.py),
so a wrong RoPE, norm or weight mapping moves the logits by far more than the 1e-4 tolerance
(checked: dropping the llama3 RoPE scaling moves them by > 0.1).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from config import Checkpoint, Data, load_config
from data.corpus import open_corpus
from data.loader import GlobalBatchLoader
from data.tokenizers import build_tokenizer
from errors import ConfigError
from models import NAMES, family, with_seq_len
from models.hf import from_hf, hf_config, hf_to_ours, model_args_from_hf, to_hf
from models.llama3 import FAMILY as LLAMA3
from models.llama3 import FLAVORS, Transformer, num_params
from models.llama3.model import RopeScaling
from tests.launch import REPO, python, torchrun
from tests.tiny_hf import (
    LLAMA3_ROPE,
    batch,
    logits_and_grads,
    save_hf_folder,
    tiny_hf_folder,
    tiny_hf_model,
    total_norm,
    write_config,
)

TOL = 1e-4
REPO_DATA = [
    f"--model.tokenizer_path={REPO / 'assets/tokenizer'}",
    f"--data.path={REPO / 'assets/corpus/stories.jsonl'}",
]
SEQ = 64
# Small configs covering GQA and MHA, tied and untied embeddings, with and without llama3 RoPE
# scaling, an FFN width Llama's sizing rule produces (256 at dim 64) and ones it does not.
CONFIGS = {
    "gqa-untied-llama3rope": dict(num_attention_heads=8, num_key_value_heads=2, rope_scaling=LLAMA3_ROPE),
    "gqa-tied-llama3rope": dict(
        num_attention_heads=4, num_key_value_heads=1, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True,
        intermediate_size=256,
    ),
    "mha-untied-norope": dict(
        num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0, rms_norm_eps=1e-6, intermediate_size=160
    ),
    "mha-tied-norope": dict(num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True, vocab_size=512),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    model = tiny_hf_model(seed=list(CONFIGS).index(name), **CONFIGS[name])
    # The untied cases are saved in several shards, to read model.safetensors.index.json too.
    folder = save_hf_folder(model, tmp_path_factory.mktemp(name), max_shard_size="200KB" if "untied" in name else None)
    return name, folder


def test_hf_parity_logits_and_gradients(hf_case: tuple[str, Path]) -> None:
    name, folder = hf_case
    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    ours, args = from_hf(folder)
    assert args.tie_word_embeddings == ref.config.tie_word_embeddings
    assert args.hidden_dim == ref.config.intermediate_size and args.kv_heads == ref.config.num_key_value_heads
    tokens, labels = batch(args.vocab_size)

    ref_logits, ref_grads = logits_and_grads(ref, lambda t: ref(t).logits, tokens, labels)
    our_logits, our_grads = logits_and_grads(ours, ours, tokens, labels)
    logit_diff = (ref_logits - our_logits).abs().max().item()
    to_ours = hf_to_ours(LLAMA3, args)
    assert {to_ours[n] for n in ref_grads} == set(our_grads)  # tied: one shared matrix on both sides
    grad_diff = max((ref_grads[n] - our_grads[to_ours[n]]).abs().max().item() for n in ref_grads)
    norm_diff = abs(total_norm(ref_grads) - total_norm(our_grads))
    measured = f"ours vs HF {name}: max |logit diff| {logit_diff:.2e}, grad norm diff {norm_diff:.2e}, max |grad diff| {grad_diff:.2e}"
    print(measured)  # pytest -s shows what was measured
    assert logit_diff <= TOL and norm_diff <= TOL and grad_diff <= TOL, measured

    if args.rope_scaling is not None:  # the tolerance is meaningful: a RoPE mistake is seen
        unscaled = Transformer(dataclasses.replace(args, rope_scaling=None))
        unscaled.load_state_dict(ours.state_dict())
        assert (unscaled(tokens) - our_logits).abs().max().item() > 0.1


def test_torchtitan_parity(hf_case: tuple[str, Path]) -> None:
    """torchtitan's Llama 3, loaded through its own HF adapter (which permutes q/k into Meta's
    interleaved RoPE layout), computes the same function as ours loaded through from_hf."""
    tt_model = pytest.importorskip(
        "torchtitan.models.llama3.model.model",
        reason="torchtitan is not importable (pip install -e .[dev] installs torchtitan==0.2.2 and triton)",
    )
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
    from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

    name, folder = hf_case
    ours, args = from_hf(folder)
    s = args.rope_scaling
    tt_args = TransformerModelArgs(
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.kv_heads,
        vocab_size=args.vocab_size,
        norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        max_seq_len=SEQ,
        # torchtitan sizes the MLP only by Llama's rule: multiple_of = the width and a multiplier that
        # lands the rule at or just below it make the rule round up to exactly that width.
        multiple_of=args.hidden_dim,
        ffn_dim_multiplier=args.hidden_dim / int(8 * args.dim / 3),
        # torchtitan 0.2.2 always applies llama3 scaling; factor 1 makes it the identity.
        rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0)
        if s is None
        else RoPEScalingArgs(
            scaling_factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        ),
    )
    adapter = Llama3StateDictAdapter(tt_args, None)
    hf_state = LlamaForCausalLM.from_pretrained(folder).state_dict()
    if args.tie_word_embeddings:  # torchtitan 0.2.2 has no tied embeddings: an equal copy computes the same
        hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]
    tt = tt_model.Transformer(tt_args)
    tt.load_state_dict({k: v.clone() for k, v in adapter.from_hf(hf_state).items()}, strict=True)
    tokens, labels = batch(args.vocab_size, seed=1)

    tt_logits, tt_grads = logits_and_grads(tt, tt, tokens, labels)
    our_logits, our_grads = logits_and_grads(ours, ours, tokens, labels)
    tt_grads = adapter.to_hf(tt_grads)  # back to HF layout (un-permuted), comparable with ours
    if args.tie_word_embeddings:  # a tied matrix's gradient is the sum over its two uses
        tt_grads["model.embed_tokens.weight"] = tt_grads["model.embed_tokens.weight"] + tt_grads.pop("lm_head.weight")
    to_ours = hf_to_ours(LLAMA3, args)
    assert {to_ours[n] for n in tt_grads} == set(our_grads)
    logit_diff = (tt_logits - our_logits).abs().max().item()
    grad_diff = max((tt_grads[n] - our_grads[to_ours[n]]).abs().max().item() for n in tt_grads)
    norm_diff = abs(total_norm(tt_grads) - total_norm(our_grads))
    measured = f"ours vs torchtitan {name}: max |logit diff| {logit_diff:.2e}, grad norm diff {norm_diff:.2e}, max |grad diff| {grad_diff:.2e}"
    print(measured)
    assert logit_diff <= TOL and norm_diff <= TOL and grad_diff <= TOL, measured


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_ours_to_hf_to_transformers_to_ours(tied: bool, tmp_path: Path) -> None:
    small = dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, rope_scaling=RopeScaling(original_max_position_embeddings=64)
    )
    args = with_seq_len(dataclasses.replace(FLAVORS["debugmodel"], **small, tie_word_embeddings=tied), 128)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    to_hf(model, LLAMA3, args, tmp_path / "exported", max_shard_bytes=100_000)  # several shards + index
    assert (tmp_path / "exported" / "model.safetensors.index.json").is_file()

    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    tokens, _ = batch(args.vocab_size)
    assert (hf(tokens).logits - model(tokens)).abs().max().item() <= TOL
    hf.save_pretrained(tmp_path / "resaved")

    back, back_args = from_hf(tmp_path / "resaved")
    assert back_args == args
    theirs, ours = back.state_dict(), model.state_dict()
    assert theirs.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name


def published(**changes) -> dict:
    """Llama 3.1 8B's config.json (as published, transformers 4 layout), with changes."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1, "torch_dtype": "bfloat16",
        "rope_scaling": {
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3",
        },
    }  # fmt: skip
    return {**config, **changes}


PUBLISHED = {
    "llama3_8b": published(),
    "llama3_70b": published(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
    "llama3_405b": published(
        hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128
    ),
    "llama3_1b": published(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64, tie_word_embeddings=True,
        rope_scaling={**published()["rope_scaling"], "factor": 32.0},
    ),
    "llama3_3b": published(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, head_dim=128,
        tie_word_embeddings=True, rope_scaling={**published()["rope_scaling"], "factor": 32.0},
    ),
}  # fmt: skip


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_configs_map_onto_flavors(flavor: str, tmp_path: Path) -> None:
    args = model_args_from_hf(LLAMA3, write_config(tmp_path / "v4", PUBLISHED[flavor]))
    assert args == FLAVORS[flavor]
    # transformers 5 writes rope_theta inside one rope_parameters dict: the same model.
    LlamaConfig(**PUBLISHED[flavor]).save_pretrained(tmp_path / "v5")
    assert "rope_parameters" in json.loads((tmp_path / "v5" / "config.json").read_text())
    assert model_args_from_hf(LLAMA3, tmp_path / "v5") == args
    assert (
        model_args_from_hf(LLAMA3, write_config(tmp_path / "ours", hf_config(LLAMA3, args, dtype=torch.bfloat16)))
        == args
    )


def test_unrepresentable_configs_are_refused_naming_each_field(tmp_path: Path) -> None:
    bad = published(
        hidden_act="gelu",
        attention_bias=True,
        head_dim=256,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
    )
    with pytest.raises(ConfigError) as info:
        model_args_from_hf(LLAMA3, write_config(tmp_path / "bad", bad))
    problems = info.value.problems
    assert len(problems) == 4, problems
    for field in ("hidden_act = 'gelu'", "attention_bias = True", "head_dim = 256", "rope_scaling.rope_type = 'yarn'"):
        assert sum(field in p for p in problems) == 1, (field, problems)
    with pytest.raises(ConfigError, match="model_type = 'mistral' is not a llama3 model"):
        model_args_from_hf(LLAMA3, write_config(tmp_path / "m", published(model_type="mistral")))
    # Through the training config, with the key to fix.
    with pytest.raises(ConfigError) as info:
        load_config([f"--model.hf_assets_path={tmp_path / 'bad'}", *REPO_DATA])
    assert len(info.value.problems) == 4
    assert all(p.startswith("model.hf_assets_path: ") for p in info.value.problems), info.value.problems


@pytest.mark.parametrize("name", NAMES)
def test_every_family_reads_the_shared_fields_alike(name: str) -> None:
    """models/hf_reader.py reads what the families share: the same key gets the same line in each, a JSON true is no
    size, a null head_dim or num_key_value_heads means what transformers makes of it, and transformers 5's
    rope_parameters gives the same theta as rope_theta."""
    fam = family(name)
    cfg = fam.hf.hf_config(fam.flavors["debugmodel"], dtype=torch.float32)
    bad = cfg | {"num_hidden_layers": True, "attention_dropout": 0.1, "rope_scaling": {"rope_type": "yarn"}}
    with pytest.raises(ConfigError) as info:
        fam.hf.model_args_from_hf_config(bad, source="x")
    assert info.value.problems == ["x: num_hidden_layers = True must be a positive integer"]
    with pytest.raises(ConfigError) as info:
        fam.hf.model_args_from_hf_config(bad | {"num_hidden_layers": 2}, source="x")
    assert sorted(info.value.problems) == [
        "x: attention_dropout = 0.1 is not supported; the model has no dropout (set it to 0.0)",
        "x: rope_scaling.rope_type = 'yarn' is not supported; the model implements RoPE without scaling"
        + (" or 'llama3' scaling" if name == "llama3" else ""),
    ]
    args = fam.hf.model_args_from_hf_config(cfg | {"num_key_value_heads": None}, source="x")
    assert args.kv_heads == args.n_heads
    derived = cfg | {
        "head_dim": None,
        "rope_theta": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 7.0},
    }
    args = fam.hf.model_args_from_hf_config(derived, source="x")
    assert (args.head_dim, args.rope_theta) == (args.dim // args.n_heads, 7.0)


def test_missing_or_foreign_weights_are_named(tmp_path: Path) -> None:
    folder = tiny_hf_folder(tmp_path / "hf", num_hidden_layers=1)
    config = json.loads((folder / "config.json").read_text())
    write_config(folder, {**config, "num_hidden_layers": 2})  # the weights hold one layer
    with pytest.raises(ConfigError, match=r"weights missing, e.g. model.layers.1.self_attn.q_proj.weight"):
        from_hf(folder)
    write_config(folder, {**config, "intermediate_size": 100})
    with pytest.raises(ConfigError, match=r"mlp.down_proj.weight has shape \(64, 192\), the model expects \(64, 100\)"):
        from_hf(folder)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one-process DCP load, on purpose
def test_bf16_hf_checkpoint_converts_and_loads_into_fp32_parameters(tmp_path: Path) -> None:
    """to-dcp keeps bf16 by default; train.py's weights-only load upcasts it exactly."""
    from checkpoint import CheckpointManager

    model = tiny_hf_model(tie_word_embeddings=True).to(torch.bfloat16)
    folder = save_hf_folder(model, tmp_path / "hf", tokenizer=False)
    proc = python("scripts/convert_hf.py", "to-dcp", str(folder), str(tmp_path / "dcp"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "dcp" / "checksums.json").is_file()  # checked when loaded, as train.py's own saves are
    expected, args = from_hf(folder)  # fp32 upcast of the bf16 weights
    with torch.device("meta"):
        target = Transformer(args)
    target.to_empty(device="cpu")
    cfg = Checkpoint(initial_load_path=str(tmp_path / "dcp"))
    CheckpointManager(cfg, dump_folder=str(tmp_path), model=target, optimizer=None, stateful={}).load()
    for name, tensor in expected.state_dict().items():
        assert target.state_dict()[name].dtype == torch.float32 and torch.equal(target.state_dict()[name], tensor)
    assert python("scripts/convert_hf.py", "to-dcp", str(folder), str(tmp_path / "dcp")).returncode == 2  # exists


def test_hf_assets_path_gives_the_tokenizer_and_the_flavor_the_shape(tmp_path: Path) -> None:
    """torchtitan's meaning: the flavor is the shape, and config.json must agree with it; a Llama of
    another size takes its shape from config.json with shape_from_hf_config."""
    from train import config_summary

    folder = tiny_hf_folder(tmp_path / "hf")
    base = ["--config", str(REPO / "configs/finetune_hf.toml"), f"--model.hf_assets_path={folder}", *REPO_DATA[1:]]
    (problem,) = problems_of([*base, "--training.seq_len=64"])
    assert problem.startswith(f"model.flavor: llama3_1b is not the model of {folder / 'config.json'}"), problem
    assert problem.endswith("fix the flavor, or set model.shape_from_hf_config = true"), problem
    cfg = load_config([*base, "--training.seq_len=64", "--model.shape_from_hf_config"])
    assert cfg.model.tokenizer_path == str(folder)  # no tokenizer_path: the HF folder's tokenizer
    assert f"# parameters: {num_params(model_args_from_hf(LLAMA3, folder)):,}" in config_summary(cfg)


def problems_of(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    return info.value.problems


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_two_rank_fsdp_fine_tune_from_hf_weights_matches_hf_loss_then_exports(tmp_path: Path) -> None:
    """configs/finetune_hf.toml as torchtitan runs it: the safetensors read straight into FSDP shards
    (initial_load_in_hf), the last step written back as a Hugging Face folder (last_save_in_hf)."""
    hf_folder = tiny_hf_folder(tmp_path / "hf", seed=7, tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE)
    dump, seq, local_bs = tmp_path / "run", 32, 2
    run = torchrun(
        "train.py",
        "--config",
        "configs/finetune_hf.toml",
        f"--model.hf_assets_path={hf_folder}",
        "--model.shape_from_hf_config",
        f"--job.dump_folder={dump}",
        "--training.steps=1",
        f"--training.seq_len={seq}",
        f"--training.local_batch_size={local_bs}",
        "--training.mixed_precision_param=float32",
        "--activation_checkpoint.mode=none",
        "--metrics.log_freq=1",
        "--optimizer.lr=1e-3",
        "--checkpoint.export_dtype=float32",
        nproc=2,
    )
    assert "world 2 = replicate 1 x shard 2 x tp 1" in run.stdout
    assert f"initialized model weights from the Hugging Face folder {hf_folder}" in run.stdout
    step1 = json.loads((dump / "metrics.jsonl").read_text().splitlines()[0])
    assert step1["step"] == 1

    # The same first global batch (2 ranks x local_bs sequences) through transformers, one process.
    data = Data(path=str(REPO / "assets/corpus/stories.jsonl"))
    corpus = open_corpus(data, build_tokenizer(str(hf_folder)), str(hf_folder))
    loader = GlobalBatchLoader(
        corpus, window=seq + 1, local_batch_size=2 * local_bs, global_batch_size=2 * local_bs, dp_rank=0, dp_degree=1
    )
    ((inputs, labels, *_),) = loader.next_step()
    hf = AutoModelForCausalLM.from_pretrained(hf_folder)
    with torch.no_grad():
        hf_loss = F.cross_entropy(hf(inputs).logits.flatten(0, 1), labels.flatten()).item()
    measured = f"2-rank FSDP step-1 loss {step1['loss']!r} vs one-process HF loss {hf_loss!r}"
    print(measured)
    assert abs(step1["loss"] - hf_loss) <= 1e-5, measured

    # The run's own export of its last step, and convert_hf.py's of the same (FSDP-sharded, with
    # optimizer state) checkpoint, in several files: the same weights.
    own = dump / "checkpoint" / "step-1-hf"
    assert (own / "tokenizer.json").is_file() and json.loads((own / "config.json").read_text())[
        "torch_dtype"
    ] == "float32"
    exported = tmp_path / "exported"
    proc = python(
        "scripts/convert_hf.py",
        "to-hf",
        str(dump / "checkpoint" / "step-1"),
        str(exported),
        f"--hf-assets-path={hf_folder}",
        "--dtype=float32",
        "--max-shard-gb=0.0002",
    )
    assert proc.returncode == 0, proc.stderr
    assert (exported / "model.safetensors.index.json").is_file() and (exported / "tokenizer.json").is_file()
    trained, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not any(info.values()), info
    ours, _ = from_hf(exported)
    stored = {f"model_and_optimizer.model.{k}": torch.empty_like(v) for k, v in ours.state_dict().items()}
    dcp.load(stored, checkpoint_id=str(dump / "checkpoint" / "step-1"))
    for name, tensor in ours.state_dict().items():
        assert torch.equal(stored[f"model_and_optimizer.model.{name}"], tensor), name
    own_model, _ = from_hf(own)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(own_model.state_dict()[name], tensor), name
    initial, _ = from_hf(hf_folder)
    assert not torch.equal(initial.norm.weight, ours.norm.weight)  # the step did train
    with torch.no_grad():
        assert (trained(inputs).logits - ours(inputs)).abs().max().item() <= TOL
