"""The config's schema: one dataclass per TOML section, one field per key, each documented (the string under it is
its `--help`); each section checks its own values (its `problems` method). config/__init__.py tells the whole
story."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from config.distill import Distill
from config.dpo import Dpo
from config.lora import Lora
from config.parts import optional_part
from config.torchtitan import (
    OTHER_CONVERTERS,
    Experimental,
    FaultTolerance,
    MemoryEstimation,
    MXLinear,
    QuantizeGroupedMM,
    TorchtitanActivationCheckpoint,
    TorchtitanCheckpoint,
    TorchtitanDebug,
    TorchtitanJob,
    TorchtitanMetrics,
    TorchtitanOptimizer,
    TorchtitanParallelism,
    TorchtitanTraining,
    TorchtitanValidation,
)
from errors import ConfigError, warn
from models import NAMES, ModelFamily, family, parameter_shapes

REPO = Path(__file__).resolve().parents[1]
SHIPPED_TOKENIZER, SHIPPED_CORPUS = "assets/tokenizer", "assets/corpus/stories.jsonl"
# A field that names a file or folder to read; see resolve_input_paths.
INPUT_PATH = {"input_path": True}


# ------------------------------------------------------------------------ sections


@dataclass
class Job(TorchtitanJob):
    """Where a run writes, and what it says about itself."""

    dump_folder: str = "./outputs"
    """Folder for everything a run writes: checkpoints, metrics.jsonl, TensorBoard events."""
    description: str = ""
    """Free text describing the run, printed by rank 0 at start-up (with the keys the command line changes)."""
    print_config: bool = False
    """Print the resolved config (rank 0) at start-up."""
    config_file: str | None = None
    """The TOML file to read (torchtitan's --job.config_file; the same as --config)."""
    save_config_file: str | None = None
    """Also write the resolved config to this file (relative to job.dump_folder) at start-up."""


@dataclass
class ModelMoE:
    """A mixture of experts' load balancing in training (models/moe.py, docs/failures.md #7); nothing for a dense model."""

    router_aux_loss_coef: float = optional_part("models/moe.py", 0.001)
    """Weight of the load-balancing loss num_experts x sum_e f_e x P_e, per MoE layer, averaged over the layers (f_e: the fraction of tokens routed to expert e, P_e: its mean router probability; transformers' name, Qwen3 MoE's value). Logged as moe_aux_loss; 0 = off."""
    aux_loss_scope: Literal["global_batch", "microbatch"] = optional_part("models/moe.py", "global_batch")
    """Over what f counts: global_batch, a whole global batch (every rank's micro-batches; the previous step's, so that every layout trains alike); microbatch, each rank's micro-batch alone, which keeps experts from specializing (docs/failures.md #7)."""
    load_balance_coeff: float = optional_part("models/moe.py", 0.0)
    """Auxiliary-loss-free balancing (DeepSeek V3; torchtitan's MoE argument): after each step every expert's bias on the top-k choice moves this much toward the mean load (torchtitan uses 1e-3). Checkpointed; 0 = off."""

    def problems(self, *, model: str, experts: bool, last_save_in_hf: bool) -> list[str]:
        """The weights are >= 0; a dense model (`experts` False) is given no setting; a model with expert biases is
        not exported to Hugging Face, whose Qwen3MoeForCausalLM has no place for them."""
        p = [
            f"model.moe.{key}: must be >= 0 (0 = off), got {getattr(self, key)}"
            for key in ("router_aux_loss_coef", "load_balance_coeff")
            if getattr(self, key) < 0
        ]
        if not experts:
            default = ModelMoE()
            p += [
                f"model.moe.{f.name}: model.name = {model!r} has no mixture of experts; remove the key"
                for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)
            ]
        elif self.load_balance_coeff > 0 and last_save_in_hf:
            p.append(
                "model.moe.load_balance_coeff: the expert biases move which experts a token picks, and a Hugging Face "
                "folder of this family has no place for them; set checkpoint.last_save_in_hf = false, or this to 0"
            )
        return p

    def applied_to(self, args: Any) -> Any:
        """A mixture of experts' shape `args` with these settings (its `balance`, models/moe.py)."""
        from models.moe import MoEBalance  # (only a mixture of experts has a use for it)

        balance = MoEBalance(self.router_aux_loss_coef, self.aux_loss_scope, self.load_balance_coeff)
        return dataclasses.replace(args, balance=balance)


@dataclass
class Model:
    """Which model: its family, size or Hugging Face folder, tokenizer, converters and attention mask."""

    name: str = "llama3"
    """Model family, a folder of models/ (torchtitan's key): llama3 or qwen3 (models.NAMES)."""
    flavor: str = "debugmodel"
    """Model size: a key of the family's FLAVORS in models/<name>/model.py, or one of its aliases (torchtitan's 8B, ...); a wrong one lists them."""
    hf_assets_path: str | None = field(default=None, metadata=INPUT_PATH)
    """A Hugging Face folder of a model of this family: the tokenizer when tokenizer_path is unset, and the weights with checkpoint.initial_load_in_hf."""
    tokenizer_path: str | None = field(default=None, metadata=INPUT_PATH)
    """A tokenizer.json file, a Hugging Face tokenizer folder, or "byte"; unset: hf_assets_path, else the shipped assets/tokenizer."""
    shape_from_hf_config: bool = False
    """Take the model shape from hf_assets_path's config.json instead of flavor (a model of the family whose size is no flavor)."""
    converters: list[str] = field(default_factory=list)
    """Model converters applied before parallelizing: "quantize.linear.float8" (alias "float8")."""
    print_after_conversion: bool = False
    """Print the model (rank 0) after the converters ran."""
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """causal: every token sees all earlier tokens of its window; block_causal: only those of its own document (FlexAttention on CUDA)."""
    moe: ModelMoE = field(default_factory=ModelMoE)

    def problems(self, *, seq_len: int, validation_seq_len: int | None) -> list[str]:
        """The family and flavor exist, the Hugging Face folder agrees, the model takes the training (and held-out)
        sequence length, and the converters are this recipe's."""
        p = _check_model(self, seq_len=seq_len)
        if validation_seq_len is not None and not p:  # the same rule for held-out sequences
            p += [f"validation.{q.removeprefix('training.')}" for q in _check_model(self, seq_len=validation_seq_len)]
        for converter in self.converters:
            if converter in OTHER_CONVERTERS:
                asks = OTHER_CONVERTERS[converter].format(model=self.name)
                p.append(f"model.converters: {converter!r} asks for {asks}, which this recipe does not do; remove it")
            elif converter != "quantize.linear.float8":
                p.append(
                    f'model.converters: {converter!r} is not a converter of this recipe; use "quantize.linear.float8" (float8 linears)'
                )
        return p


