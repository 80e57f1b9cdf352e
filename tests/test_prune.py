"""scripts/prune.py: a student from its teacher. On tiny random models of every family: the pruned folder loads in
transformers and gives our model's logits; a prune that keeps every channel and head is the teacher's kept blocks
exactly; width keeps the channels and heads of the largest norms (recomputed here from the teacher's weights); the
student trains a step in train.py from it and prunes again from that step's DCP checkpoint; bad input is refused in
one line, exit 2, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from errors import ConfigError
from models import family
from models.hf import from_hf, to_hf
from scripts.prune import main as prune
from tests.launch import python
from tests.tiny_hf import batch, tiny_hf_folder

DENSE = ("llama3", "qwen3", "olmo2")
LAYERS = 3  # tiny_hf's models, one block more: a kept subset in another order


@pytest.fixture(scope="module")
def teachers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Hugging Face folder of each family (with the shipped tokenizer's files), 3 blocks."""
    root = tmp_path_factory.mktemp("teachers")
    return {
        name: tiny_hf_folder(root / name, family=name, seed=3, num_hidden_layers=LAYERS)
        for name in (*DENSE, "qwen3_moe")
    }


def logits(model: nn.Module, vocab: int) -> torch.Tensor:
    with torch.no_grad():
        return model(batch(vocab, seq=16)[0])


@pytest.mark.parametrize("name", [*DENSE, "qwen3_moe"])
def test_the_student_loads_in_transformers_with_our_logits(
    name: str, teachers: dict[str, Path], tmp_path: Path
) -> None:
    """Depth and (dense families) FFN width and (Qwen3, OLMo 2) heads pruned: transformers loads the folder with no
    weight missing, unexpected or mismatched, as the pruned shape, and computes what our model of it computes."""
    width = ["--ffn-dim=100"] if name in DENSE else []
    heads = ["--heads=2"] if name in ("qwen3", "olmo2") else []
    out = tmp_path / "student"
    assert (
        prune(["--from", str(teachers[name]), "--to", str(out), "--layers=2,0", *width, *heads, "--dtype=float32"]) == 0
    )
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert not any(info.values()), info
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    assert config.get("intermediate_size") == (100 if width else config.get("intermediate_size"))
    assert config["num_attention_heads"] == (2 if heads else 4)
    ours, args = from_hf(out)
    tokens = batch(args.vocab_size, seq=16)[0]
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("name", DENSE)
def test_keeping_every_channel_and_head_is_the_teachers_kept_blocks_exactly(
    name: str, teachers: dict[str, Path], tmp_path: Path
) -> None:
    """--layers 2,0 with the full FFN width (and every head where heads prune): the teacher's blocks 2 then 0, the
    others bypassed, give the same logits bit for bit."""
    teacher, args = from_hf(teachers[name])
    heads = [f"--heads={args.n_heads}"] if name != "llama3" else []
    out = tmp_path / "student"
    prune(["--from", str(teachers[name]), "--to", str(out), "--layers=2,0", "--ffn-dim=192", *heads, "--dtype=float32"])
    student, _ = from_hf(out)
    teacher.layers = nn.ModuleDict({"0": teacher.layers["2"], "1": teacher.layers["0"]})
    assert torch.equal(logits(student, args.vocab_size), logits(teacher, args.vocab_size))


@pytest.mark.parametrize("name", ["qwen3", "olmo2"])
def test_width_keeps_the_channels_and_heads_of_the_largest_norms(
    name: str, teachers: dict[str, Path], tmp_path: Path
) -> None:
    """Qwen3 and OLMo 2 (2 key/value heads of 2 query heads each): block 0's heads 0 and 1 made the largest, so the 2 heads of
    the largest norms overall would both be key/value head 0's; each group keeps its own largest instead. FFN
    channels: the 100 of the largest sqrt(|w1 row|^2 + |w3 row|^2 + |w2 column|^2), in order. OLMo 2's QK-norm over
    the whole query projection keeps the kept heads' entries; Qwen3's, over one head, stays whole."""
    teacher, args = from_hf(teachers[name])
    hd = args.head_dim
    with torch.no_grad():
        teacher.layers["0"].attention.wq.weight[: 2 * hd] *= 10
    source = tmp_path / "teacher"
    to_hf(teacher, family(name), args, source)
    out = tmp_path / "student"
    prune(["--from", str(source), "--to", str(out), "--ffn-dim=100", "--heads=2", "--dtype=float32"])
    student, _ = from_hf(out)
    for i in range(LAYERS):
        t, s = teacher.layers[str(i)], student.layers[str(i)]
        ffn = t.feed_forward
        norms = torch.cat([ffn.w1.weight, ffn.w3.weight, ffn.w2.weight.T], dim=1).norm(dim=1)
        channels = norms.argsort(descending=True)[:100].sort().values
        assert torch.equal(s.feed_forward.w1.weight, ffn.w1.weight[channels])
        assert torch.equal(s.feed_forward.w2.weight, ffn.w2.weight[:, channels])
        assert torch.equal(s.feed_forward.w3.weight, ffn.w3.weight[channels])
        wq = t.attention.wq.weight.reshape(args.n_heads, hd, -1).flatten(1)
        wo = t.attention.wo.weight.reshape(args.dim, args.n_heads, hd).transpose(0, 1).flatten(1)
        head_norms = torch.cat([wq, wo], dim=1).norm(dim=1)
        kept = [int(head_norms[:2].argmax()), 2 + int(head_norms[2:].argmax())]
        if i == 0:
            assert kept[0] in (0, 1) and head_norms[:2].min() > head_norms[2:].max()  # the group rule mattered
        rows = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in kept])
        assert torch.equal(s.attention.wq.weight, t.attention.wq.weight[rows])
        assert torch.equal(s.attention.wo.weight, t.attention.wo.weight[:, rows])
        for kept_whole in ("wk", "wv", "k_norm"):  # every key/value head stays
            assert torch.equal(getattr(s.attention, kept_whole).weight, getattr(t.attention, kept_whole).weight)
        q_norm = t.attention.q_norm.weight
        assert torch.equal(s.attention.q_norm.weight, q_norm[rows] if name == "olmo2" else q_norm)


