"""DPO (dpo.py, data/preference.py) against the tool that defines it, TRL 1.16's DPOTrainer (tests/trl_dpo.py): the
same pairs, rendered as TRL renders them, in the same order, fp32, and every logged metric equal at every one of 10
optimizer steps; a resumed run equal to the straight one; the step-1 check that refuses a reference computed another
way; and the pairs' rendering, masks, drops and windows."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from config import REPO
from data.preference import CONTENT, DROPPED, FORMAT, PairRenderer, pair_documents
from tests.launch import python, torchrun
from tests.tiny_hf import tiny_hf_folder, tokenizer_folder
from tests.trl_dpo import run_trl_dpo, trl_tokenize

BETA, LR, STEPS, PAIRS_PER_STEP = 0.1, 1e-3, 10, 4
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")  # fmt: skip


def preference_rows(n: int) -> list[dict[str, Any]]:
    """n conversational pairs from the shipped chat corpus's one-question conversations: the corpus's answer chosen,
    another question's answer rejected."""
    rows = [json.loads(line)["messages"] for line in (REPO / "assets/corpus/chat.jsonl").read_text().splitlines()]
    single = [m for m in rows if len(m) == 2 and m[0]["role"] == "user" and len(m[1]["content"]) < 80]
    return [
        {"prompt": [q], "chosen": [a], "rejected": [single[(i * 7 + 3) % len(single)][1]]}
        for i, (q, a) in enumerate(single[:n])
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def as_trl_pairs(folder: Path, rows: list[dict[str, Any]]) -> list[dict[str, list[int]]]:
    """The recipe's rendering of each row as TRL's tokenized form: the prompt is the tokens the loss skips (mask 0)."""
    renderer, out = PairRenderer(str(folder)), []
    for row in rows:
        c_ids, c_mask, r_ids, r_mask = renderer.render(row, where="a test row")
        prompt = int(np.argmax(c_mask > 0))
        assert (c_mask[prompt:] > 0).all() and (r_mask[prompt:] > 0).all(), "a reply's tokens are its last ones"
        out.append({"prompt_input_ids": c_ids[:prompt], "chosen_input_ids": c_ids[prompt:],
                    "rejected_input_ids": r_ids[prompt:]})  # fmt: skip
    return out


def dpo_run(hf: Path, data: Path, dump: Path, cache: Path, *extra: str) -> Any:
    """One process, the tiny transformers Llama's weights, one pair per window, TRL's settings: constant lr, no
    clipping, no weight decay, fp32, the format tokens counted (TRL counts every reply token)."""
    return python(
        "train.py", "--config", "configs/debug.toml", f"--model.hf_assets_path={hf}", f"--model.tokenizer_path={hf}",
        "--model.shape_from_hf_config", "--checkpoint.initial_load_in_hf", "--model.attn_mask_type=block_causal",
        "--dpo.enable", f"--dpo.beta={BETA}", "--dpo.mask_format_tokens=false", f"--data.path={data}", "--data.chat",
        "--data.pad_samples", f"--data.cache_folder={cache}", f"--job.dump_folder={dump}", f"--training.steps={STEPS}",
        f"--training.local_batch_size={PAIRS_PER_STEP}", "--training.seq_len=127", "--training.max_norm=1e9",
        "--training.mixed_precision_param=float32", "--activation_checkpoint.mode=none", f"--optimizer.lr={LR}",
        "--optimizer.weight_decay=0", "--optimizer.implementation=for-loop", "--lr_scheduler.warmup_steps=0",
        "--lr_scheduler.min_lr_factor=1", "--metrics.log_freq=1", "--validation.enable=false", "--eval.enable=false",
        *extra,
    )  # fmt: skip


def logged(dump: Path) -> list[dict[str, float]]:
    return [row for row in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()) if "loss" in row]


