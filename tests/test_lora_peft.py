"""LoRA adapters out to PEFT's format and in from it, and the merged model, checked against peft and transformers:
our debug models with random adapters (B nonzero) give the logits of peft.PeftModel on the exported base; the merged
Hugging Face folder gives them in transformers; an adapter peft itself made gives PEFT's logits in our model; and
scripts/convert_hf.py does the same on the step folder of a real (two-step) LoRA run, with its refusals, and eval.py
scores that step as it scores the merged folder (in one process, and in one 2-rank TP launch).

Weights are scaled for O(1) activations (tests/tiny_hf.py unit_scale_init_), and each check also asserts that the
adapters move the logits by far more than the tolerance, so that an adapter dropped or scaled wrongly is seen.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from config import Lora
from errors import ConfigError
from inference import load_model
from lora import adapters_off, apply_lora, is_adapter, load_peft_adapter, merge_adapters, scaling, write_peft_folder
from models import family
from models.hf import from_hf, to_hf
from tests.launch import REPO, python, torchrun
from tests.tiny_hf import batch, unit_scale_init_

sys.path.insert(0, str(REPO / "scripts"))
import convert_hf  # noqa: E402 (scripts/convert_hf.py, in this process)

TOL = 1e-4  # tests/test_hf.py's: fp32 on CPU, eager attention
MOVED = 0.1  # the adapters' effect on the logits, at least: a thousand times the tolerance
STEPS_ARGS = [
    "--config", "configs/debug.toml", "--training.steps=2", "--checkpoint.interval=2", "--validation.enable=false",
    "--eval.enable=false", "--training.seq_len=64", "--training.local_batch_size=2", "--lr_scheduler.warmup_steps=1",
    "--optimizer.lr=0.05",
]  # fmt: skip


def ours_with_adapters(name: str, cfg: Lora, *, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(our debug model of family `name` with [lora] `cfg`'s adapters, every weight random at unit scale (B too),
    its base alone as a plain model with the same weights)."""
    fam = family(name)
    args = dataclasses.replace(fam.flavors["debugmodel"], n_layers=2)  # 2 of its 6 blocks: float32 error as test_hf's
    model = fam.model_cls(args)
    apply_lora(model, cfg, fam, base_dtype=torch.float32)
    unit_scale_init_(model, seed=seed)
    base = fam.model_cls(args)
    base.load_state_dict({n: t for n, t in model.state_dict().items() if not is_adapter(n)})
    return model.eval(), base.eval()


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}


def hf_logits(folder: Path, tokens: torch.Tensor, adapter: Path | None = None) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    if adapter is not None:
        hf = PeftModel.from_pretrained(hf, adapter).eval()
    with torch.no_grad():
        return hf(tokens).logits


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