@dataclass
class Training(TorchtitanTraining):
    """The training run: its data (torchtitan's names), batch and sequence sizes, precision, and what a step
    tolerates."""

    dataset: str | None = None
    """torchtitan's dataset name: c4 or c4_validation (hub, prepared with scripts/prepare_data.py), c4_test (./tests/assets/c4_test); unset: data.path."""
    dataset_path: str | None = field(default=None, metadata=INPUT_PATH)
    """A local path for training.dataset (the same as data.path)."""
    steps: int = 10000
    """Number of optimizer steps to train for."""
    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree. Larger values use gradient accumulation."""
    seq_len: int = 2048
    """Tokens per sequence."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    mixed_precision_param: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype FSDP gathers parameters in for forward and backward; the sharded master copy stays float32. float16 is refused: it needs loss scaling."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype FSDP reduces gradients in."""
    enable_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (FSDP CPUOffloadPolicy)."""
    skip_nonfinite_steps: int = 0
    """Steps with a non-finite loss or gradient norm to tolerate: their update is skipped (weights and optimizer state unchanged). One more stops the run, naming the step and the last checkpoint; 0 stops at the first."""
    skip_spike_sigma: float = 0.0
    """Skip the update of a step whose global loss or gradient norm is more than this many standard deviations above the mean of the last training.skip_spike_window steps (OLMo-core's rule; it uses 6). 0 = off. optimizer.py."""
    skip_spike_window: int = 128
    """Steps the spike rule compares with; none is skipped before the window is full (checkpoints save the window: a resumed run goes on with it)."""
    z_loss_weight: float = 0.0
    """Add this weight x mean(logsumexp(logits)^2) to the loss (PaLM's z-loss; OLMo uses 1e-5): it keeps the output logits' normaliser near 1. Logged on its own as z_loss; 0 = off."""
    loss_chunk_tokens: int = -1
    """Output projection + cross-entropy on this many tokens at a time, recomputed in backward (loss.py): the peak holds one chunk's logits instead of the micro-batch's. -1 = 2048 where a micro-batch's fp32 logits on a rank exceed 256 MiB, else all at once; 0 = all at once; a micro-batch of at most this many tokens is one chunk."""
    gc_freq: int = 50
    """Python's garbage collector runs every gc_freq steps on every rank at once, instead of whenever it likes (a pause on one rank stalls all)."""

    def problems(self) -> list[str]:
        p = [
            f"training.{key}: must be >= 1, got {getattr(self, key)}"
            for key in ("steps", "local_batch_size", "gc_freq")
            if getattr(self, key) < 1
        ]
        if self.seq_len < 2:
            p.append(f"training.seq_len: must be >= 2, got {self.seq_len}")
        if self.global_batch_size != -1 and self.global_batch_size < self.local_batch_size:
            p.append(
                f"training.global_batch_size: {self.global_batch_size} is below local_batch_size {self.local_batch_size}; use -1 or a multiple of local_batch_size x data-parallel degree"
            )
        if self.max_norm < 0:
            p.append(f"training.max_norm: must be >= 0 (0 disables clipping), got {self.max_norm}")
        if self.mixed_precision_param == "float16":
            p.append(
                "training.mixed_precision_param: float16 needs loss scaling to keep small gradients from underflowing "
                "to zero, which this recipe does not implement; use bfloat16 (same memory, float32's exponent range)"
            )
        if self.skip_nonfinite_steps < 0:
            p.append(f"training.skip_nonfinite_steps: must be >= 0, got {self.skip_nonfinite_steps}")
        if self.skip_spike_sigma < 0:
            p.append(
                f"training.skip_spike_sigma: must be >= 0 (0 = off; OLMo-core uses 6), got {self.skip_spike_sigma}"
            )
        if self.skip_spike_window < 2:
            p.append(
                f"training.skip_spike_window: must be >= 2 (a standard deviation needs two steps), got {self.skip_spike_window}"
            )
        if self.z_loss_weight < 0:
            p.append(
                f"training.z_loss_weight: must be >= 0 (0 = off; PaLM and OLMo use 1e-4 and 1e-5), got {self.z_loss_weight}"
            )
        if self.loss_chunk_tokens < -1:
            p.append(
                f"training.loss_chunk_tokens: must be >= 0 (0 = no chunks) or -1 (chunks where the logits are large), got {self.loss_chunk_tokens}"
            )
        return p