def assert_equal_to_trl(ours: list[dict[str, float]], trl: list[dict[str, float]]) -> str:
    """Every metric within 1e-5 relative; rewards (beta x a difference of two sums of about |logps|) also within
    1e-5 x beta x |logps| absolute, fp32's share of such a difference."""
    worst = 0.0
    for step, (a, b) in enumerate(zip(ours, trl, strict=True), start=1):
        scale = BETA * max(abs(b["logps/chosen"]), abs(b["logps/rejected"]))
        for name in METRICS:
            slack = 1e-5 * abs(b[name]) + (1e-5 * scale if name.startswith("rewards/") else 0.0)
            assert abs(a[name] - b[name]) <= slack + 1e-12, f"step {step} {name}: ours {a[name]!r}, TRL's {b[name]!r}"
            worst = max(worst, abs(a[name] - b[name]) / max(abs(b[name]), 1e-12))
    return f"largest relative difference over {len(ours)} steps: {worst:.2g}"


@pytest.mark.parametrize(
    "loss_type", [["sigmoid"], ["sigmoid", "sft"], ["ipo", "hinge", "robust"]], ids=["sigmoid", "sigmoid+sft", "others"]
)
def test_dpo_equals_trls_dpotrainer_at_every_step(tmp_path: Path, loss_type: list[str]) -> None:
    """10 steps of 4 pairs: loss, rewards/* and logps/* equal to TRL's at every step; step 1 is ln 2 (sigmoid) with
    every reward 0. Sigmoid with the live reference (TRL's default), Llama 3's form (NLL 0.2 on the chosen) with the
    precomputed one, each also resumed from step 5 to the same steps 6..10. TRL's other losses in one run, weighted
    1, 0.5 and 0.25, robust's label smoothing 0.1."""
    hf = tiny_hf_folder(tmp_path / "hf", seed=1)
    rows = preference_rows(STEPS * PAIRS_PER_STEP)
    pairs = as_trl_pairs(hf, rows)
    assert pairs[:6] == trl_tokenize(hf, rows[:6], output_dir=tmp_path / "tok"), "rendered as TRL renders them"
    weights = [1.0, 0.5, 0.25] if "ipo" in loss_type else [1.0, 0.2][: len(loss_type)]
    smoothing = 0.1 if "robust" in loss_type else 0.0
    data, dump, cache = write_jsonl(tmp_path / "pairs.jsonl", rows), tmp_path / "run", tmp_path / "cache"
    resumed_too = loss_type != ["ipo", "hinge", "robust"]
    saves = ["--checkpoint.enable", "--checkpoint.interval=5"] if resumed_too else []
    if loss_type == ["sigmoid"]:  # TRL's own default: a frozen copy of the initial weights scores each micro-batch
        saves.append("--dpo.reference=live")
    kinds = [f"--dpo.loss_type={','.join(loss_type)}", f"--dpo.loss_weights={','.join(map(str, weights))}",
             f"--dpo.label_smoothing={smoothing}"]  # fmt: skip
    run = dpo_run(hf, data, dump, cache, *kinds, *saves)
    assert run.returncode == 0, run.stderr[-3000:]
    live = "--dpo.reference=live" in saves
    assert ("dpo: reference live" if live else "dpo: reference log-probabilities of 40 pairs computed") in run.stdout
    ours = logged(dump)
    trl = run_trl_dpo(hf, pairs, beta=BETA, loss_type=loss_type, loss_weights=weights, lr=LR, steps=STEPS,
                      pairs_per_step=PAIRS_PER_STEP, output_dir=tmp_path / "trl", label_smoothing=smoothing)  # fmt: skip
    print(f"{'+'.join(loss_type)}: {assert_equal_to_trl(ours, trl)}")
    assert ours[0]["rewards/chosen"] == ours[0]["rewards/rejected"] == 0.0
    if loss_type == ["sigmoid"]:
        assert abs(ours[0]["loss"] - math.log(2)) < 1e-7
    if not resumed_too:
        return
    shutil.rmtree(dump / "checkpoint" / "step-10")
    resumed = dpo_run(hf, data, dump, cache, *kinds, *saves)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "reference log-probabilities of" not in resumed.stdout, "a resumed run reads the reference it started from"
    again = logged(dump)[-5:]
    assert [row["step"] for row in again] == [6, 7, 8, 9, 10]
    for a, b in zip(again, ours[5:], strict=True):
        assert all(a[name] == b[name] for name in METRICS), (a, b)