CASES = {
    "llama3-all-linear": ("llama3", Lora(enable=True, r=4, lora_alpha=8.0)),
    "qwen3-qv-rslora": ("qwen3", Lora(enable=True, r=8, lora_alpha=4.0, target_modules=["q_proj", "v_proj"],
                                      use_rslora=True)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_exported_adapter_and_merged_model_give_our_logits_in_peft_and_transformers(case: str, tmp_path: Path) -> None:
    name, cfg = CASES[case]
    model, base = ours_with_adapters(name, cfg)
    fam, args = family(name), model.args
    tokens, _ = batch(args.vocab_size, seq=32)
    with torch.no_grad():
        ours = model(tokens)
        with adapters_off(model):
            assert diff(model(tokens), ours) > MOVED  # the adapters matter

    to_hf(base, fam, args, tmp_path / "base")
    write_peft_folder(
        tmp_path / "peft", adapter_tensors(model), fam=fam, args=args, cfg=cfg, base=str(tmp_path / "base")
    )
    saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert saved["target_modules"] == sorted(saved["target_modules"]) and saved["base_model_name_or_path"]
    peft_diff = diff(hf_logits(tmp_path / "base", tokens, adapter=tmp_path / "peft"), ours)

    merge_adapters(base, adapter_tensors(model), scaling(cfg))
    to_hf(base, fam, args, tmp_path / "merged")
    merged_diff = diff(hf_logits(tmp_path / "merged", tokens), ours)
    # PEFT's own merge of the exported adapter gives the weights ours wrote.
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    theirs = PeftModel.from_pretrained(hf, tmp_path / "peft").merge_and_unload().state_dict()
    written = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    weight_diff = max(diff(theirs[k], written[k]) for k in written)
    print(f"{case}: max |logit diff| PEFT {peft_diff:.2e}, merged {merged_diff:.2e}; merged weights {weight_diff:.2e}")
    assert peft_diff <= TOL and merged_diff <= TOL and weight_diff <= 1e-5


def test_an_adapter_peft_made_gives_peft_logits_as_lora_adapter_path_and_as_generate_adapter(tmp_path: Path) -> None:
    """get_peft_model's adapter (all-linear: PEFT saves the full module names; init_lora_weights=False: B nonzero)
    read by lora.load_peft_adapter into our model with adapters, and merged by inference.load_model's adapter=."""
    _, base = ours_with_adapters("llama3", Lora(enable=True), seed=1)
    fam, args = family("llama3"), base.args
    to_hf(base, fam, args, tmp_path / "base")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    config = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(hf, config).eval()
    peft_model.save_pretrained(tmp_path / "made")
    tokens, _ = batch(args.vocab_size, seq=32)
    with torch.no_grad():
        theirs = peft_model(tokens).logits
        assert diff(theirs, base(tokens)) > MOVED

    cfg = Lora(enable=True, r=4, lora_alpha=16.0, adapter_path=str(tmp_path / "made"))
    ours, _ = from_hf(tmp_path / "base")
    apply_lora(ours, cfg, fam, base_dtype=torch.float32)
    load_peft_adapter(ours, tmp_path / "made", fam, cfg)
    merged, _ = load_model(tmp_path / "base", config=None, device=torch.device("cpu"), dtype=torch.float32,
                           adapter=tmp_path / "made")  # fmt: skip
    with torch.no_grad():
        adapter_diff, merged_diff = diff(ours.eval()(tokens), theirs), diff(merged(tokens), theirs)
    print(f"PEFT-made adapter: max |logit diff| as adapter_path {adapter_diff:.2e}, merged {merged_diff:.2e}")
    assert adapter_diff <= TOL and merged_diff <= TOL


def test_convert_hf_to_peft_and_to_hf_on_a_lora_runs_step_and_its_refusals(tmp_path: Path) -> None:
    """A two-step LoRA run from an HF base (the debug model's initial weights); its step-2 out as a PEFT folder
    (PeftModel on the base) and as the merged model (transformers), both giving the logits of the step loaded by
    inference.load_model (the base of its config.toml, the step's adapters merged); then the refusals."""
    fam = family("llama3")
    torch.manual_seed(0)
    base = fam.model_cls(fam.flavors["debugmodel"])
    base.init_weights()
    to_hf(base, fam, base.args, tmp_path / "base")
    proc = python("train.py", *STEPS_ARGS, f"--job.dump_folder={tmp_path / 'run'}", "--lora.enable", "--lora.r=4",
                  f"--checkpoint.initial_load_path={tmp_path / 'base'}", "--checkpoint.initial_load_in_hf")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = tmp_path / "run/checkpoint/step-2"
    for command, *more in (("to-peft",), ("to-hf", "--dtype", "float32")):
        assert convert_hf.main([command, str(step), str(tmp_path / command), *more]) == 0
        assert not (tmp_path / f"{command}.partial").exists()
    assert json.loads((tmp_path / "to-peft/adapter_config.json").read_text())["r"] == 4

    model, _ = load_model(step, config=None, device=torch.device("cpu"), dtype=torch.float32)
    tokens, _ = batch(model.args.vocab_size, seq=32)
    with torch.no_grad():
        ours = model(tokens)
    peft_diff = diff(hf_logits(tmp_path / "base", tokens, adapter=tmp_path / "to-peft"), ours)
    merged_diff = diff(hf_logits(tmp_path / "to-hf", tokens), ours)
    moved = diff(hf_logits(tmp_path / "base", tokens), ours)
    print(f"step-2: max |logit diff| PEFT {peft_diff:.2e}, merged {merged_diff:.2e}; the adapters move {moved:.2e}")
    assert peft_diff <= TOL and merged_diff <= TOL and moved > MOVED

    # eval.py's held-out loss of the step (the base with the adapters merged into the model as it is built) is the
    # merged folder's, and so on 2 ranks under TP (the adapters merged into each rank's shard of the weights).
    scored = "--validation.steps=1", "--validation.local_batch_size=2", "--validation.seq_len=64"
    config = "--config", str(step.parent / "config.toml")
    procs = [python("eval.py", "--checkpoint", str(c), *config, *scored) for c in (step, tmp_path / "to-hf")]
    tp = "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"
    procs.append(torchrun("eval.py", "--checkpoint", str(step), *config, *scored, *tp, nproc=2))
    assert all(proc.returncode == 0 for proc in procs), [proc.stderr[-2000:] for proc in procs]
    losses = [float(re.search(r"^eval: .* \| loss ([0-9.]+) \|", proc.stdout, re.M)[1]) for proc in procs]
    print(f"eval.py's loss of step-2: {losses[0]} (the merged folder: {losses[1]}, TP 2: {losses[2]})")
    assert losses[0] == losses[1] and losses[2] == pytest.approx(losses[0], abs=2e-4), losses  # (to 4 decimals)

    plain = tmp_path / "plain"
    shutil.copytree(step, plain / "step-2")
    (plain / "config.toml").write_text(
        (step.parent / "config.toml").read_text().replace("[lora]\nenable = true", "[lora]\nenable = false")
    )
    gone = tmp_path / "gone"
    shutil.copytree(step.parent, gone)
    (gone / "config.toml").write_text(
        (gone / "config.toml").read_text().replace(str(tmp_path / "base"), str(tmp_path / "nowhere"))
    )
    baseless = tmp_path / "baseless"
    shutil.copytree(step.parent, baseless)
    text = (baseless / "config.toml").read_text()
    (baseless / "config.toml").write_text(
        text.replace(f'initial_load_path = "{tmp_path / "base"}"\n', "").replace("initial_load_in_hf = true", "")
    )
    seed = tmp_path / "seed"
    convert_hf.hf_to_dcp(tmp_path / "base", seed, dtype=None)  # a step of no LoRA run
    # The command's own way of refusing: one line on stderr, exit 2, nothing written.
    proc = python("scripts/convert_hf.py", "to-peft", str(seed), str(tmp_path / "x"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: --config: no config.toml beside {seed}"), proc.stderr
    for argv, problem in [
        (["to-peft", str(seed), str(tmp_path / "x"), "--config", str(step.parent / "config.toml")],
         f"CHECKPOINT: {seed} holds no LoRA adapters"),
        (["to-peft", str(plain / "step-2"), str(tmp_path / "x")], f"--config: {plain / 'config.toml'} has no [lora] enable = true"),
        (["to-hf", str(plain / "step-2"), str(tmp_path / "x")], f"--config: {plain / 'config.toml'} has no [lora] enable = true"),
        (["to-hf", str(gone / "step-2"), str(tmp_path / "x")], f"checkpoint.initial_load_path: {tmp_path / 'nowhere'} (the adapters' base"),
        (["to-hf", str(baseless / "step-2"), str(tmp_path / "x")], f"checkpoint.initial_load_path: {baseless / 'config.toml'} names no base"),
        (["to-hf", str(seed), str(tmp_path / "x"), "--flavor", "debugmodel", "--base", str(tmp_path / "base")],
         f"--base: {seed} holds no LoRA adapters"),
        (["to-peft", str(step), str(tmp_path / "to-peft")], f"{tmp_path / 'to-peft'}: already exists"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as refused:
            convert_hf.main(argv)
        assert len(refused.value.problems) == 1 and refused.value.problems[0].startswith(problem), (
            refused.value.problems
        )
        assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()
