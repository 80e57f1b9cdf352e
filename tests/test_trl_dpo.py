"""tests/trl_dpo.py's run of TRL's DPOTrainer against DPO written out here on the transformers model: the same pairs,
one sequence at a time (no padding), torch's AdamW. It checks the wrapper (ids unchanged and in order, constant
learning rate, no clipping, fp32) and the conventions its docstring states (sums over the completion tokens, sft's
token mean per micro-batch, metrics averaged over micro-batches)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.tiny_hf import tiny_hf_folder
from tests.trl_dpo import run_trl_dpo, trl_tokenize

BETA, LR, STEPS, PAIRS_PER_STEP, SFT_WEIGHT = 0.1, 1e-2, 3, 4, 0.2


def random_pairs(n: int, vocab: int, *, seed: int = 0) -> list[dict[str, list[int]]]:
    """Pairs of uneven lengths (so that TRL pads), ids above the shipped tokenizer's two specials."""
    gen = torch.Generator().manual_seed(seed)

    def ids(length: int) -> list[int]:
        return torch.randint(2, vocab, (length,), generator=gen).tolist()

    return [
        {"prompt_input_ids": ids(2 + i % 5), "chosen_input_ids": ids(1 + i % 4), "rejected_input_ids": ids(6 - i % 4)}
        for i in range(n)
    ]


def completion_logprobs(model: torch.nn.Module, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """log p(token | what precedes it) of each reply token, prompt + reply scored alone."""
    ids = torch.tensor([prompt + reply])
    logprobs = F.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0]


def by_hand(model_dir: Path, pairs: list[dict[str, list[int]]], micro_batches: int) -> list[dict[str, float]]:
    """DPO (sigmoid + SFT_WEIGHT x sft) as tests/trl_dpo.py's docstring states TRL computes it."""
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    logs = []
    per_micro = PAIRS_PER_STEP // micro_batches
    for step in range(STEPS):
        step_pairs = pairs[step * PAIRS_PER_STEP : (step + 1) * PAIRS_PER_STEP]
        micro_logs = []
        for m in range(micro_batches):
            rows = step_pairs[m * per_micro : (m + 1) * per_micro]
            chosen = [completion_logprobs(policy, p["prompt_input_ids"], p["chosen_input_ids"]) for p in rows]
            rejected = [completion_logprobs(policy, p["prompt_input_ids"], p["rejected_input_ids"]) for p in rows]
            with torch.no_grad():
                ref_c = torch.stack(
                    [completion_logprobs(reference, p["prompt_input_ids"], p["chosen_input_ids"]).sum() for p in rows]
                )
                ref_r = torch.stack([completion_logprobs(reference, p["prompt_input_ids"], p["rejected_input_ids"]).sum() for p in rows])  # fmt: skip
            logp_c, logp_r = torch.stack([c.sum() for c in chosen]), torch.stack([r.sum() for r in rejected])
            sigmoid = -F.logsigmoid(BETA * ((logp_c - ref_c) - (logp_r - ref_r))).mean()
            sft = -torch.cat(chosen).mean()  # a token mean over the micro-batch's chosen replies
            loss = sigmoid + SFT_WEIGHT * sft
            (loss / micro_batches).backward()
            r_c, r_r = (BETA * (logp_c - ref_c)).detach(), (BETA * (logp_r - ref_r)).detach()
            micro_logs.append(
                {
                    "loss": loss.item(),
                    "rewards/chosen": r_c.mean().item(),
                    "rewards/rejected": r_r.mean().item(),
                    "rewards/margins": (r_c - r_r).mean().item(),
                    "rewards/accuracies": (r_c > r_r).float().mean().item(),
                    "logps/chosen": logp_c.mean().item(),
                    "logps/rejected": logp_r.mean().item(),
                }
            )
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in policy.parameters()])).item()
        optimizer.step()
        optimizer.zero_grad()
        logs.append({k: sum(log[k] for log in micro_logs) / micro_batches for k in micro_logs[0]} | {"grad_norm": norm})
    return logs


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_trl_dpo_equals_dpo_by_hand(tmp_path: Path, micro_batches: int) -> None:
    model_dir = tiny_hf_folder(tmp_path / "hf", seed=1)
    pairs = random_pairs(STEPS * PAIRS_PER_STEP, vocab=2048)
    trl = run_trl_dpo(
        model_dir, pairs, beta=BETA, loss_type=["sigmoid", "sft"], loss_weights=[1.0, SFT_WEIGHT], lr=LR,
        steps=STEPS, pairs_per_step=PAIRS_PER_STEP, micro_batches=micro_batches, output_dir=tmp_path / "trl",
    )  # fmt: skip
    ours = by_hand(model_dir, pairs, micro_batches)

    # Step 1: the policy is the reference, exactly (the same weights, a frozen copy scored on the same batch).
    first = trl[0]
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0, first
    assert first["rewards/accuracies"] == 0.0  # a tie is not a win
    sft_nll = (first["loss"] - math.log(2)) / SFT_WEIGHT
    assert sft_nll == pytest.approx((ours[0]["loss"] - math.log(2)) / SFT_WEIGHT, rel=1e-5)
    assert trl[0]["learning_rate"] == trl[-1]["learning_rate"] == LR

    for step, (theirs, mine) in enumerate(zip(trl, ours, strict=True), start=1):
        for key in ("loss", "logps/chosen", "logps/rejected", "grad_norm"):
            assert theirs[key] == pytest.approx(mine[key], rel=1e-5), (step, key, theirs[key], mine[key])
        # A reward is beta x a difference of two summed log-probs: fp32 rounding of the sums (|logp| ~ 30) is ~1e-6.
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert theirs[key] == pytest.approx(mine[key], rel=1e-4, abs=1e-6), (step, key, theirs[key], mine[key])
        assert theirs["rewards/accuracies"] == mine["rewards/accuracies"], step
    assert abs(trl[-1]["rewards/margins"]) > 1e-3  # the policy moved: the later steps compare something


@pytest.mark.parametrize(
    ("convention", "bos"), [("llama3", "<|begin_of_text|>"), ("smollm2", "<|end_of_text|>"), ("qwen3", "")]
)
def test_trl_tokenize_shipped_template(tmp_path: Path, convention: str, bos: str) -> None:
    """TRL renders a conversational prompt with the generation prompt and takes the reply from the whole conversation:
    on the shipped template, prompt = {{bos_token}} <|user|>\\n text \\n <|assistant|>\\n and the reply ends with EOS."""
    model_dir = tiny_hf_folder(tmp_path / "hf", convention=convention)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [
        {
            "prompt": [{"role": "user", "content": "Who fed the cat?"}],
            "chosen": [{"role": "assistant", "content": "Tom did."}],
            "rejected": [{"role": "assistant", "content": "Nobody."}],
        }
    ]
    (pair,) = trl_tokenize(model_dir, rows, output_dir=tmp_path / "trl")
    assert tok.decode(pair["prompt_input_ids"]) == f"{bos}<|user|>\nWho fed the cat?\n<|assistant|>\n"
    assert tok.decode(pair["chosen_input_ids"]) == "Tom did.<|end_of_text|>"
    assert tok.decode(pair["rejected_input_ids"]) == "Nobody.<|end_of_text|>"