def test_the_student_trains_in_train_py_and_prunes_again_from_its_checkpoint(
    teachers: dict[str, Path], tmp_path: Path
) -> None:
    """The pruned Llama as initial_load_path (the folder gives its shape and tokenizer), one step of train.py in one
    process, its step-1 DCP checkpoint; that step pruned again (config.toml beside it names the model) is that
    step's weights, block 1 alone."""
    student = tmp_path / "student"
    prune(["--from", str(teachers["llama3"]), "--to", str(student), "--layers=0,2", "--ffn-dim=128", "--dtype=float32"])
    dump = tmp_path / "run"
    run = python(
        "train.py", "--config", "configs/debug.toml", f"--model.hf_assets_path={student}",
        f"--model.tokenizer_path={student}", "--model.shape_from_hf_config=true",
        f"--checkpoint.initial_load_path={student}", "--checkpoint.initial_load_in_hf=true",
        f"--job.dump_folder={dump}", "--training.steps=1", "--training.seq_len=32", "--training.local_batch_size=2",
        "--validation.enable=false", "--eval.enable=false", "--metrics.log_freq=1",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"initialized model weights from the Hugging Face folder {student}" in run.stdout
    step = dump / "checkpoint" / "step-1"
    assert (step.parent / "config.toml").is_file()
    again = tmp_path / "again"
    assert refusal(["--from", str(step.parent), "--to", str(again)]).startswith(
        f"--from: {step.parent} is a checkpoint"
    )
    assert prune(["--from", str(step), "--to", str(again), "--layers=1", "--dtype=float32"]) == 0
    from inference import load_model

    trained, _ = load_model(step, config=None, device=torch.device("cpu"), dtype=torch.float32)
    pruned, args = from_hf(again)
    assert args.n_layers == 1 and args.hidden_dim == 128
    ours, theirs = pruned.state_dict(), trained.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name.replace("layers.0.", "layers.1.")]), name


def refusal(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        prune(argv)
    assert len(e.value.problems) == 1, e.value.problems
    return e.value.problems[0]


def test_bad_input_is_refused_in_one_line_naming_the_flag(teachers: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "student"
    llama, qwen, moe = (["--from", str(teachers[n]), "--to", str(out)] for n in ("llama3", "qwen3", "qwen3_moe"))
    assert refusal([*llama, "--layers=0,3"]).startswith("--layers: '0,3' is not a comma-separated list")
    assert refusal([*llama, "--layers=1,1"]).startswith("--layers:")
    assert refusal([*llama, "--layers=a"]).startswith("--layers:")
    assert refusal([*llama, "--ffn-dim=193"]).startswith("--ffn-dim: 193 is not in 1..192")
    assert refusal([*llama, "--heads=2"]).startswith("--heads: llama3 derives head_dim")
    assert refusal([*qwen, "--heads=3"]).startswith("--heads: 3 is not a multiple of the 2 key/value heads")
    assert refusal([*moe, "--ffn-dim=16"]).startswith("--ffn-dim: qwen3_moe is a mixture of experts")
    assert refusal(["--from", str(tmp_path / "nothing"), "--to", str(out)]).startswith("--from:")
    assert refusal(["--from", str(tmp_path), "--to", str(out)]).startswith(
        f"--from: {tmp_path} is no Hugging Face folder"
    )
    (out / "x").mkdir(parents=True)
    assert refusal([*llama]).startswith(f"--to: {out} already exists")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]  # nothing else written, no partial folder
    # As a command: the line on stderr, exit status 2.
    proc = python("scripts/prune.py", "--from", str(teachers["qwen3"]), "--to", str(tmp_path / "other"), "--heads=3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --heads: 3 is not a multiple")