@dataclass
class Optimizer(TorchtitanOptimizer):
    """The optimizer (AdamW, or Muon with AdamW) and its hyperparameters."""

    name: Literal["AdamW", "Muon"] = "AdamW"
    """Optimizer (torchtitan's key): AdamW, or Muon for the family's hidden matrices (ModelFamily.hidden_matrices) with AdamW for every other parameter (muon.py)."""
    lr: float = 8e-4
    """Peak learning rate, reached at the end of warmup."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """AdamW kernel: fused (one kernel, CUDA and CPU), foreach (multi-tensor) or for-loop."""
    muon_momentum: float = 0.95
    """Muon's momentum (torch.optim.Muon's); its lr and weight decay are optimizer.lr and weight_decay."""
    muon_nesterov: bool = True
    """Muon: orthogonalize the Nesterov look-ahead (gradient lerped toward the momentum) instead of the momentum."""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations (torch.optim.Muon's quintic, in bfloat16)."""
    muon_adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon's lr per matrix: match_rms_adamw scales it by 0.2 sqrt(max(rows, cols)) so updates have AdamW's RMS and one lr schedule serves both; original: sqrt(max(1, rows / cols))."""
    muon_orthogonalize: Literal["matrix", "shard"] = "matrix"
    """Muon: orthogonalize each whole matrix (gathered to one rank); "shard" orthogonalizes each rank's shard alone, a different optimizer, only to reproduce docs/failures.md #6."""

    def problems(self) -> list[str]:
        p = []
        if self.lr <= 0:
            p.append(f"optimizer.lr: must be > 0, got {self.lr}")
        if self.eps <= 0:
            p.append(f"optimizer.eps: must be > 0 (it keeps AdamW's division away from zero), got {self.eps}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            p.append(f"optimizer.beta1/beta2: must lie in [0, 1), got {self.beta1}, {self.beta2}")
        if not 0 <= self.muon_momentum < 1:
            p.append(f"optimizer.muon_momentum: must lie in [0, 1), got {self.muon_momentum}")
        if not 1 <= self.muon_ns_steps < 100:
            p.append(f"optimizer.muon_ns_steps: expected 1 to 99 Newton-Schulz iterations, got {self.muon_ns_steps}")
        return p


@dataclass
class LRScheduler:
    """The learning-rate schedule: linear warmup, then a decay (torchtitan's schedule)."""

    warmup_steps: int = 200
    """Steps of linear warmup: step s (from 0) uses lr x (s + 1) / warmup_steps (torchtitan's schedule)."""
    total_steps: int | None = None
    """Steps the schedule spans; unset: training.steps."""
    decay_ratio: float | None = None
    """Fraction of the steps spent decaying at the end; unset: decay over all steps after warmup."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay from optimizer.lr to lr x min_lr_factor."""
    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of optimizer.lr."""

    def problems(self, *, training_steps: int) -> list[str]:
        p = []
        total = self.total_steps if self.total_steps is not None else training_steps
        if self.warmup_steps < 0:
            p.append(f"lr_scheduler.warmup_steps: must be >= 0, got {self.warmup_steps}")
        elif self.warmup_steps > total:
            warn(
                f"lr_scheduler.warmup_steps = {self.warmup_steps} exceeds the {total} steps of the schedule; warming "
                f"up over {total} steps instead (as torchtitan does)"
            )
        if self.total_steps is not None and self.total_steps < 1:
            p.append(f"lr_scheduler.total_steps: must be >= 1 or unset, got {self.total_steps}")
        if self.decay_ratio is not None and not 0 < self.decay_ratio <= 1:
            p.append(f"lr_scheduler.decay_ratio: must lie in (0, 1] or be unset, got {self.decay_ratio}")
        if not 0 <= self.min_lr_factor <= 1:
            p.append(f"lr_scheduler.min_lr_factor: must lie in [0, 1], got {self.min_lr_factor}")
        return p


@dataclass
class Data:
    """The training data: prepared folders, raw files read at start-up, or a mixture, and the order read."""

    path: str | None = field(default=None, metadata=INPUT_PATH)
    """A folder prepared by scripts/prepare_data.py, or raw json/jsonl(.gz)/parquet/txt files (up to 256 MiB: prepared into cache_folder at start-up); unset: training.dataset_path or training.dataset, else the shipped corpus."""
    format: Literal["auto", "json", "parquet", "text", "hub"] = "auto"
    """How to read raw data.path; auto picks it from the file extensions. hub: a Hugging Face dataset name, prepared with scripts/prepare_data.py."""
    text_column: str = "text"
    """Column that holds the documents."""
    split: str = "train"
    """Dataset split (hub datasets)."""
    name: str | None = None
    """Dataset configuration of a hub dataset (e.g. sample-10BT of HuggingFaceFW/fineweb-edu)."""
    shuffle: bool = False
    """Read the windows of seq_len + 1 tokens in a pseudo-random order (debug.seed, new each epoch) instead of corpus order."""
    cache_folder: str = "~/.cache/llama3-recipe/tokens"
    """Where raw data.path is prepared at start-up, one folder per (files, tokenizer)."""
    mixture: list[str] = field(default_factory=list, metadata=INPUT_PATH)
    """Several corpora trained on together instead of data.path, each in the share of its weight: prepared folders, or raw data in any form data.path takes (prepared into cache_folder first): ["data/fineweb-edu", "data/code", "data/math"]. data/mixture.py."""
    mixture_weights: list[float] = field(default_factory=list)
    """One weight per data.mixture folder, any positive numbers: [7, 2, 1] trains on 70% / 20% / 10% of the sequences. Empty: equal shares."""
    ignore_resume_mismatch: bool = False
    """Resume a checkpoint trained on other data, tokenizer, seq_len, global batch or shuffle order anyway (from its sample count)."""
    chat: bool = False
    """Each row is a conversation (data.messages_column) rendered with the tokenizer folder's chat template; only the assistant's tokens count in the loss (data/chat.py)."""
    messages_column: str = "messages"
    """Chat data: the column of [{"role": ..., "content": ...}, ...] lists (OpenAI-style roles)."""
    pad_samples: bool = False
    """Chat data: one conversation per window, padded, instead of packing whole conversations into each window (which needs model.attn_mask_type = "block_causal")."""

    def problems(self, *, training_dataset: str | None, attn_mask_type: str) -> list[str]:
        """The mixture's weights fit its folders; training.dataset (resolved into data.path) is one this recipe
        knows; packed chat samples are kept apart."""
        if self.chat and not self.pad_samples and attn_mask_type != "block_causal":
            return [
                'data.chat: packed conversations would attend to each other under model.attn_mask_type = "causal"; '
                'set model.attn_mask_type = "block_causal", or data.pad_samples = true'
            ]
        if self.mixture:
            p = []
            if self.mixture_weights and len(self.mixture_weights) != len(self.mixture):
                p.append(
                    f"data.mixture_weights: {len(self.mixture_weights)} weights for {len(self.mixture)} data.mixture "
                    "folders; give one weight per folder (or none for equal shares)"
                )
            if any(w <= 0 for w in self.mixture_weights):
                p.append(
                    f"data.mixture_weights: every weight must be > 0, got {self.mixture_weights}; leave a folder out instead"
                )
            return p
        if self.mixture_weights:
            return [
                "data.mixture_weights: weighs the folders of data.mixture, which is empty; set data.mixture or remove the key"
            ]
        if self.path is None:  # training.dataset names no dataset this recipe knows
            known = ", ".join(name for name in DATASETS if "validation" not in name)
            return [
                f"training.dataset: unknown dataset {training_dataset!r} ({known}, or set training.dataset_path / data.path to your data)"
            ]
        return []


@dataclass
class Validation(TorchtitanValidation):
    """The loss on held-out data, every freq steps."""

    enable: bool = False
    """Compute the loss on held-out data every freq steps (no effect on training)."""
    dataset: str = "c4_validation"
    """torchtitan's name of the held-out data (c4_validation: the validation split of allenai/c4, prepared first)."""
    dataset_path: str | None = field(default=None, metadata=INPUT_PATH)
    """The held-out data: a prepared folder or raw files, like data.path."""
    split: str = "validation"
    """The split of a dataset_path that has several (a DatasetDict or hub-layout folder, a cached dataset name); a single file has none."""
    local_batch_size: int = 8
    """Sequences per rank per validation step."""
    seq_len: int = 2048
    """Tokens per validation sequence."""
    freq: int = 10
    """Validate after step 1, every this many training steps, and after the last one."""
    steps: int = -1
    """Validation steps per validation; -1 reads the held-out data once."""

    def problems(self, *, training: Training, pp: int) -> list[str]:
        if not self.enable:
            return []
        p = [
            f"validation.{key}: must be >= 1, got {getattr(self, key)}"
            for key in ("local_batch_size", "freq", "seq_len")
            if getattr(self, key) < 1
        ]
        if self.steps == 0 or self.steps < -1:
            p.append(f"validation.steps: must be -1 (the whole held-out data) or >= 1, got {self.steps}")
        for key in ("local_batch_size", "seq_len") if pp > 1 else ():
            if getattr(self, key) != getattr(training, key):
                p.append(
                    f"validation.{key}: {getattr(self, key)} differs from training.{key} = {getattr(training, key)}; "
                    "under pipeline parallel the stages' receive buffers hold one micro-batch shape, so validation "
                    "uses training's: set it to that"
                )
        return p


@dataclass
class Eval:
    """lm-evaluation-harness tasks scored on the live model during training (evaluation/downstream.py); torchtitan has no key."""

    enable: bool = optional_part("evaluation/downstream.py", False)
    """Score `tasks` every `interval` steps and after the last one, on the model as it trains, in its layout."""
    tasks: list[str] = field(default_factory=list)
    """lm-eval task names (the command line takes them separated by commas): log-likelihood tasks (multiple choice,
    perplexity); a generate_until task is scored by eval.py --tasks."""
    include_path: str | None = field(default=None, metadata=INPUT_PATH)
    """A folder of lm-eval task YAMLs of your own (assets/eval_tasks ships an offline one)."""
    interval: int = 500
    """Score after every this many steps, and after the last one."""
    limit: float | None = None
    """At most this many documents per task (or a fraction of them, below 1); unset: all of them."""
    batch_size: int = 8
    """Requests per data-parallel rank per forward."""
    log_samples: bool = False
    """Also write each request's log-likelihoods and each document's scores to <dump_folder>/eval/step-<N>.jsonl."""

    def problems(self, *, pp: int) -> list[str]:
        if not self.enable:
            return []
        p = [f"eval.{key}: must be >= 1, got {getattr(self, key)}" for key in ("interval", "batch_size")
             if getattr(self, key) < 1]  # fmt: skip
        if not self.tasks:
            p.append(
                'eval.tasks: name the lm-eval tasks to score (e.g. eval.tasks = ["stories_facts"]), or set eval.enable = false'
            )
        if self.limit is not None and self.limit <= 0:
            p.append(f"eval.limit: must be > 0 (documents per task, or a fraction below 1), got {self.limit}")
        if pp > 1:
            p.append(
                "eval.enable: lm-eval tasks are not scored inside a pipeline-parallel run (its schedule carries a loss, "
                "not per-request scores); set eval.enable = false and score its checkpoints beside it with eval.py "
                "--tasks ... --watch RUN_FOLDER"
            )
        if not _importable("lm_eval"):
            p.append('eval.enable: lm-evaluation-harness is not installed; pip install -e ".[eval]"')
        return p


@dataclass
class Parallelism(TorchtitanParallelism):
    """How the ranks split the work: data parallel (FSDP, HSDP), tensor, pipeline and context parallel. The rules
    that need the world size or the model are parallelisms/'s (parallel_dims.layout_problems)."""

    data_parallel_replicate_degree: int = 1
    """Replicas of the model (HSDP outer dimension, usually the number of nodes)."""
    data_parallel_shard_degree: int = -1
    """Ranks a replica is sharded over with FSDP; -1 = whatever the other degrees leave."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: always (least memory), never (no re-gather in backward, ZeRO-2-like), default (always, except the last unit)."""
    fsdp_defer_reduce_scatter: bool = False
    """With gradient accumulation, keep each micro-batch's gradients unsharded in float32 and reduce-scatter (and all-reduce across replicas) once per step: 1 / micro-batches the reduce-scatter bytes, for the memory of the unsharded gradients (planning/estimate_memory.py and planning/doctor.py print it). Off: reduce-scatter per micro-batch, all-reduce once per step."""
    tensor_parallel_degree: int = 1
    """Ranks each layer's matrices are split over (tensor + sequence parallel)."""
    disable_loss_parallel: bool = False
    """Under TP, gather the full logits for the loss instead of computing cross-entropy on vocabulary shards."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with matmuls (inductor micro-pipeline TP); needs compile, CUDA and NCCL."""
    pipeline_parallel_degree: int = 1
    """Ranks the model's layers are split over (pipeline parallel, parallelisms/pp.py; the outermost dimension)."""
    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule: 1F1B, GPipe (one stage per rank), Interleaved1F1B, InterleavedZeroBubble (2+ stages per rank)."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch (with pipeline_parallel_degree > 1)."""
    pipeline_parallel_layers_per_stage: int | None = None
    """Transformer blocks per pipeline stage (embedding and output count as first/last_stage_less_layers blocks); unset: 1 stage per rank (2 for interleaved schedules)."""
    pipeline_parallel_first_stage_less_layers: int = 1
    """Blocks fewer in the first stage, which also holds the embedding (with pipeline_parallel_degree > 1)."""
    pipeline_parallel_last_stage_less_layers: int = 1
    """Blocks fewer in the last stage, which also holds the output and loss (with pipeline_parallel_degree > 1)."""
    expert_parallel_degree: int = optional_part("parallelisms/ep.py", 1)
    """Ranks a mixture of experts' routed experts are split over (expert parallel, parallelisms/ep.py): each holds experts / ep of every MoE block's and receives their tokens by all-to-all. The ranks are data-parallel, context-parallel and tensor-parallel ranks (each holds its own tokens at the experts); FSDP shards the experts over the ranks the other degrees leave."""
    context_parallel_degree: int = optional_part("parallelisms/cp.py", 1)
    """Ranks each sequence is split over (context parallel, parallelisms/cp.py): each holds 1/cp of every window's tokens and all-gathers the keys and values."""
    context_parallel_load_balancer: str | None = optional_part("parallelisms/cp.py", "headtail")
    """How a window is cut over the CP ranks: "headtail" (rank i holds chunks i and 2cp-1-i of 2cp, so causal work is even) or "none" (one contiguous chunk each)."""
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = optional_part("parallelisms/cp.py", "allgather")
    """How the CP ranks exchange keys and values: "allgather" (the one method here, as the Llama 3 paper does)."""

    def problems(self) -> list[str]:
        p = []
        for key in (
            "data_parallel_replicate_degree",
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "context_parallel_degree",
            "expert_parallel_degree",
        ):
            if (degree := getattr(self, key)) < 1:
                p.append(f"parallelism.{key}: must be >= 1, got {degree}")
        if self.data_parallel_shard_degree == 0 or self.data_parallel_shard_degree < -1:
            p.append(
                f"parallelism.data_parallel_shard_degree: must be -1 or >= 1, got {self.data_parallel_shard_degree}"
            )
        if self.context_parallel_load_balancer == "ptrr":
            p.append(
                "parallelism.context_parallel_load_balancer: ptrr balances torchtitan's FlexAttention ring; this "
                'recipe\'s all-gather context parallel balances causal work with "headtail" for SDPA and FlexAttention '
                "alike: use it"
            )
        elif self.context_parallel_load_balancer not in ("headtail", "none", None):
            p.append(
                f'parallelism.context_parallel_load_balancer: expected "headtail" or "none", got '
                f"{self.context_parallel_load_balancer!r}"
            )
        if self.context_parallel_rotate_method == "alltoall":
            p.append(
                'parallelism.context_parallel_rotate_method: "alltoall" rotates ring-attention shards; context parallel '
                'here all-gathers the keys and values once per layer (the Llama 3 paper\'s design): use "allgather"'
            )
        return p


@dataclass
class ActivationCheckpoint(TorchtitanActivationCheckpoint):
    """Activation checkpointing: which blocks' activations backward recomputes, and torch.utils.checkpoint's switches."""

    mode: Literal["none", "full", "selective", "auto", "per_block", "memory_budget"] = "none"
    """Recompute activations in backward: none, full (every block), selective, auto (the least that fits memory_budget_gib) or per_block."""
    selective_ac_option: str = "op"
    """For mode = selective: "op" (save chosen ops' outputs) or an integer k (checkpoint every k-th block)."""
    memory_budget_gib: float = 0.0
    """For mode = auto: GiB one GPU may hold; 0: 90% of the CUDA device's memory (required without a CUDA device)."""
    per_block: list[str] = field(default_factory=list)
    """For mode = per_block: "none", "op" or "full" for each block of the model, in order (what auto prints)."""
    use_reentrant: bool = False
    """Use the legacy reentrant checkpoint. It skips the recomputed-metadata checks (docs/failures.md #2); only for reproducing old setups."""
    early_stop: bool = True
    """Stop each recomputation as soon as backward has what it needs (torch.utils.checkpoint's early stop)."""
    preserve_rng_state: bool = True
    """Replay the forward's RNG state in the recomputation (what dropout would need; none here)."""
    determinism_check: str = "default"
    """torch.utils.checkpoint's check of recomputed tensors: "default" (shapes, dtypes, devices) or "none"."""
    debug: bool = False
    """torch.utils.checkpoint's debug mode: a trace of the forward and recomputation on a mismatch."""

    @property
    def selective_every(self) -> int | None:
        """k of selective_ac_option = "k" (checkpoint every k-th block); None for "op" or a value that is no k."""
        return selective_ac_every(self.selective_ac_option)

    def problems(self, *, n_layers: int | None = None) -> list[str]:
        """n_layers: the model's blocks, where the config names a flavor (a Hugging Face shape is checked by apply_ac)."""
        p = []
        if self.mode == "per_block" and self.per_block and n_layers is not None and len(self.per_block) != n_layers:
            p.append(
                f"activation_checkpoint.per_block: {len(self.per_block)} entries for a model of {n_layers} blocks; "
                "give one per block"
            )
        if self.mode == "memory_budget":
            p.append(
                "activation_checkpoint.mode: memory_budget asks for torchtitan's memory-budget AC, which this recipe does not do; use selective or full"
            )
        if self.mode == "selective" and self.selective_ac_option != "op" and self.selective_every is None:
            p.append(
                f"activation_checkpoint.selective_ac_option: expected 'op' or a positive integer k, got {self.selective_ac_option!r}"
            )
        if bad := sorted(set(self.per_block) - set(BLOCK_AC_MODES)):
            p.append(
                f"activation_checkpoint.per_block: unknown {', '.join(map(repr, bad))}; each block is one of {', '.join(BLOCK_AC_MODES)}"
            )
        if self.mode == "per_block" and not self.per_block:
            p.append(
                'activation_checkpoint.per_block: mode = "per_block" needs one entry per block ("none", "op" or "full")'
            )
        if self.per_block and self.mode != "per_block":
            p.append(
                f'activation_checkpoint.per_block: ignored by mode = "{self.mode}"; set mode = "per_block" or remove it'
            )
        if self.memory_budget_gib < 0 or (self.memory_budget_gib and self.mode != "auto"):
            p.append(
                f"activation_checkpoint.memory_budget_gib: {self.memory_budget_gib:g} "
                + (
                    "is negative; give GiB per GPU, or 0 for 90% of the device's"
                    if self.memory_budget_gib < 0
                    else f'is read by mode = "auto" only (mode is "{self.mode}"); set mode = "auto" or remove it'
                )
            )
        if self.determinism_check not in ("default", "none"):
            p.append(
                f"activation_checkpoint.determinism_check: expected 'default' or 'none', got {self.determinism_check!r}"
            )
        return p


# What activation checkpointing does to one block (parallelisms/ac.py `block_modes`): keep everything, op SAC, or
# full recompute; in that order of recompute. Every spelling of [activation_checkpoint] comes down to one per block.
BlockMode = Literal["none", "op", "full"]
BLOCK_AC_MODES: tuple[BlockMode, ...] = typing.get_args(BlockMode)


@dataclass
class Compile:
    """torch.compile: what is compiled, with which backend."""

    enable: bool = False
    """torch.compile the components below."""
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: "model" (each transformer block) and/or "loss" (cross-entropy)."""
    backend: str = "inductor"
    """torch.compile backend (inductor; aot_eager or eager to debug a compile problem)."""

    def problems(self) -> list[str]:
        p = []
        if unknown := sorted(set(self.components) - {"model", "loss"}):
            p.append(f'compile.components: unknown {", ".join(unknown)}; use "model" and/or "loss"')
        if self.backend != "inductor" and self.backend not in (known := compile_backends()):
            p.append(f"compile.backend: unknown backend {self.backend!r}; use one of {', '.join(known)}")
        return p


@functools.cache
def compile_backends() -> tuple[str, ...]:
    """The backends torch.compile takes (torch._dynamo's list, imported only for a backend other than inductor)."""
    import torch._dynamo

    return tuple(sorted({*torch._dynamo.list_backends(exclude_tags=()), "inductor"}))


# Named for its section, [quantize.linear.float8], as QuantizeLinear is for [quantize.linear]: torchao's module class is
# Float8Linear and its config Float8LinearConfig (parallelisms/float8.py uses both).
@dataclass
class QuantizeLinearFloat8:
    """Float8 linear layers (torchao), with the quantize.linear.float8 converter."""

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None
    """torchao float8 recipe; unset: tensorwise."""
    enable_fsdp_float8_all_gather: bool = False
    """All-gather FSDP parameters in float8 (tensorwise only): half the bf16 all-gather bytes."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """Compute every float8 weight scale in one fused step after the optimizer (with the float8 all-gather)."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers left in high precision: those whose name contains one of these."""
    emulate: bool = False
    """Emulate float8 matmuls in high precision (any device; for tests)."""


@dataclass
class QuantizeLinear:
    """The linear layers' quantization: float8 here (MX is torchtitan's, refused)."""

    float8: QuantizeLinearFloat8 = field(default_factory=QuantizeLinearFloat8)
    mx: MXLinear = field(default_factory=MXLinear)


@dataclass
class Quantize:
    """Low-precision layers, applied by model.converters."""

    linear: QuantizeLinear = field(default_factory=QuantizeLinear)
    grouped_mm: QuantizeGroupedMM = field(default_factory=QuantizeGroupedMM)

    def problems(self, *, converters: list[str], compiled_model: bool) -> list[str]:
        """The float8 settings fit together (with the converter on; without it they are not read)."""
        f8, p = self.linear.float8, []
        if "quantize.linear.float8" not in converters:
            return p
        if f8.recipe_name not in (None, "tensorwise") and f8.enable_fsdp_float8_all_gather:
            p.append(
                f"quantize.linear.float8.enable_fsdp_float8_all_gather: the float8 all-gather needs tensorwise "
                f"scales, and recipe_name is {f8.recipe_name!r}; set it to false or use recipe_name = 'tensorwise'"
            )
        if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
            p.append(
                "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp: precomputes the scales of the "
                "float8 all-gather, which is off; set enable_fsdp_float8_all_gather = true or this to false"
            )
        if f8.emulate and compiled_model:
            p.append(
                "quantize.linear.float8.emulate: emulated float8 is for eager tests (torchao does not support it "
                "under torch.compile); set compile.enable = false or emulate = false"
            )
        return p


@dataclass
class Checkpoint(TorchtitanCheckpoint):
    """Distributed checkpoints: when to save, what to keep, what to load at the start, and Hugging Face export."""

    enable: bool = False
    """Save distributed checkpoints (torch.distributed.checkpoint) and resume from the latest one."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 10
    """Keep only the newest k checkpoints; 0 keeps all. Seed checkpoints (step 0) are never pruned."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """async: write checkpoints in a background thread while training goes on; async_with_pinned_mem (CUDA): also stage them through pinned host memory in a background process."""
    load_step: int = -1
    """Resume from this step's checkpoint; -1: the newest."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of a checkpoint not restored on resume: model, optimizer, dataloader, train_state (lr_scheduler: nothing to restore)."""
    initial_load_path: str | None = field(default=None, metadata=INPUT_PATH)
    """Checkpoint to initialize the model weights from when the run has no checkpoint of its own yet (e.g. a seed checkpoint)."""
    initial_load_in_hf: bool = False
    """initial_load_path (else model.hf_assets_path) is a Hugging Face folder of safetensors weights."""
    last_save_model_only: bool = False
    """The checkpoint of the last step holds the model weights only (in export_dtype): smaller, not resumable."""
    last_save_in_hf: bool = False
    """Also write the last step's weights as a Hugging Face folder to <folder>/step-N-hf (safetensors, config.json)."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights of a model-only last save and of last_save_in_hf."""
    create_seed_checkpoint: bool = False
    """Initialize the model, save it as step 0 and exit. Run on one process; load it in parallel runs with initial_load_path so every layout starts from the same weights."""
    enable_first_step_checkpoint: bool = False
    """Also save after step 1 (to find out early that saving works)."""

    def problems(self, *, hf_assets_path: str | None) -> list[str]:
        p = []
        if self.interval < 1:
            p.append(f"checkpoint.interval: must be >= 1, got {self.interval}")
        if self.keep_latest_k < 0:
            p.append(f"checkpoint.keep_latest_k: must be >= 0 (0 keeps all), got {self.keep_latest_k}")
        parts = {"model", "optimizer", "dataloader", "train_state", "lr_scheduler"}
        if unknown := sorted(set(self.exclude_from_loading) - parts):
            p.append(
                f"checkpoint.exclude_from_loading: unknown {', '.join(unknown)}; use model, optimizer, dataloader or train_state"
            )
        if self.initial_load_in_hf and (self.initial_load_path or hf_assets_path) is None:
            p.append(
                "checkpoint.initial_load_in_hf: set checkpoint.initial_load_path or model.hf_assets_path to the Hugging Face folder"
            )
        return p


@dataclass
class Comm:
    """The process group's timeouts and flight recorder, and the dry run (fake_backend)."""

    init_timeout_seconds: int = 300
    """Timeout of collectives until the first step is done (process-group set-up, tokenization, loading a checkpoint)."""
    train_timeout_seconds: int = 100
    """Timeout of collectives from the second step on: a rank that stops answering fails the job after this long instead of hanging it."""
    hang_timeout_seconds: float | Literal["auto"] = optional_part("fleet/monitor.py", "auto")
    """A step that takes longer ends the job: every rank that can writes its stacks to <dump_folder>/hang/ and one line names the ranks that did not arrive (fleet/monitor.py); "auto": 5 x the median step, at least 60 s, from the fifth step on; 0 turns it off."""
    trace_buf_size: int = 20000
    """NCCL flight recorder: collectives kept per rank to dump when one hangs (CUDA; 0 turns it off)."""
    save_traces_folder: str = "comm_traces"
    """Where the flight recorder dumps, relative to job.dump_folder."""
    save_traces_file_prefix: str = "rank_"
    """File name prefix of the flight recorder dumps."""
    mode: Literal["default", "fake_backend", "local_tensor"] = "default"
    """fake_backend: a dry run of rank 0 of a WORLD_SIZE-rank job on this machine, on a fake process group and no real tensors (planning/dry_run.py); local_tensor is refused."""

    def problems(self) -> list[str]:
        p = [
            f"comm.{key}: must be >= 1, got {getattr(self, key)}"
            for key in ("init_timeout_seconds", "train_timeout_seconds")
            if getattr(self, key) < 1
        ]
        hang = self.hang_timeout_seconds
        if hang != "auto" and hang < 0:
            p.append(f'comm.hang_timeout_seconds: must be "auto", 0 (off) or a number of seconds > 0, got {hang}')
        elif hang != "auto" and hang >= self.train_timeout_seconds:
            warn(
                f"comm.hang_timeout_seconds = {hang:g} is not below comm.train_timeout_seconds = "
                f"{self.train_timeout_seconds}: a rank that stops answering fails the job at the collectives' time-out "
                "first, with no stacks written; set it lower"
            )
        if self.mode == "local_tensor":
            p.append(
                'comm.mode: "local_tensor" is torchtitan\'s single-process simulation, not done here; use "fake_backend"'
            )
        return p


@dataclass
class Metrics(TorchtitanMetrics):
    """What is logged, how often, and where: metrics.jsonl, TensorBoard, Weights & Biases."""

    log_freq: int = 10
    """Log loss, grad norm, lr, tokens/s, MFU and memory every this many steps."""
    straggler_threshold: float = optional_part("fleet/monitor.py", 0.2)
    """At each logged step, name the slowest rank when its time working and reading data per step exceeds the other ranks' median by more than this fraction (fleet/monitor.py); metrics.jsonl keeps every rank's."""
    enable_tensorboard: bool = False
    """Also write TensorBoard events to <dump_folder>/<save_tb_folder>."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (the wandb package; WANDB_PROJECT, WANDB_MODE=offline, ... as usual)."""

    def problems(self) -> list[str]:
        p = []
        if self.log_freq < 1:
            p.append(f"metrics.log_freq: must be >= 1, got {self.log_freq}")
        if self.straggler_threshold <= 0:
            p.append(
                f"metrics.straggler_threshold: must be > 0 (a fraction of the median, e.g. 0.2), got {self.straggler_threshold}"
            )
        if self.enable_wandb and not _importable("wandb"):
            p.append("metrics.enable_wandb: the wandb package is not installed; pip install wandb, or set it to false")
        return p


@dataclass
class Profiling:
    """torch.profiler traces and CUDA memory snapshots of chosen steps."""

    enable_profiling: bool = False
    """Write a torch.profiler trace per rank of every profile_freq-th step to <dump_folder>/<save_traces_folder>/iteration_N/."""
    save_traces_folder: str = "profile_traces"
    """Profiler trace folder, relative to job.dump_folder (open the JSON files in Perfetto or chrome://tracing)."""
    profile_freq: int = 10
    """Profile (and snapshot memory) every this many steps."""
    profiler_active: int = 1
    """Steps recorded per profile."""
    profiler_warmup: int = 3
    """Steps the profiler runs unrecorded before them (its own start-up costs); at most profile_freq - profiler_active."""
    enable_memory_snapshot: bool = False
    """CUDA only: record allocator history and dump a snapshot per rank every profile_freq steps and on OOM."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to job.dump_folder (open the pickles at pytorch.org/memory_viz)."""

    def problems(self) -> list[str]:
        p = [
            f"profiling.{key}: must be >= 1, got {getattr(self, key)}"
            for key in ("profile_freq", "profiler_active")
            if getattr(self, key) < 1
        ]
        if self.profiler_warmup < 0:
            p.append(f"profiling.profiler_warmup: must be >= 0, got {self.profiler_warmup}")
        if self.profiler_active > self.profile_freq:
            p.append(
                f"profiling.profiler_active: {self.profiler_active} steps recorded per profile do not fit in profile_freq = {self.profile_freq}"
            )
        return p


@dataclass
class Debug(TorchtitanDebug):
    """Seeds and determinism."""

    seed: int | None = 42
    """Seed of every random number generator, identical on all ranks; unset: 42."""
    deterministic: bool = False
    """Use deterministic algorithms only (slower), so that reruns give bit-identical losses."""
    deterministic_warn_only: bool = False
    """With deterministic: warn about an operation with no deterministic implementation instead of failing."""


@dataclass
class JobConfig:
    """The whole config: one field per TOML section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    dpo: Dpo = field(default_factory=Dpo)
    distill: Distill = field(default_factory=Distill)
    lora: Lora = field(default_factory=Lora)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    debug: Debug = field(default_factory=Debug)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    experimental: Experimental = field(default_factory=Experimental)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------ what the sections' checks use


# torchtitan's dataset names -> where they are here: (path, hub dataset name, split).
DATASETS = {
    "c4": ("allenai/c4", "en", "train"),
    "c4_validation": ("allenai/c4", "en", "validation"),
    "c4_test": ("tests/assets/c4_test", None, "train"),  # torchtitan's repo layout, in the user's folder
}


def model_args(cfg: Model) -> Any:
    """The model shape this config names: the flavor, or hf_assets_path's config.json with shape_from_hf_config; a
    mixture of experts' with [model.moe]'s balancing."""
    fam = family(cfg.name)
    if cfg.shape_from_hf_config:
        # Imported here: reading HF configs is interop, which a flavor-only run never needs.
        from models.hf import model_args_from_hf

        args = model_args_from_hf(fam, cfg.hf_assets_path or "")
    else:
        args = fam.flavors[cfg.flavor]
    if fam.experts_module:  # a mixture of experts
        args = cfg.moe.applied_to(args)
    return args


def selective_ac_every(option: str) -> int | None:
    """k of `selective_ac_option = "k"` (checkpoint every k-th block), None when it is not a positive integer."""
    return int(option) if option.isdigit() and int(option) >= 1 else None


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _check_model(m: Model, *, seq_len: int) -> list[str]:
    """The family and flavor exist, hf_assets_path agrees with the flavor, and the model supports seq_len."""
    if m.name not in NAMES:
        return [
            f"model.name: unknown model family {m.name!r}{_did_you_mean(m.name, NAMES)} (choose from {', '.join(NAMES)})"
        ]
    fam = family(m.name)
    if m.flavor not in fam.flavors and not m.shape_from_hf_config:
        hint = _did_you_mean(m.flavor, fam.flavors) or _did_you_mean(m.flavor.upper(), fam.flavor_aliases)
        names = ", ".join([*fam.flavors, *fam.flavor_aliases])
        other = [n for n in NAMES if n != m.name and m.flavor in family(n).flavors]
        switch = f"; or set model.name = {other[0]!r}" if other and not hint else ""
        return [f"model.flavor: unknown {m.name} flavor '{m.flavor}'{hint} (choose from {names}){switch}"]
    config_json = Path(m.hf_assets_path or "") / "config.json"
    if m.shape_from_hf_config and m.hf_assets_path is None:
        return [
            "model.shape_from_hf_config: takes the shape from model.hf_assets_path's config.json, and "
            "model.hf_assets_path is unset; set it to a Hugging Face folder"
        ]
    if m.shape_from_hf_config and not config_json.is_file():
        return [
            f"model.shape_from_hf_config: {m.hf_assets_path} has no config.json; point model.hf_assets_path at a "
            "Hugging Face folder"
        ]
    if m.hf_assets_path is not None and config_json.is_file():
        # Imported here: reading HF configs is interop, which a flavor-only run never needs.
        from models.hf import model_args_from_hf

        try:
            hf = model_args_from_hf(fam, m.hf_assets_path)
        except ConfigError as e:
            return [f"model.hf_assets_path: {problem}" for problem in e.problems]
        if not m.shape_from_hf_config and (different := _differing_parameter(fam, hf, fam.flavors[m.flavor])):
            return [
                f"model.flavor: {m.flavor} is not the model of {config_json} ({different}); fix the flavor, or set "
                "model.shape_from_hf_config = true"
            ]
    args = model_args(m)
    if seq_len > args.max_seq_len:
        source = f"{m.hf_assets_path} (max_position_embeddings)" if m.shape_from_hf_config else m.flavor
        return [f"training.seq_len: {seq_len} exceeds the {args.max_seq_len} tokens {source} supports; lower it"]
    return []


def _differing_parameter(fam: ModelFamily, theirs: Any, ours: Any) -> str:
    """How two shapes differ in their weights ('' when every parameter has the same name and shape)."""
    a, b = parameter_shapes(fam, theirs), parameter_shapes(fam, ours)
    if a.keys() != b.keys():
        name = sorted(a.keys() ^ b.keys())[0]
        return f"{name} is {'only there' if name in a else 'only in the flavor'}"
    name = next((n for n in a if a[n] != b[n]), None)
    return f"{name} is {tuple(a[name])} there, {tuple(b[name])} in the flavor" if name else ""


def _did_you_mean(name: str, choices: typing.Iterable[str]) -> str:
    # A high cutoff: a wrong suggestion (pipeline_parallel_degree -> tensor_parallel_degree) misleads
    # more than none; typos of one or two letters still get theirs.
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.8)
    return f"; did you mean '{close[0]}'?" if close else ""