def test_dpo_with_lora_equals_trls_dpotrainer_on_a_peft_model(tmp_path: Path) -> None:
    """LoRA (lora.py): 10 steps from a PEFT adapter made by PEFT itself with B nonzero, so that the policy is not its
    base; the reference is the policy as it started (TRL 1.16 with a PeftModel and no ref_model copies the adapter as a
    frozen "ref" adapter; adapters that start at zero are the base, the adapters off): every metric equal to TRL's at
    every step, step 1's rewards 0."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = tiny_hf_folder(tmp_path / "hf", seed=3)
    torch.manual_seed(0)
    linears = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = tmp_path / "adapter"
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=linears, init_lora_weights=False, task_type="CAUSAL_LM"),
    )
    peft.save_pretrained(adapter)
    rows = preference_rows(STEPS * PAIRS_PER_STEP)
    data, dump, cache = write_jsonl(tmp_path / "pairs.jsonl", rows), tmp_path / "run", tmp_path / "cache"
    lora = ["--lora.enable", f"--lora.adapter_path={adapter}", "--lora.r=4", "--lora.lora_alpha=8"]
    run = dpo_run(hf, data, dump, cache, "--dpo.reference=live", *lora)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "dpo: reference live (the policy as it started, its adapters')" in run.stdout
    ours = logged(dump)
    trl = run_trl_dpo(hf, as_trl_pairs(hf, rows), beta=BETA, loss_type=["sigmoid"], loss_weights=None, lr=LR,
                      steps=STEPS, pairs_per_step=PAIRS_PER_STEP, output_dir=tmp_path / "trl", adapter=adapter)  # fmt: skip
    print(f"LoRA: {assert_equal_to_trl(ours, trl)}")
    assert ours[0]["rewards/chosen"] == ours[0]["rewards/rejected"] == 0.0 and abs(ours[-1]["rewards/margins"]) > 0


def test_a_reference_computed_another_way_stops_step_1_in_one_line(tmp_path: Path) -> None:
    """The reference scored in fp32, the run in bf16: at step 1 the rewards are not 0; the run stops in one line
    that names the difference, exit status 2. And the reference pass resumes from the parts it wrote."""
    hf = tiny_hf_folder(tmp_path / "hf", seed=2)
    data, cache = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(8)), tmp_path / "cache"
    first = dpo_run(hf, data, tmp_path / "a", cache, "--training.steps=1")
    assert first.returncode == 0, first.stderr[-3000:]
    other = dpo_run(hf, data, tmp_path / "b", cache, "--training.steps=1", "--training.mixed_precision_param=bfloat16")
    assert other.returncode == 2, other.stderr[-3000:]
    lines = [line for line in other.stderr.splitlines() if "dpo.reference" in line]
    assert len(lines) == 1 and "mixed_precision_param float32 then, bfloat16 now" in lines[0], other.stderr[-3000:]
    assert "Traceback" not in other.stderr
    # A reference pass stopped after its first block: started again, it scores only what no part holds.
    (table,) = cache.glob("*/reference/*.npy")
    parts, values = table.with_suffix(".parts"), np.load(table)
    parts.mkdir()
    np.save(parts / "part-00000000.npy", np.concatenate([np.arange(len(values))[:, None], values], axis=1))
    table.unlink()
    again = dpo_run(hf, data, tmp_path / "c", cache, "--training.steps=1")
    assert again.returncode == 0 and "the reference pass resumes: 1 of its 1 blocks" in again.stdout, again.stderr
    assert (
        logged(tmp_path / "c")[0]["loss"] == logged(tmp_path / "a")[0]["loss"]
        and np.load(table).tolist() == values.tolist()
    )


@pytest.mark.parametrize("convention", ["llama3", "smollm2", "qwen3"])
def test_pairs_render_as_trl_renders_them_and_mark_only_the_format_tokens(tmp_path: Path, convention: str) -> None:
    """Under real tokenizers' framings (Llama 3's BOS, SmolLM2's, Qwen3's template with <|im_start|>/<|im_end|>): the
    ids are TRL's; the mask's format tokens (2) are the template's tokens inside the reply, its text's are 1."""
    folder = tiny_hf_folder(tmp_path / convention, convention="llama3" if convention == "qwen3" else convention)
    if convention == "qwen3":  # the shipped Qwen3-style tokenizer and template
        shutil.copytree(REPO / "assets" / "tokenizer_qwen3", folder, dirs_exist_ok=True)
    rows = preference_rows(5)
    assert as_trl_pairs(folder, rows) == trl_tokenize(folder, rows, output_dir=tmp_path / "tok")
    renderer = PairRenderer(str(folder))
    c_ids, c_mask, _, _ = renderer.render(rows[0], where="row 0")
    text = renderer.tokenizer.decode([i for i, m in zip(c_ids, c_mask, strict=True) if m == CONTENT])
    assert text.strip() == rows[0]["chosen"][0]["content"]
    formats = [i for i, m in zip(c_ids, c_mask, strict=True) if m == FORMAT]
    end = renderer.chat._hf.convert_tokens_to_ids("<|im_end|>" if convention == "qwen3" else "<|end_of_text|>")
    # Qwen3's template also puts its empty <think></think> block before the reply's text: the template's, so 2.
    assert end in formats and rows[0]["chosen"][0]["content"] not in renderer.tokenizer.decode(formats), formats


def test_rows_that_are_no_pair_are_dropped_and_counted(tmp_path: Path) -> None:
    """An empty reply, equal replies and TRL's implicit prompt (the replies hold the conversation) as data/preference.py
    says; a text row is framed as the tokenizer frames a text, its reply closed by EOS (a format token)."""
    folder = tokenizer_folder(tmp_path / "tok")
    good = preference_rows(2)
    user = good[0]["prompt"]
    rows = [
        good[0],
        {"prompt": user, "chosen": [{"role": "assistant", "content": " "}], "rejected": good[1]["chosen"]},
        {"prompt": user, "chosen": good[0]["chosen"], "rejected": good[0]["chosen"]},
        {"chosen": user + good[0]["chosen"], "rejected": user + good[1]["chosen"]},  # implicit prompt
        {"prompt": "What is 2 plus 2?", "chosen": " 4.", "rejected": " 5."},
    ]
    renderer = PairRenderer(str(folder))
    _, ends, mask, dropped = pair_documents(rows, renderer, origin=lambda i: f"row {i}", dtype=np.dtype(np.uint16))
    assert dropped == {DROPPED[0]: 1, DROPPED[1]: 1}
    assert len(ends) == 6  # three pairs kept, two documents each
    implicit = renderer.render(rows[3], where="row 3")
    assert [list(x) for x in implicit] == [list(x) for x in renderer.render(good[0] | {"rejected": good[1]["chosen"]},
                                                                             where="row 0")]  # fmt: skip
    ids, text_mask, _, _ = renderer.render(rows[4], where="row 4")
    assert ids[0] == renderer.tokenizer.framing.before[0] and ids[-1] == renderer.tokenizer.eos_id
    assert text_mask[-1] == FORMAT and (text_mask[:-1] != FORMAT).all()


def test_the_readmes_dpo_commands_align_a_checkpoint_and_answer(seed: Path, tmp_path: Path) -> None:
    """README's DPO lines as written, on the seed checkpoint instead of the chat fine-tune's, for 2 steps instead of
    60, on 64 of the shipped pairs, into a temporary folder: the reference is scored first, step 1's rewards are 0, the
    held-out chat loss and the lm-eval task are scored during DPO, and the checkpoint answers. The figures the README
    states are those of its results row."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("Then align it with DPO") :]
    train, ask = re.search(r"```bash\n(.*?)```", section, flags=re.S)[1].strip().splitlines()
    assert train.endswith("train.py --config configs/debug_dpo.toml"), train
    pairs = (REPO / "assets/corpus/preferences.jsonl").read_text().splitlines()[:64]
    data, dump = tmp_path / "pairs.jsonl", tmp_path / "debug_dpo"
    data.write_text("\n".join(pairs) + "\n")
    nproc, script, *args = shlex.split(train.removeprefix(".venv/bin/torchrun "))
    run = torchrun(
        script, *args, f"--checkpoint.initial_load_path={seed}", "--training.steps=2", f"--job.dump_folder={dump}",
        f"--data.path={data}", f"--data.cache_folder={tmp_path / 'cache'}", "--metrics.log_freq=1",
        "--metrics.enable_tensorboard", "--metrics.enable_wandb", nproc=int(nproc.removeprefix("--nproc_per_node=")),
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_PROJECT": "test"},
    )  # fmt: skip
    assert "dpo: reference log-probabilities of 64 pairs computed" in run.stdout, run.stdout
    step1 = next(line for line in run.stdout.splitlines() if line.startswith("step 1/2"))
    assert "rewards/chosen 0 | rewards/rejected 0 |" in step1, step1
    assert "validation at step 2" in run.stdout and "eval at step 2: stories_facts" in run.stdout, run.stdout
    # TRL's metrics under their names in metrics.jsonl, TensorBoard and wandb's offline run file alike.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(dump / "tb"))
    events.Reload()
    for row in logged(dump):
        for name in METRICS[1:]:
            tb = {e.step: e.value for e in events.Scalars(name)}
            assert tb[row["step"]] == pytest.approx(row[name], rel=1e-6, abs=1e-9), name
    (run_file,) = (dump / "wandb").glob("offline-run-*/run-*.wandb")
    assert all(name.encode() in run_file.read_bytes() for name in METRICS)
    ask = ask.replace(".venv/bin/python", sys.executable).replace("outputs/debug_dpo", str(dump))
    proc = subprocess.run(["bash", "-c", ask.replace("step-60", "step-2")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("What does a cow say?"), proc.stderr[-3000:]
    stated = re.search(
        r"rewards/accuracies goes from ([\d.]+) at step 5 to ([\d.]+) at step 50", " ".join(text.split())
    )
    rows = [json.loads(line) for line in (REPO / "docs/results/cpu.jsonl").read_text().splitlines()]
    assert set(stated.groups()) <= set(next(row for row in rows if row["id"] == "dpo-1")["figures"]), stated.groups()


def test_pairs_read_alike_from_jsonl_parquet_and_a_datasets_folder(tmp_path: Path) -> None:
    """TRL's preference columns as people hold them: the same rows as JSON lines, a parquet file and a `datasets`
    folder (save_to_disk) prepare into the same tokens and masks, each pair two documents; a preference corpus
    opened as plain data, or plain data as pairs, is refused in one line."""
    import datasets

    from config import Data
    from data.corpus import open_corpus
    from data.tokenizers import build_tokenizer
    from errors import ConfigError

    folder = tokenizer_folder(tmp_path / "tok")
    rows = preference_rows(12)
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "pairs.parquet"))
    table.save_to_disk(str(tmp_path / "pairs_ds"))
    tokenizer, prepared = build_tokenizer(str(folder)), []
    for name in ("pairs.jsonl", "pairs.parquet", "pairs_ds"):
        cfg = Data(path=str(tmp_path / name), chat=True, cache_folder=str(tmp_path / "cache"))
        corpus = open_corpus(cfg, tokenizer, str(folder), pairs=True)
        assert corpus.pairs and corpus.manifest["documents"] == 24, name
        prepared.append((np.concatenate(corpus.tokens).tolist(), np.concatenate(corpus.loss_masks).tolist()))
    assert prepared[0] == prepared[1] == prepared[2]
    with pytest.raises(ConfigError, match="holds preference pairs; set dpo.enable = true"):
        open_corpus(Data(path=str(corpus.folder), chat=True), tokenizer, str(folder))
