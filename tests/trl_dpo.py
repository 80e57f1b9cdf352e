"""TRL 1.16's DPOTrainer, run offline on CPU in fp32 on token ids given here: the outside reference the recipe's DPO
is checked against (run_trl_dpo), and TRL's own tokenization of text and conversational rows (trl_tokenize).

What TRL 1.16 computes (trl/trainer/dpo_trainer.py, read for this; the recipe must match it):

- Sequences. A pair is two rows, prompt + chosen and prompt + rejected, right-padded to the batch's longest (pad id:
  the tokenizer's pad token, else its EOS; attention mask 0 there). A batch of n pairs is 2n rows: the n chosen first,
  then the n rejected, in dataset order.
- Log-probs. logp(y) = the sum, over the completion's tokens, of log softmax(logits at the previous position)[token]:
  the prompt's tokens are not counted, every completion token is (its last one included, EOS or not), none is
  normalized by length. TRL's fused LM head computes it in fp32 chunks of the vocabulary, never the whole logits.
  (An empty prompt would leave the completion's first token unscored: nothing precedes it.)
- Rewards. delta_c = logp_policy(chosen) - logp_ref(chosen), delta_r likewise, delta = delta_c - delta_r;
  r_c = beta delta_c, r_r = beta delta_r.
- Losses, per pair, then a mean over the micro-batch's pairs:
    sigmoid  -log sigmoid(beta delta)          (label_smoothing unused: older TRL's cDPO smoothing is gone)
    hinge    relu(1 - beta delta)
    ipo      (delta_c / |c| - delta_r / |r| - 1 / (2 beta))^2, |c| and |r| the completions' token counts (min 1):
             IPO alone is length-normalized
    robust   (-(1 - eps) log sigmoid(beta delta) + eps log sigmoid(-beta delta)) / (1 - 2 eps), eps = label_smoothing
    sft      -(the mean, over every chosen completion token of the micro-batch, of its log-prob): a token mean over
             the micro-batch, not per sequence; the rejected replies and the reference play no part
  `loss_weights` (default all 1.0) weight them: loss = sum_k w_k mean_pairs(loss_k). label_smoothing enters only
  robust (and exo_pair / aot, not used here).
- Metrics, each the micro-batch's mean over its pairs: rewards/chosen = mean r_c, rewards/rejected = mean r_r,
  rewards/margins = mean (r_c - r_r), rewards/accuracies = mean [r_c > r_r] (strict: a tie, as at step 1, is 0),
  logps/chosen and logps/rejected = the mean over pairs of the policy's (not the reference's) summed log-probs.
  Token means over the micro-batch's completion tokens: logits/chosen and logits/rejected (the logits' mean over the
  vocabulary, averaged over the chosen / rejected completion tokens), entropy (over the completion tokens of both),
  mean_token_accuracy (the share of chosen completion tokens that are the argmax). num_tokens counts every non-pad
  token (prompt included, twice per pair) seen so far. Besides TRL's: transformers' loss, grad_norm (before any
  clipping, computed even with clipping off), learning_rate (the one the step used), epoch, step.
- Reduction. Every metric above is appended once per micro-batch; a log line averages them over the micro-batches
  since the last log (logging_steps=1 here: the step's micro-batches), an unweighted mean of micro-batch means. The
  logged loss is transformers' (sum over micro-batches of loss / accumulation steps); the gradient is of that same sum.
  So with several micro-batches sft's token mean is per micro-batch, then averaged: not a token mean over the step.
- Data. Text rows: TRL appends the EOS token's text to chosen and rejected unless they end with it, tokenizes
  prompt, prompt + chosen and prompt + rejected with the tokenizer's own framing (a BOS where it adds one) and splits
  at their common prefix. Conversational rows: prompt_ids = the template on the prompt with add_generation_prompt;
  chosen_ids = the template on prompt + chosen (no generation prompt) past its common prefix with prompt_ids (TRL adds
  no EOS: the template's end of turn is the reply's last token). On the shipped template that is prompt =
  {{bos_token}} <|user|>\\n text \\n <|assistant|>\\n (earlier turns, the template's, before it), chosen = the reply's
  tokens + EOS. The template's {{bos_token}} is whatever the tokenizer names: <|begin_of_text|> (id 0) under
  tests/tiny_hf.py's llama3 convention, <|end_of_text|> (id 1) under smollm2, nothing under qwen3.

run_trl_dpo feeds its token ids to TRL unchanged: TRL 1.16's DPOTrainer has no pre-tokenized input (its dataset
preparation always renders text), so a subclass replaces that one method with the identity, giving the collator the
prompt_ids / chosen_ids / rejected_ids columns TRL's own tokenization would have made. No BOS or EOS is added, nothing
is truncated (max_length None). The reference is TRL's default, a frozen copy loaded from the same folder; with
precompute_ref=True TRL instead scores every pair with the initial policy before step 1 (in the same batches): both
give the same numbers, bit for bit (every metric of 3 steps, checked on the tiny Llama).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

PAIR_KEYS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")


class _OfflineDPOTrainer(DPOTrainer):
    def _send_telemetry(self) -> None:
        pass  # offline: huggingface_hub read HF_HUB_DISABLE_TELEMETRY when it was imported, perhaps before us


class _TokenizedDPOTrainer(_OfflineDPOTrainer):
    """DPOTrainer on rows that are already TRL's tokenized form (prompt_ids, chosen_ids, rejected_ids)."""

    def _prepare_dataset(self, dataset: Dataset, processing_class: Any, args: DPOConfig, dataset_name: str) -> Dataset:
        return dataset  # what TRL's tokenization returns: the collator takes these columns as they are


