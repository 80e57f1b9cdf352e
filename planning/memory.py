"""The memory of one GPU of a training setup, per pipeline rank, allocated and reserved, term by term: `estimate` (the
worst rank) and `estimate_rank` of a Job (planning/job.py: the run's config, its ranks, its machine), from the job's
shapes and a trace of one block of its model (planning/trace.py; what context and expert parallel exchange:
planning/exchanges.py). How each term is modelled: docs/planning.md, "How the estimator counts"."""

from __future__ import annotations

import dataclasses
import functools
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from config import BLOCK_AC_MODES, ActivationCheckpoint, BlockMode, JobConfig
from errors import ConfigError
from models import family
from parallelisms.ac import block_modes
from parallelisms.pp import SCHEDULES, rank_stages
from planning.exchanges import cp_kv_bytes, ep_bytes
from planning.job import GiB, Job, Machine
from planning.trace import BlockCosts, block_costs

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Compute-stream bytes the caching allocator reserves beyond the allocated peak, as a share of it:
# calibrated on torchtitan's 8B peaks (docs/planning.md, "How the estimator counts": "Reserved").
FRAGMENTATION = 0.17


@functools.cache
def one_block_model(name: str, args: Any) -> torch.nn.Module:
    """The family's model of `args` with one block, on the meta device: what a block, the embedding and the root unit
    hold."""
    with torch.device("meta"):
        return family(name).model_cls(dataclasses.replace(args, n_layers=1))


def tp_rank_elements(name: str, args: Any, linears: list[str], *, tp: int) -> float:
    """Elements of these linears' weights (names inside a block) on one TP rank: split tp ways where the family's TP
    plan makes the linear Colwise or Rowwise, whole where it leaves it."""
    block, plan = one_block_model(name, args).layers["0"], family(name).tp_plan()
    split = lambda linear: isinstance(plan.get(linear), ColwiseParallel | RowwiseParallel)  # noqa: E731
    return sum(block.get_submodule(linear).weight.numel() / (tp if split(linear) else 1) for linear in linears)


def adapter_elements(job: Job) -> float:
    """Elements of one block's LoRA adapters on one TP rank ([lora]; 0 without it): for each target linear (lora.py
    `targets`) A (r x in) and B (out x r), split by PEFT's rule for parallel layers as lora.py places them: a
    column-parallel linear's A whole and B split tp ways, a row-parallel one's A split and B whole."""
    cfg = job.lora
    if cfg is None:
        return 0.0
    from lora import targets  # a leaf of the recipe: loaded only for a job with adapters

    name, tp = job.cfg.model.name, job.dims.tp
    block, plan = one_block_model(name, job.args).layers["0"], family(name).tp_plan()
    total = 0.0
    for linear in targets(block, job.fam, cfg):
        m, style = block.get_submodule(linear), plan.get(linear) if tp > 1 else None
        a, b = cfg.r * m.in_features, m.out_features * cfg.r
        if isinstance(style, ColwiseParallel):  # W split by its output rows: B split like it, A whole
            b /= tp
        elif isinstance(style, RowwiseParallel):  # by its input columns: A split like it, B whole
            a /= tp
        total += a + b
    return total


def hidden_matrices(name: str, args: Any) -> tuple[int, ...]:
    """The elements of one block's hidden matrices (ModelFamily.hidden_matrices), in the order of its parameters."""
    hidden = {f"{linear}.weight" for linear in family(name).hidden_matrices}
    block = one_block_model(name, args).layers["0"]
    return tuple(p.numel() for param_name, p in block.named_parameters() if param_name in hidden)