def _config(output_dir: Path, **settings: Any) -> DPOConfig:
    """A DPOConfig for a plain fp32 CPU run: no bf16 (TRL's default), no gradient checkpointing, nothing reported or
    saved, no progress bar."""
    return DPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_length=None,
        **settings,
    )


def run_trl_dpo(
    model_dir: Path,
    pairs: list[dict[str, list[int]]],
    *,
    beta: float,
    loss_type: list[str],
    loss_weights: list[float] | None,
    label_smoothing: float = 0.0,
    lr: float,
    steps: int,
    pairs_per_step: int,
    output_dir: Path,
    max_grad_norm: float | None = None,
    weight_decay: float = 0.0,
    adam_betas: tuple[float, float] = (0.9, 0.95),
    adam_eps: float = 1e-8,
    micro_batches: int = 1,
    precompute_ref: bool = False,
    adapter: Path | None = None,
) -> list[dict[str, float]]:
    """TRL's logged metrics at each of `steps` optimizer steps (one dict a step, in order) of DPOTrainer on the
    transformers model in `model_dir` (its tokenizer files too: the pad id), fp32, eager attention.

    `pairs` (prompt_input_ids, chosen_input_ids, rejected_input_ids each) are scored exactly as given, consumed in
    order, pairs_per_step a step in `micro_batches` equal micro-batches. torch's AdamW over every parameter (one
    group: weight decay on all, as the recipe's), a constant learning rate from step 1, no clipping unless
    max_grad_norm. The reference is a frozen copy of the initial weights, or (precompute_ref) their log-probs computed
    before step 1. adapter: a PEFT adapter folder the policy trains (PeftModel, the base frozen, AdamW over the
    adapters); TRL's reference is then the model with its adapters disabled, no copy.
    """
    if len(pairs) != steps * pairs_per_step:
        raise ValueError(
            f"{len(pairs)} pairs for {steps} steps of {pairs_per_step}: pass exactly steps x pairs_per_step"
        )
    if pairs_per_step % micro_batches:
        raise ValueError(f"pairs_per_step {pairs_per_step} does not split into {micro_batches} equal micro-batches")
    for i, pair in enumerate(pairs):
        if sorted(pair) != sorted(PAIR_KEYS) or not pair["chosen_input_ids"] or not pair["rejected_input_ids"]:
            raise ValueError(f"pair {i}: keys {sorted(pair)}, want {list(PAIR_KEYS)} with non-empty replies")
    dataset = Dataset.from_dict(
        {
            "prompt_ids": [p["prompt_input_ids"] for p in pairs],
            "chosen_ids": [p["chosen_input_ids"] for p in pairs],
            "rejected_ids": [p["rejected_input_ids"] for p in pairs],
        }
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=adam_betas, eps=adam_eps, weight_decay=weight_decay)
    args = _config(
        output_dir,
        per_device_train_batch_size=pairs_per_step // micro_batches,
        gradient_accumulation_steps=micro_batches,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        # transformers clips when max_grad_norm > 0; 0 still computes and logs the norm
        max_grad_norm=max_grad_norm or 0.0,
        weight_decay=weight_decay,
        logging_steps=1,
        # transformers shuffles by default (RandomSampler); "sequential" keeps the dataset's order
        train_sampling_strategy="sequential",
        beta=beta,
        loss_type=list(loss_type),
        loss_weights=None if loss_weights is None else list(loss_weights),
        label_smoothing=label_smoothing,
        precompute_ref_log_probs=precompute_ref,
        precompute_ref_batch_size=pairs_per_step // micro_batches,
    )
    trainer = _TokenizedDPOTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        optimizers=(optimizer, None),
    )
    trainer.train()
    logs = [{k: float(v) for k, v in entry.items()} for entry in trainer.state.log_history if "rewards/chosen" in entry]
    assert [entry["step"] for entry in logs] == list(range(1, steps + 1)), [entry["step"] for entry in logs]
    return logs


def trl_tokenize(model_dir: Path, rows: list[dict[str, Any]], *, output_dir: Path) -> list[dict[str, list[int]]]:
    """The token ids TRL 1.16's own dataset preparation makes of preference rows (prompt / chosen / rejected as text or
    as conversations) with the tokenizer in `model_dir`, in run_trl_dpo's form."""
    trainer = _OfflineDPOTrainer(
        model=str(model_dir),
        args=_config(output_dir, model_init_kwargs={"dtype": torch.float32, "attn_implementation": "eager"}),
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    data = trainer.train_dataset
    return [
        {"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r}
        for p, c, r in zip(data["prompt_ids"], data["chosen_ids"], data["rejected_ids"], strict=True)
    ]