_ACTIONS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def rank_ops(schedule: str, *, pp_rank: int, pp: int, n_local: int, n_mb: int) -> list[tuple[str, int, int]]:
    """The forwards (F) and backwards (B; zero bubble: input I, weight W) pp rank `pp_rank` runs, in
    order, as (kind, local stage, micro-batch)."""
    match schedule:
        case "GPipe":
            return [("F", 0, m) for m in range(n_mb)] + [("B", 0, m) for m in range(n_mb)]
        case "1F1B":
            # torch's Schedule1F1B: stage s runs min(n_mb, S - s) forwards, then backward/forward pairs.
            warmup = min(n_mb, pp - pp_rank)
            ops = [("F", 0, m) for m in range(warmup)]
            for m in range(n_mb):
                ops += [("B", 0, m)] + ([("F", 0, warmup + m)] if warmup + m < n_mb else [])
            return ops
    # The interleaved schedules plan every rank's actions in __init__, which needs real PipelineStages
    # (a process group, a device). Their planner (private, torch 2.13) reads only these attributes;
    # the rounds are as in ScheduleInterleaved1F1B.__init__.
    rounds = max(1, n_mb // pp)
    plan = types.SimpleNamespace(
        n_local_stages=n_local, pp_group_size=pp, microbatches_per_round=n_mb // rounds, _n_microbatches=n_mb
    )
    actions = SCHEDULES[schedule].torch_class()._calculate_single_rank_operations(plan, pp_rank)
    return [
        (_ACTIONS[a.computation_type.name], a.stage_index // pp, a.microbatch_index) for a in actions if a is not None
    ]


def layer_modes(job: Job, layers: list[int]) -> list[BlockMode]:
    """What activation checkpointing does to each of `layers` (blocks of a model or stage, by index in the model):
    apply_ac's own rule (parallelisms/ac.py block_modes) on the job's [activation_checkpoint]. Mode "auto" is refused:
    it is chosen where the job starts."""
    if job.cfg.activation_checkpoint.mode == "auto":
        raise ConfigError(
            'activation_checkpoint.mode: "auto" is chosen block by block where the job starts (train.py, --print-config, '
            "the doctor, the dry run: each prints its choice); to estimate it here, pass the per_block it printed"
        )
    return block_modes(job.cfg.activation_checkpoint, layers)


def _main_mode(job: Job) -> BlockMode:
    """The block AC mode that recomputes most among the job's blocks: its trace gives the costs that are one number
    for every block (job_costs)."""
    used = set(layer_modes(job, list(range(job.args.n_layers))))
    return max(used, key=BLOCK_AC_MODES.index)


def mode_costs(
    job: Job, modes: tuple[BlockMode, ...] = BLOCK_AC_MODES, *, tp_mesh: DeviceMesh | None = None
) -> dict[BlockMode, BlockCosts]:
    """block_costs of one micro-batch of `job` through one block, in its param_dtype, for each block AC mode in
    `modes` ("none", "op", "full"). Under context parallel the block is traced on this rank's tokens, and attention's
    keys and values span the whole window (`cp_kv_bytes`); under expert parallel a block keeps what `ep_bytes` says."""
    extra, costs = cp_kv_bytes(job), {}
    for mode in modes:
        traced = block_costs(job, mode, tp_mesh=tp_mesh)
        ep = ep_bytes(job, traced)
        kept = traced.kept + (extra["kept"] + ep["kept"] if mode == "op" else 0)
        costs[mode] = dataclasses.replace(traced, saved=traced.saved + extra["saved"] + ep["saved"], kept=kept)
    return costs


def job_costs(job: Job, *, tp_mesh: DeviceMesh | None = None) -> BlockCosts:
    """mode_costs of the job's blocks: those of the mode that recomputes most among them (`_main_mode`), which differ
    from the others' in what a block keeps (`kept`) and in the recomputation's collectives and FLOPs."""
    mode = _main_mode(job)
    return mode_costs(job, (mode,), tp_mesh=tp_mesh)[mode]


def activation_bytes(job: Job, *, tp_mesh: DeviceMesh | None = None) -> dict[str, int]:
    """Bytes saved for backward at the end of one micro-batch's forward through the whole model (what
    benchmarks/memory.py measures), by part: the blocks, what lies outside them (token ids, the final
    norm and its gathered output), the loss's fp32 log-softmax."""
    args, param_bytes, tokens = job.args, DTYPE_BYTES[job.cfg.training.mixed_precision_param], job.microbatch_tokens
    modes = layer_modes(job, list(range(args.n_layers)))
    by_mode = mode_costs(job, tuple(dict.fromkeys(["none", *modes])), tp_mesh=tp_mesh)
    costs = by_mode[_main_mode(job)]
    kept = {mode: c.kept if mode != "none" else c.saved for mode, c in by_mode.items()}
    checkpointed = any(mode != "none" for mode in modes)
    blocks = sum(kept[mode] for mode in modes)
    outside = 16 * tokens + costs.final_norm + param_bytes * tokens * args.dim + cp_kv_bytes(job)["mask"]
    log_softmax = 4 * tokens * args.vocab_size // job.dims.tp
    return {
        "per_block_no_ac": costs.saved,
        "per_block_checkpointed": costs.kept if checkpointed else 0,
        "blocks": blocks,
        "outside_blocks": outside,
        "log_softmax": log_softmax,
        "total": blocks + outside + log_softmax,
    }


# estimate_rank's terms, phase by phase: the parameters a rank holds and their sharded state (the whole step),
# the parameters gathered during backward, the activations a micro-batch leaves for backward, the transients of a
# backward; then a replay of the rank's schedule finds the worst moment, and the reserved bytes follow from it.


@dataclass(frozen=True)
class _RankParams:
    """The parameters of one pp rank as TP and expert parallel left them, before FSDP shards them (the family's plan
    splits a block's matmul weights, the skeleton's the vocabulary, expert parallel a block's routed experts). A tied
    model's one matrix lives in the root unit (parallelisms/fsdp.py)."""

    stages: list[list[int]]
    """The blocks of every (virtual) pipeline stage of the job; one stage of all blocks without PP."""
    local: list[int]
    """The stages this rank runs."""
    block: float
    """One block as FSDP gathers it on this rank: TP's shards of its dense part and this rank's experts (experts / ep;
    TP does not split them)."""
    experts: float
    """Of `block`, this rank's routed experts; 0 for a dense family."""
    embedding: int
    root: int
    """The root unit: final norm + output projection (or the tied matrix)."""
    shard: int
    """The ranks FSDP shards the dense parameters over (Job.shard)."""
    experts_shard: int
    """The ranks FSDP shards this rank's experts over (Job.efsdp)."""
    adapters: float = 0.0
    """Of `block`, its LoRA adapters on this rank (`adapter_elements`); 0 without [lora]."""
    lora: bool = False
    """[lora] enable: the adapters alone train (they have gradients and optimizer state), the rest is frozen."""

    @property
    def last_stage(self) -> int:
        return len(self.stages) - 1

    def of_stage(self, stage: int) -> int:
        embedding = self.embedding if stage == 0 else 0
        root = self.root if stage == self.last_stage else 0
        return len(self.stages[stage]) * self.block + embedding + root

    @property
    def total(self) -> int:
        """Of all the rank's stages."""
        return sum(self.of_stage(stage) for stage in self.local)

    @property
    def sharded(self) -> float:
        """Of all the rank's stages, the parameters its FSDP shards hold: the dense ones / shard, the experts / the
        ranks that shard them (under expert parallel each rank's own experts / efsdp: the block's / (dp_shard x cp x
        tp), where TP splits the dense part only)."""
        blocks = sum(len(self.stages[stage]) for stage in self.local)
        experts = blocks * self.experts
        return (self.total - experts) / self.shard + experts / self.experts_shard

    @property
    def sharded_block(self) -> float:
        """One block's parameters in this rank's FSDP shards."""
        return (self.block - self.experts) / self.shard + self.experts / self.experts_shard

    # What trains: every parameter, or under LoRA the blocks' adapters alone (the embedding and the root unit are
    # frozen: PEFT's all-linear leaves the output head out). Gradients, their shards and optimizer state are of these.

    @property
    def trainable_block(self) -> float:
        return self.adapters if self.lora else self.block

    def trainable_of_stage(self, stage: int) -> float:
        return len(self.stages[stage]) * self.adapters if self.lora else self.of_stage(stage)

    @property
    def trainable_total(self) -> float:
        return sum(self.trainable_of_stage(stage) for stage in self.local)

    @property
    def trainable_sharded(self) -> float:
        """Of `sharded`, what trains (the adapters shard with their block over the dense part's ranks)."""
        return self.trainable_total / self.shard if self.lora else self.sharded

    @property
    def trainable_sharded_block(self) -> float:
        return self.adapters / self.shard if self.lora else self.sharded_block

    @property
    def trainable_embedding(self) -> int:
        return 0 if self.lora else self.embedding

    @property
    def largest_unit(self) -> float:
        """The largest FSDP unit of the rank: a block, or the embedding or root unit where the rank has them."""
        return max([self.block] + [self.embedding] * (0 in self.local) + [self.root] * (self.last_stage in self.local))

    @property
    def largest_shard(self) -> float:
        """The shards of the rank's largest FSDP unit (a block's: its dense part's and its experts' together)."""
        ends = [self.embedding] * (0 in self.local) + [self.root] * (self.last_stage in self.local)
        return max([self.sharded_block] + [n / self.shard for n in ends])


def _rank_params(job: Job, costs: BlockCosts, pp_rank: int) -> _RankParams:
    stages = job.stages
    local = rank_stages(pp_rank, pp=job.dims.pp, stages=len(stages)) if job.dims.pp > 1 else [0]
    experts = costs.experts_params / job.dims.ep  # the trace's block holds every expert: TP leaves them whole
    return _RankParams(
        stages,
        local,
        block=costs.block_params - costs.experts_params + experts,
        experts=experts,
        embedding=costs.embedding_params,
        root=costs.root_params,
        shard=job.shard,
        experts_shard=job.efsdp,
        adapters=adapter_elements(job),  # costs.block_params counts them: the trace adds them as the run does
        lora=job.lora is not None,
    )


def _hidden(job: Job, params: _RankParams) -> float:
    """The rank's parameters Muon updates (its blocks' hidden matrices, TP's shards of them); 0 without Muon."""
    blocks = sum(len(params.stages[g]) for g in params.local)
    return (
        blocks * tp_rank_elements(job.cfg.model.name, job.args, list(job.fam.hidden_matrices), tp=job.dims.tp)
        if job.muon
        else 0.0
    )


@dataclass(frozen=True)
class _ShardedState:
    """The fp32 master state of a rank, FSDP's shards of what TP left: 4 bytes per parameter for the parameters,
    4 for the gradients, 8 for AdamW's two moments (4 for Muon's momentum of a hidden matrix). Under LoRA the frozen
    base is stored in param_dtype with neither gradients nor optimizer state, and the fp32 state is the adapters'.
    On the GPU unless CPU offload moves it to the host."""

    params: float
    """Every parameter shard of the rank: the frozen base's (LoRA) and the fp32 master weights of what trains."""
    grads: float
    adam: float
    on_gpu: bool
    frozen: float
    """Of `params`, LoRA's frozen base: param_dtype bytes per parameter of the rank / shard; 0 without LoRA."""
    static: float
    """Allocated once and never freed, on the GPU: parameters and AdamW state."""
    block_grads: float
    """One block's gradient shards, on the GPU."""
    earlier_grads: float
    """The gradient shards of the step's earlier micro-batches (gradient accumulation), on the GPU."""


def _sharded_state(job: Job, params: _RankParams) -> _ShardedState:
    master, grads, adam = (n * params.trainable_sharded for n in (4, 4, 8))
    adam -= 4 * _hidden(job, params) / job.shard  # Muon keeps one momentum for a hidden matrix, AdamW two moments
    frozen = 0.0
    if params.lora:  # the base, stored in param_dtype (what FSDP gathers), sharded as it would be if it trained
        frozen = DTYPE_BYTES[job.cfg.training.mixed_precision_param] * (params.sharded - params.trainable_sharded)
    on_gpu = not job.cpu_offload
    return _ShardedState(
        params=frozen + master,
        grads=grads,
        adam=adam,
        on_gpu=on_gpu,
        frozen=frozen,
        static=frozen + master + adam if on_gpu else 0.0,
        block_grads=4 * params.trainable_sharded_block if on_gpu else 0.0,
        # (deferred reduce-scatters make no shards before the step's last micro-batch)
        earlier_grads=grads if on_gpu and job.grad_accum > 1 and not job.defers_reduce_scatter else 0.0,
    )


def _gathered_params(job: Job, params: _RankParams) -> dict[str, float]:
    """Bytes of the parameters gathered in param_dtype during each phase of backward (loss, block, embedding).

    Without PP the embedding and blocks are resharded after forward and the root (norm + output) is not; in
    backward one block is gathered plus the prefetched one, and the embedding is not gathered again (its backward
    does not read it, parallelisms/fsdp.py). Under PP the rank's stages stay gathered from their first forward to
    the end of the step."""
    param_bytes = DTYPE_BYTES[job.cfg.training.mixed_precision_param]
    if not job.fsdp:
        # One rank, nothing gathered: under autocast each weight's param_dtype copy lives while autograd needs it, the
        # output projection's through the loss backward (chunked: the chunk term's), a block's through its backward
        # (saved without AC, counted with the activations then; cast again by the recomputation under AC).
        # LoRA's frozen base is stored in param_dtype: autocast casts only the adapters.
        if not job.autocast:
            return dict.fromkeys(("loss", "block", "embedding"), 0.0)
        root = 0.0 if job.chunk_tokens or params.lora else param_bytes * params.root
        return {"loss": root, "block": param_bytes * params.trainable_block, "embedding": 0.0}
    if job.dims.pp > 1:
        return dict.fromkeys(("loss", "block", "embedding"), param_bytes * params.total)
    root = param_bytes * params.root
    return {"loss": root, "block": param_bytes * (params.root + 2 * params.block), "embedding": root}


@dataclass(frozen=True)
class _Activations:
    """What one micro-batch leaves for backward on this rank, as the trace found it: per block of a stage, and
    outside the blocks."""

    stages: list[list[int]]
    kept: dict[str, int]
    """What a block keeps from forward to backward, by its AC mode: none (no_ac), op (its input and op SAC's cache),
    full (its input)."""
    modes: list[list[str]]
    """Each stage's blocks' AC modes, in order (parallelisms/ac.py block_modes)."""
    token_ids: int
    """Token ids and labels (int64), and CP's mask on CPU."""
    final_norm: int
    """The final norm's saves and its output, gathered over the sequence, which the loss keeps."""
    log_softmax: int
    """The loss's fp32 log-softmax (loss parallel keeps the vocabulary sharded); the chunked loss keeps none."""
    stage_output: float
    """Kept by a pipeline stage for its backward; the last stage's feeds the final norm."""

    def blocks(self, stage: int) -> list[int]:
        return [self.kept[mode] for mode in self.modes[stage]]

    @property
    def no_ac(self) -> int:
        """One block's saved bytes without activation checkpointing."""
        return self.kept["none"]

    @property
    def checkpointed(self) -> int:
        """What a checkpointed block keeps, of the mode that recomputes most among them; 0 without AC."""
        used = {mode for stage in self.modes for mode in stage} - {"none"}
        return self.kept[max(used, key=BLOCK_AC_MODES.index)] if used else 0

    def outside(self, stage: int) -> float:
        last = stage == len(self.stages) - 1
        return self.token_ids + (self.final_norm + self.log_softmax if last else self.stage_output)


def _activations(job: Job, costs: BlockCosts, stages: list[list[int]], *, tp_mesh: DeviceMesh | None) -> _Activations:
    param_bytes, tokens, dim = DTYPE_BYTES[job.cfg.training.mixed_precision_param], job.microbatch_tokens, job.args.dim
    chunked = job.chunk_tokens > 0
    modes = [layer_modes(job, stage) for stage in stages]
    used = tuple(dict.fromkeys(mode for stage in modes for mode in stage if mode != "none"))
    kept = {mode: c.kept for mode, c in mode_costs(job, used, tp_mesh=tp_mesh).items()}
    return _Activations(
        stages=stages,
        kept={"none": costs.saved, **kept},
        modes=modes,
        token_ids=16 * tokens + cp_kv_bytes(job)["mask"],
        final_norm=costs.final_norm + param_bytes * tokens * dim,
        log_softmax=0 if chunked else 4 * tokens * job.args.vocab_size // job.dims.tp,
        stage_output=param_bytes * tokens * dim / job.dims.tp,
    )


@dataclass(frozen=True)
class _Transients:
    """What exists during part of a backward only, per micro-batch."""

    logits_held: float
    """The logits in param_dtype, while a loop that keeps them holds them."""
    loss: float
    """The loss backward's buffers beyond the saved log-softmax (docs/planning.md, "How the estimator counts": "logits + loss")."""
    activation_grads: float
    """A block backward's activation gradients."""
    reduce_scatter_inputs: float
    """A block's unsharded gradient in param_dtype and its reduce_dtype copy."""
    exchange: float
    """Expert parallel's rows in flight in a block's backward (`ep_bytes`)."""
    exchange_rows: float
    """The rows (token, choice pairs) each MoE block's experts on this rank receive (`ep_bytes`)."""
    root_grad: float
    """The root unit's unsharded gradient, from the loss backward to the end."""
    pp_buffers: float
    """The pipeline's send and receive buffers."""
    weight_grad_inputs: int
    """Zero bubble: per block, what its weight gradients need between a micro-batch's input and weight backward."""


def _transients(job: Job, costs: BlockCosts, params: _RankParams) -> _Transients:
    tp, tokens, vocab, dim = job.dims.tp, job.microbatch_tokens, job.args.vocab_size, job.args.dim
    param_bytes, reduce_bytes = (
        DTYPE_BYTES[job.cfg.training.mixed_precision_param],
        DTYPE_BYTES[job.cfg.training.mixed_precision_reduce],
    )
    ep = ep_bytes(job, costs)
    # Start of the loss backward, in fp32 per logit: the saved log-softmax (4, counted with the activations) plus,
    # for the fused cross-entropy (tp 1), nll's gradient and log-softmax's gradient (4 + 4); under loss parallel
    # (tp > 1) torch's DTensor backward builds zeros_like(x), exp(x), their sum and the product (up to 4 x 4
    # alive). Plus the logits in param_dtype while the loop still holds them.
    logits = param_bytes * tokens * vocab / tp if job.logits_kept_in_backward else 0.0
    loss = (8 if tp == 1 else 12) * tokens * vocab / tp + logits
    if job.chunk_tokens:
        # loss.py: forward keeps no logits; backward recomputes one chunk (bf16 logits, fp32 copy, log-softmax,
        # gradients) while the gradients of the final norm's output and of the output projection accumulate.
        per_logit = param_bytes + 4 + 4 + (8 if tp == 1 else 12)
        output_grad = 0 if job.lora is not None else param_bytes * costs.root_params  # LoRA: the output is frozen
        loss = per_logit * job.chunk_tokens * vocab / tp + 4 * tokens * dim + output_grad
    return _Transients(
        logits_held=logits,
        loss=loss,
        # Backward of one block: besides the recomputation (AC) of what it did not keep, its activation gradients
        # (about two T x D tensors and two of the widest projection's output alive at once, SwiGLU's hidden
        # units for Llama; under TP one T x D is the full-size partial gradient of a gathered input) and its
        # unsharded gradient in param_dtype plus its reduce_dtype copy (FSDP's reduce-scatter input; under PP
        # the accumulator's first upcast).
        activation_grads=param_bytes * tokens * (dim + dim / tp) + 2 * costs.widest,
        # Without FSDP (one rank) a gradient is float32 in .grad as soon as backward makes it: under autocast a
        # block's param_dtype gradients before their casts, and the output projection's from the loss backward on.
        reduce_scatter_inputs=(param_bytes + reduce_bytes if job.fsdp else param_bytes if job.autocast else 0)
        * params.trainable_block,
        exchange=ep["exchange"],
        exchange_rows=ep["received_rows"],
        root_grad=0.0 if params.lora else (param_bytes if job.fsdp else 4) * costs.root_params,
        pp_buffers=2 * param_bytes * tokens * dim / tp if job.dims.pp > 1 else 0.0,
        weight_grad_inputs=costs.matmul_inputs,
    )


@dataclass(frozen=True)
class _Teacher:
    """[distill]'s frozen teacher on this rank (distill.py: built and sharded as the student is, no gradient, no
    optimizer state, its forward under no_grad before the student's), as the estimate counts it; zeros without one."""

    params: float = 0.0
    """FSDP's fp32 shards of what TP left (the model is built in fp32, as the student's master copy; param_dtype is what
    FSDP gathers): 4 B per parameter / (shard x tp), on the GPU unless CPU offload moves them."""
    root: float = 0.0
    """Its root unit (final norm + output projection) gathered in param_dtype from its first forward on: FSDP reshards
    a root unit in backward, which the teacher never runs (and the loss's teacher.project reads the whole matrix)."""
    hidden: float = 0.0
    """Its final hidden states of the micro-batch (tokens x its dim, param_dtype), kept from its forward through the
    student's loss backward (the chunks' checkpoints hold them)."""
    loss: float = 0.0
    """What the divergence adds to the loss phase beyond the student's cross-entropy, per logit of the chunk (or the
    micro-batch): the teacher's logits in param_dtype and four fp32 logit-sized tensors (the teacher's log-softmax and
    its exp, the student's second log-softmax, the divergence's gradient; + 4 B under loss parallel's own log-softmax)."""
    forward: float = 0.0
    """Its forward's working set beyond `root` and `hidden`: two blocks gathered in param_dtype (one computing, one
    prefetched) and one block's transient tensors (about two T x D and two of its widest projection's output): no_grad
    keeps nothing of a block once it is done, so no activations are held."""
    block_unit: float = 0.0
    """One of its blocks as FSDP gathers it on this rank, in param_dtype (the all-gather stream's outputs)."""


def _teacher(job: Job, *, tp_mesh: DeviceMesh | None) -> _Teacher:
    """The teacher's terms (`_Teacher`): its shape from distill.teacher_config (its folder's config, else
    distill.teacher_name / teacher_flavor), its parameters on this rank as the student's are counted (a trace of one
    of its blocks, planning/trace.py)."""
    from config import model_args
    from distill import teacher_config  # a leaf of the recipe: loaded only for a job that distills

    tcfg = teacher_config(job.cfg)
    tjob = dataclasses.replace(job, cfg=tcfg, args=model_args(tcfg.model))
    costs = block_costs(tjob, "none", tp_mesh=tp_mesh)
    params = _rank_params(tjob, costs, 0)
    param_bytes, tokens = DTYPE_BYTES[job.cfg.training.mixed_precision_param], job.microbatch_tokens
    tp, vocab, dim = job.dims.tp, job.args.vocab_size, tjob.args.dim
    logits = (job.chunk_tokens or tokens) * vocab / (tp if job.loss_parallel else 1)
    return _Teacher(
        params=0.0 if job.cpu_offload else 4 * params.sharded,
        root=param_bytes * params.root if job.fsdp else 0.0,
        hidden=param_bytes * tokens * dim,
        loss=(param_bytes + (16 if tp == 1 else 20)) * logits,
        forward=(2 * param_bytes * params.block if job.fsdp else 0.0)
        + param_bytes * tokens * (dim + dim / tp)
        + 2 * costs.widest,
        block_unit=param_bytes * params.block,
    )


class _Replay:
    """The rank's forwards and backwards in its schedule's order, and the worst moment of each phase of backward
    (loss, block, embedding): the bytes alive then beyond the static state, the gradient shards among them (they
    live in the reduce-scatter stream's pool, see "Reserved"), and where."""

    def __init__(
        self,
        job: Job,
        *,
        params: _RankParams,
        state: _ShardedState,
        gathered: dict[str, float],
        acts: _Activations,
        transients: _Transients,
        teacher: _Teacher,
    ) -> None:
        self.params, self.state, self.gathered, self.acts, self.transients = params, state, gathered, acts, transients
        self.teacher = teacher
        self.pipelined, self.fsdp = job.dims.pp > 1, job.fsdp
        # Gradients summed unsharded from a stage's first backward on (PP, or FSDP deferring its reduce-scatters).
        self.accumulates = job.accumulates_unsharded
        self.param_bytes, self.reduce_bytes = (
            DTYPE_BYTES[job.cfg.training.mixed_precision_param],
            DTYPE_BYTES[job.cfg.training.mixed_precision_reduce],
        )
        self.held: dict[tuple[int, int], float] = {}  # (local stage, micro-batch) -> its activations
        self.backward_done: set[int] = set()  # stages with reduce_dtype accumulators (after their first backward)
        self.phases: dict[str, tuple[float, float, str]] = {}  # phase -> (bytes, shards among them, where)
        self.most_held = 0

    def run(self, ops: list[tuple[str, int, int]]) -> None:
        """ops: (kind, local stage, micro-batch) as rank_ops lists them; kind F forward, B backward, or zero bubble's
        I (input) and W (weight) backward."""
        for kind, local_stage, microbatch in ops:
            stage, key = self.params.local[local_stage], (local_stage, microbatch)
            if kind == "F":
                self.held[key] = sum(self.acts.blocks(stage)) + self.acts.outside(stage)
                self.most_held = max(self.most_held, len(self.held))
            elif kind == "W":
                del self.held[key]
            else:
                self._backward(stage, key)
                self.backward_done.add(stage)
                if kind == "I":
                    self.held[key] = len(self.acts.blocks(stage)) * self.transients.weight_grad_inputs
                else:
                    del self.held[key]

    def _backward(self, stage: int, key: tuple[int, int]) -> None:
        """One backward of `stage` for one micro-batch: the loss (on the last stage), every block from the last to
        the first, the embedding (on stage 0)."""
        params, state, acts, transients = self.params, self.state, self.acts, self.transients
        others = sum(self.held.values()) - self.held[key]
        first = stage not in self.backward_done
        accumulated = sum(params.trainable_of_stage(k) for k in self.backward_done)
        accumulators = self.reduce_bytes * accumulated if self.accumulates else 0.0
        base = state.earlier_grads + accumulators + others + transients.pp_buffers + self.teacher.hidden
        where = f"stage {stage}, micro-batch {key[1]}" if self.pipelined else ""
        last = stage == params.last_stage
        if last:
            value = self.gathered["loss"] + base + self.held[key] + transients.loss + self.teacher.loss
            self._record("loss", value, state.earlier_grads, where)
        blocks = acts.blocks(stage)
        remaining = sum(blocks) + acts.token_ids
        root_grad = transients.root_grad if last else 0.0
        # Per block processed: its gradient joins the shards (no PP) or, in a stage's first backward, the
        # accumulators (PP, deferred reduce-scatters); later backwards add into accumulators that exist.
        trains = params.trainable_block
        done_each = (self.reduce_bytes * trains if first else 0.0) if self.accumulates else state.block_grads
        unsharded = transients.reduce_scatter_inputs if first or not self.accumulates else self.param_bytes * trains
        for j, i in enumerate(reversed(range(len(blocks)))):
            # recompute + gradients (+ expert parallel's rows in flight)
            transient = acts.no_ac - blocks[i] + transients.activation_grads + transients.exchange + unsharded
            done = j * done_each
            value = self.gathered["block"] + base + done + root_grad + remaining + transient
            shards = state.earlier_grads + (0.0 if self.accumulates else done)
            self._record("block", value, shards, f"{where}, block {params.stages[stage][i]}".removeprefix(", "))
            remaining -= blocks[i]
        if stage == 0 and params.embedding:
            done = len(blocks) * done_each
            # Its unsharded gradient and FSDP's reduce_dtype copy; without FSDP (one rank) its float32 .grad; none when
            # it is frozen (LoRA).
            per_param = self.param_bytes + (self.reduce_bytes if first else 0) if self.fsdp else 4
            grads = per_param * params.trainable_embedding
            value = self.gathered["embedding"] + base + done + root_grad + acts.token_ids + grads
            self._record("embedding", value, state.earlier_grads + (0.0 if self.accumulates else done), where)

    def worst(self) -> tuple[str, float, float, str]:
        """The phase with the most bytes alive at its worst moment: its name, the bytes, the shards in them, where."""
        phase = max(self.phases, key=lambda k: self.phases[k][0])
        return (phase, *self.phases[phase])

    def _record(self, phase: str, value: float, shards: float, where: str) -> None:
        if value > self.phases.get(phase, (-1.0,))[0]:
            self.phases[phase] = (value, shards, where)


def estimate_rank(job: Job, pp_rank: int = 0, *, tp_mesh: DeviceMesh | None = None) -> dict[str, float | int | str]:
    """Per-GPU bytes by component, the allocated peak and the reserved estimate of one pp rank (the module
    docstring tells the story). tp_mesh: see block_costs."""
    costs = job_costs(job, tp_mesh=tp_mesh)
    params = _rank_params(job, costs, pp_rank)
    state = _sharded_state(job, params)
    acts, transients = _activations(job, costs, params.stages, tp_mesh=tp_mesh), _transients(job, costs, params)
    teacher = _Teacher()  # none: all zeros
    if job.cfg.distill.enable:  # [distill]'s frozen teacher (distill.py)
        teacher = _teacher(job, tp_mesh=tp_mesh)
    replay = _Replay(
        job,
        params=params,
        state=state,
        gathered=_gathered_params(job, params),
        acts=acts,
        transients=transients,
        teacher=teacher,
    )
    if job.dims.pp > 1:
        n_local, n_mb = len(params.local), job.microbatches
        replay.run(
            rank_ops(
                job.cfg.parallelism.pipeline_parallel_schedule,
                pp_rank=pp_rank,
                pp=job.dims.pp,
                n_local=n_local,
                n_mb=n_mb,
            )
        )
    elif job.accumulates_unsharded:  # the second micro-batch runs with every gradient accumulated unsharded
        replay.run([("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)])
    else:
        replay.run([("F", 0, 0), ("B", 0, 0)])
    if job.cfg.distill.enable:  # before each micro-batch's forward; from the second on, the earlier gradient shards
        forward = state.earlier_grads + teacher.forward + teacher.hidden
        replay.phases["teacher forward"] = (forward, state.earlier_grads, "")
    if job.muon:
        replay.phases["optimizer step"] = (_muon_step(job, params, state), state.grads * state.on_gpu, "Muon")
    return _report(job, pp_rank, replay)


def _muon_step(job: Job, params: _RankParams, state: _ShardedState) -> float:
    """Bytes alive beyond the static state in Muon's step (muon.py): every gradient shard, each hidden matrix's
    Nesterov update (float32) and its orthogonalized blocks (bfloat16), and the largest matrix whole on its owner:
    the blocks sent and received, the matrix, the iteration's operand, its Gram matrices and result (bfloat16)."""
    local = _hidden(job, params) / job.shard
    return state.grads * state.on_gpu + (4 + 2) * local + 6 * 2 * max(hidden_matrices(job.cfg.model.name, job.args))


def _peak(job: Job, replay: _Replay) -> dict[str, float | str]:
    """The allocated peak (static state + the worst phase) and what the caching allocator reserves for it: state +
    the reduce-scatter stream's shards + the all-gather stream's flat outputs + the compute stream's peak with
    fragmentation (docs/planning.md, "How the estimator counts": "Reserved")."""
    params, state, phases, teacher = replay.params, replay.state, replay.phases, replay.teacher
    peak_phase, peak_value, _, peak_where = replay.worst()
    static = state.static + teacher.params + teacher.root  # the teacher's root unit, once gathered, stays
    allocated = static + peak_value
    largest_grads = params.trainable_sharded_block if params.lora else params.largest_shard
    rs_pool = state.grads if state.on_gpu else 4 * largest_grads
    param_bytes = DTYPE_BYTES[job.cfg.training.mixed_precision_param]
    ag_pool = max(param_bytes * params.largest_unit, 2 * param_bytes * params.block, 2 * teacher.block_unit)
    compute = max(value - shards for value, shards, _ in phases.values())
    if not job.fsdp:  # one rank: no FSDP streams, the gradients are the compute stream's
        rs_pool, ag_pool, compute = 0.0, 0.0, max(value for value, _, _ in phases.values())
    if job.machine.reserves:
        reserved = static + rs_pool + ag_pool + (1 + FRAGMENTATION) * compute
    else:
        reserved = allocated
    return {
        "peak_phase": (peak_phase if peak_phase in ("optimizer step", "teacher forward") else f"{peak_phase} backward")
        + (f" ({peak_where})" if peak_where else ""),
        "allocator_peak": allocated,
        "rs_pool": rs_pool,
        "ag_pool": ag_pool,
        "compute_peak": compute,
        "reserved": reserved,
    }


def _report(job: Job, pp_rank: int, replay: _Replay) -> dict[str, float | int | str]:
    """estimate_rank's result: every term of the breakdown, the peak and the reserved estimate."""
    params, state, acts, transients, phases = replay.params, replay.state, replay.acts, replay.transients, replay.phases
    param_bytes, reduce_bytes = (
        DTYPE_BYTES[job.cfg.training.mixed_precision_param],
        DTYPE_BYTES[job.cfg.training.mixed_precision_reduce],
    )
    recompute = max(acts.no_ac - min(acts.blocks(g), default=acts.no_ac) for g in params.local)  # the worst block's
    block_backward = recompute + transients.activation_grads + transients.exchange + transients.reduce_scatter_inputs
    peak = _peak(job, replay)
    overhead = job.machine.overhead
    return {
        "pp_rank": pp_rank,
        "pp_stages": ", ".join(map(str, params.local)),
        "rank_blocks": sum(len(params.stages[g]) for g in params.local),
        "microbatches_held": replay.most_held,
        "params": state.params,
        "frozen_params": state.frozen,
        "adapter_params": params.adapters * sum(len(params.stages[g]) for g in params.local),
        "grads": state.grads,
        "adam": state.adam,
        "state_on_gpu": state.params + state.grads + state.adam if state.on_gpu else 0.0,
        "state_on_host": 0.0 if state.on_gpu else state.params + state.grads + state.adam,
        "grads_at_peak": replay.worst()[2],
        "block_unit": param_bytes * params.block,
        "output_unit": param_bytes * params.root,
        "embedding_unit": param_bytes * params.embedding,
        "gathered_loss_phase": replay.gathered["loss"],
        "gathered_block_phase": replay.gathered["block"],
        "act_per_block_no_ac": acts.no_ac,
        "act_per_block_checkpointed": acts.checkpointed,
        "act_blocks": sum(sum(acts.blocks(g)) for g in params.local),
        "act_outside_blocks": acts.token_ids + acts.final_norm,
        "loss_buffers": acts.log_softmax + transients.loss,
        "logits_held": transients.logits_held,
        "root_grad": transients.root_grad,
        "accumulators": reduce_bytes * params.trainable_total if job.accumulates_unsharded else 0.0,
        "pp_buffers": transients.pp_buffers,
        "block_backward": block_backward,
        "recompute": recompute,
        "grad_acts": transients.activation_grads,
        "rs_buffers": transients.reduce_scatter_inputs,
        "ep_exchange": transients.exchange,
        "ep_rows": transients.exchange_rows,
        "experts_unit": param_bytes * params.experts,
        **{f"{kind}_phase": phases.get(kind, (0.0,))[0] for kind in ("loss", "block", "embedding")},
        "muon_step_phase": phases.get("optimizer step", (0.0,))[0],
        "teacher_params": replay.teacher.params,
        "teacher_root": replay.teacher.root,
        "teacher_hidden": replay.teacher.hidden,
        "teacher_loss": replay.teacher.loss,
        "teacher_forward_phase": phases.get("teacher forward", (0.0,))[0],
        **{f"{kind}_phase_at": phases.get(kind, (0.0, 0.0, "-"))[2] for kind in ("loss", "block", "embedding")},
        **peak,
        "overhead": overhead,
        "total": peak["reserved"] + overhead,
    }


def estimate(job: Job, *, tp_mesh: DeviceMesh | None = None) -> dict[str, float | int | str]:
    """estimate_rank of the pp rank that needs the most memory (reserved; without PP the one rank)."""
    return max((estimate_rank(job, rank, tp_mesh=tp_mesh) for rank in range(job.dims.pp)), key=lambda e: e["reserved"])


# --------------------------------------------------------------- activation checkpointing chosen to fit

# activation_checkpoint.memory_budget_gib's default: this share of the CUDA device's memory (the rest: what the
# estimate leaves out and the allocator's slack beyond its reserved model).
AUTO_BUDGET_SHARE = 0.9


@dataclass(frozen=True)
class ACChoice:
    """What mode "auto" chose (`choose_ac`): each block's AC mode, the estimate of the job with it, and the budget."""

    modes: tuple[str, ...]
    estimate: dict[str, float | int | str]
    budget: float  # bytes
    recompute_flops: float  # of one micro-batch through the model's blocks, the recomputation's FLOPs (one rank)

    def describe(self) -> str:
        """One line (after "auto: "): the blocks of each mode, the estimated peak against the budget, the recomputation,
        and the choice written out as config keys."""
        runs, start = [], 0
        for i in range(1, len(self.modes) + 1):
            if i == len(self.modes) or self.modes[i] != self.modes[start]:
                blocks = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
                runs.append(f"{self.modes[start]} {blocks}")
                start = i
        names = {"none": "no AC", "op": "op SAC", "full": "full AC"}
        spelled = ", ".join(f"{names[mode]} {blocks}" for mode, blocks in (r.split(" ", 1) for r in runs))
        flops = self.recompute_flops
        recompute = f"{flops / 1e12:.3g} TFLOP" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP"
        written = ", ".join(f'"{mode}"' for mode in self.modes)
        return (
            f"blocks {spelled}; estimated peak {_gib(self.estimate['total'])} of the {_gib(self.budget)} budget; "
            f'recomputes {recompute} a micro-batch (written out: mode = "per_block", per_block = [{written}])'
        )


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / GiB:.3g} GiB"


def ac_budget_gib(cfg: ActivationCheckpoint, *, cuda_memory_gib: float | None) -> float:
    """The memory mode "auto" fits a job into: memory_budget_gib, or AUTO_BUDGET_SHARE of the CUDA device's memory
    (`cuda_memory_gib`: this GPU's, or the one a plan is made for); without either, ConfigError."""
    if cfg.memory_budget_gib > 0:
        return cfg.memory_budget_gib
    if cuda_memory_gib is None:
        raise ConfigError(
            'activation_checkpoint.memory_budget_gib: mode = "auto" fits the job into it, and without a CUDA device '
            f"there is no GPU memory to default to ({AUTO_BUDGET_SHARE:.0%} of it); set it, e.g. 72 for an 80 GiB GPU"
        )
    return AUTO_BUDGET_SHARE * cuda_memory_gib


def choose_ac(job: Job, *, budget_gib: float, tp_mesh: DeviceMesh | None = None) -> ACChoice:
    """Mode "auto": each block's AC mode ("none", "op" or "full"), the assignment with the least recomputation (FLOPs,
    as the block's trace counts them) whose estimated memory (`estimate`'s total) fits `budget_gib`.

    The assignments tried: the first f blocks full, the next o op SAC, the rest none. The earliest blocks are the
    ones to checkpoint: a block's activations are held from its forward until its backward, which comes last for
    the first block (and under pipeline parallel the first stage holds the most micro-batches). For each f the smallest o that fits is found by bisection
    (the memory only falls as a block moves from none to op). ConfigError when not even full AC everywhere fits."""
    n, budget = job.args.n_layers, budget_gib * GiB
    recompute = {mode: c.recompute_flops for mode, c in mode_costs(job, tp_mesh=tp_mesh).items()}

    def trial(f: int, o: int) -> dict[str, float | int | str]:
        modes = ("full",) * f + ("op",) * o + ("none",) * (n - f - o)
        return estimate(with_ac(job, mode="per_block", per_block=list(modes)), tp_mesh=tp_mesh)

    best: tuple[float, int, int, int, dict] | None = None  # (recompute, checkpointed blocks, f, o, estimate)
    for f in range(n + 1):
        if best is not None and f * recompute["full"] >= best[0]:
            break  # more full blocks only recompute more
        if (most := trial(f, n - f))["total"] > budget:
            continue
        lo, hi, fits = 0, n - f, most  # the smallest o that fits lies in [lo, hi]; `fits` is hi's estimate
        while lo < hi:
            mid = (lo + hi) // 2
            if (e := trial(f, mid))["total"] <= budget:
                hi, fits = mid, e
            else:
                lo = mid + 1
        cost = f * recompute["full"] + hi * recompute["op"]
        if best is None or (cost, f + hi) < best[:2]:
            best = (cost, f + hi, f, hi, fits)
    if best is None:
        full = estimate(with_ac(job, mode="full"), tp_mesh=tp_mesh)
        raise ConfigError(
            f"activation_checkpoint.memory_budget_gib: the job needs about {full['total'] / GiB:.3g} GiB per rank even "
            f"with full AC on every block, over the budget of {budget_gib:.3g} GiB; use more GPUs (FSDP, TP, PP), "
            "a smaller local_batch_size or seq_len, or a larger budget"
        )
    cost, _, f, o, fits = best
    modes = ("full",) * f + ("op",) * o + ("none",) * (n - f - o)
    return ACChoice(modes=modes, estimate=fits, budget=budget, recompute_flops=cost)


def with_ac(job: Job, **changes: Any) -> Job:
    """The job with these [activation_checkpoint] keys changed (e.g. mode="per_block", per_block=[...])."""
    ac = dataclasses.replace(job.cfg.activation_checkpoint, **changes)
    return dataclasses.replace(job, cfg=dataclasses.replace(job.cfg, activation_checkpoint=ac))


def resolve_auto_ac(
    cfg: JobConfig, *, world_size: int, machine: Machine, tp_mesh: DeviceMesh | None = None
) -> tuple[JobConfig, ACChoice | None]:
    """A config of mode "auto" as the run applies it: mode "per_block" with `choose_ac`'s blocks, and the choice; any
    other config unchanged, and None. The job runs on `world_size` ranks of `machine`: CUDA GPUs of its
    device_memory_gib each (this one's, or the one a plan is made for) or CPU ranks. train.py, --print-config, the dry
    run and the doctor all resolve it here. ConfigError: no budget without CUDA, or a job that fits with no
    assignment."""
    ac = cfg.activation_checkpoint
    if ac.mode != "auto":
        return cfg, None
    budget = ac_budget_gib(ac, cuda_memory_gib=machine.cuda_memory_gib)
    choice = choose_ac(Job.of(cfg, machine, world_size=world_size), budget_gib=budget, tp_mesh=tp_mesh)
    chosen = dataclasses.replace(ac, mode="per_block", per_block=list(choice.modes), memory_budget_gib=0.0)
    return dataclasses.replace(cfg, activation_checkpoint=chosen), choice


def cuda_memory_gib(device: torch.device) -> float | None:
    """The memory of `device` when it is a CUDA GPU, in GiB; None on any other device."""
    return torch.cuda.get_device_properties(device).total_memory / GiB if device.type == "cuda" else None
