"""The load-balancing loss of a mixture of experts over the global batch (models/moe.py), in layouts of 4 gloo ranks
against one process, in one launch (tests/test_moe_balance.py reads what rank 0 writes):

    torchrun --nproc_per_node=4 tests/moe_balance_worker.py OUT_JSON

One global batch of 8 sequences, the same initial weights everywhere (tests/parity_worker.py's tiny mixture of 4
experts, 2 per token, in 2 blocks). Each layout runs one step's micro-batches through train.py's ForwardBackward and
its Balancer, and reports the logged loss (`Balancer.summary`), the gradients (gathered whole) and the expert biases
after the step. The references are computed on every rank alone: the value from transformers' load_balancing_loss_func
applied to each layer's router output over the whole batch (or over each micro-batch, for the "microbatch" scope), the
gradients from one process's single micro-batch of all 8 sequences, the biases from torchtitan 0.2.2's rule on the
whole batch's counts.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from config import JobConfig, Model, Parallelism, Training
from data.loader import Batch
from forward import ForwardBackward
from loss import Loss
from models.moe import Balancer, MoEBalance
from models.qwen3_moe import Transformer
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import build_model, init_model
from tests.parity_worker import SEQ_LEN, TINY_QWEN3_MOE

ROWS = 8  # the global batch
COEF = 0.1  # tests/test_moe_balance.py's
BIAS = 1e-2  # load_balance_coeff where a layout moves the biases


@dataclasses.dataclass(frozen=True)
class Layout:
    dp_shard: int = 4
    pp: int = 1
    tp: int = 1
    ep: int = 1
    accum: int = 1  # micro-batches per step (each rank's rows split into this many)
    scope: str = "global_batch"
    bias: bool = False  # load_balance_coeff = BIAS

    @property
    def settings(self) -> MoEBalance:
        return MoEBalance(COEF, self.scope, BIAS if self.bias else 0.0)  # type: ignore[arg-type]


LAYOUTS = {
    "fsdp4_accum2": Layout(accum=2),  # the test: 4 ranks x 2 micro-batches
    "fsdp4": Layout(bias=True),  # gradients and biases: 4 ranks x 1 micro-batch
    "fsdp4_microbatch": Layout(scope="microbatch"),  # the failure: other gradients, another value
    "pp2_fsdp2_accum2": Layout(dp_shard=2, pp=2, accum=2),  # pipeline micro-batches of 1 sequence
    "ep2_fsdp4": Layout(ep=2, bias=True),  # the counts are taken before dispatch
    "tp2_ep2_fsdp2": Layout(dp_shard=2, tp=2, ep=2),  # sequence parallel: each TP rank's own tokens at the experts
}


def tokens() -> torch.Tensor:
    return torch.randint(0, TINY_QWEN3_MOE.vocab_size, (ROWS, SEQ_LEN + 1), generator=torch.Generator().manual_seed(5))


def initial(settings: MoEBalance) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(TINY_QWEN3_MOE, balance=settings))
    model.init_weights()
    return model.state_dict()


def reference(settings: MoEBalance, batch: torch.Tensor, *, microbatch_rows: int) -> dict[str, Any]:
    """One process: the value of `settings`' scope (transformers' function; "microbatch": each piece of
    `microbatch_rows` rows alone, as the ranks' micro-batches hold them), the biases after a step on the batch, and
    the gradients of the global batch's loss at a second step on it (f the first's counts, the biases moved)."""
    global_batch = dataclasses.replace(settings, aux_loss_scope="global_batch")
    model = Transformer(dataclasses.replace(TINY_QWEN3_MOE, balance=global_batch))
    model.load_state_dict(initial(settings))
    routers: list[torch.Tensor] = []
    for block in model.layers.values():  # the router's probabilities, as the logits transformers' function takes
        block.moe.router.register_forward_hook(lambda module, args, out: routers.append(out.probs.detach().log()))
    with torch.no_grad():
        model(batch[:, :-1])
    experts, top_k = model.args.num_experts, model.args.top_k
    pieces = 1 if settings.aux_loss_scope == "global_batch" else ROWS // microbatch_rows
    value = torch.stack(
        [load_balancing_loss_func((part,), experts, top_k) for r in routers for part in r.tensor_split(pieces)]
    ).mean()
    counts = torch.stack([torch.bincount(r.topk(top_k).indices.flatten(), minlength=experts) for r in routers])
    step = settings.load_balance_coeff * torch.sign(counts.double().mean(dim=1, keepdim=True) - counts)
    bias = (step - step.mean(dim=1, keepdim=True)).float()
    for layer, block in enumerate(model.layers.values()):  # as after a first step on this batch
        block.moe.balance.load.copy_(torch.cat([counts[layer], counts.new_tensor([len(routers[0])])]))
        if block.moe.balance.expert_bias is not None:
            block.moe.balance.expert_bias.copy_(bias[layer])
    ForwardBackward(model, Loss(), device=torch.device("cpu"))(Batch(batch[:, :-1], batch[:, 1:], None, 1), last=True)
    return {"value": value.item(), "grads": {name: p.grad for name, p in model.named_parameters()}, "bias": bias}


def run_layout(layout: Layout, batch: torch.Tensor) -> dict[str, Any]:
    """Two steps of the layout on the same batch, no optimizer step between them: the first's logged value and the
    biases after it, the second's gradients (its f the first's counts)."""
    world = dist.get_world_size()
    parallelism = Parallelism(
        data_parallel_shard_degree=layout.dp_shard,
        pipeline_parallel_degree=layout.pp,
        pipeline_parallel_microbatch_size=1,
        tensor_parallel_degree=layout.tp,
        expert_parallel_degree=layout.ep,
    )
    dims = ParallelDims.from_config(parallelism, world_size=world)
    mesh = dims.build_mesh("cpu")
    per_rank = ROWS // dims.dp
    cfg = JobConfig(
        model=Model(name="qwen3_moe"),
        training=Training(seq_len=SEQ_LEN, local_batch_size=per_rank // layout.accum, mixed_precision_param="float32"),
        parallelism=parallelism,
    )
    args = dataclasses.replace(TINY_QWEN3_MOE, balance=layout.settings)
    model, pipeline = build_model(cfg, args, dims=dims, mesh=mesh, loss_fn=Loss(), device=torch.device("cpu"))
    init_model(model, pipeline, device=torch.device("cpu"))
    options = StateDictOptions(full_state_dict=True)
    held = get_model_state_dict(model).keys()
    set_model_state_dict(model, {k: v for k, v in initial(layout.settings).items() if k in held}, options=options)
    pieces = layout.accum * (pipeline.n_microbatches if pipeline is not None else 1) * dims.tp  # as train.py
    balancer = Balancer.of(model, args, pieces_per_step=pieces)
    assert balancer is not None
    forward = ForwardBackward(
        model, Loss(), device=torch.device("cpu"), pipeline=pipeline, loss_parallel=dims.tp_enabled
    )
    mine = batch[dims.dp_rank(mesh) * per_rank : (dims.dp_rank(mesh) + 1) * per_rank]
    for step in (1, 2):
        model.zero_grad(set_to_none=True)
        for index, rows in enumerate(mine.tensor_split(layout.accum)):
            forward(Batch(rows[:, :-1], rows[:, 1:], None, layout.accum), last=index == layout.accum - 1)
        balancer(step, None)
        if step == 1:
            value = balancer.summary().aux_loss
            biases = [(int(name), block.moe.balance.expert_bias) for name, block in model.layers.items()]
            bias = {layer: b.clone() for layer, b in biases if b is not None}
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return {"value": value, "grads": grads, "bias": bias}


def compare(name: str, layout: Layout, batch: torch.Tensor) -> dict[str, Any]:
    ref = reference(layout.settings, batch, microbatch_rows=ROWS // (layout.dp_shard * layout.accum))
    got = run_layout(layout, batch)
    # global_batch: every layout's gradients are the reference's; microbatch: each rank's micro-batch has its own f.
    grad_diff = max((got["grads"][n] - ref["grads"][n]).abs().max().item() for n in got["grads"])
    router_diff = max(
        (got["grads"][n] - ref["grads"][n]).abs().max().item() for n in got["grads"] if n.endswith("router.weight")
    )
    bias_diff = max(((b - ref["bias"][layer]).abs().max().item() for layer, b in got["bias"].items()), default=None)
    moved = max((b.abs().max().item() for b in got["bias"].values()), default=None)
    result = {"value": got["value"], "reference": ref["value"], "grad_diff": grad_diff, "router_grad_diff": router_diff}
    result |= {"bias_diff": bias_diff, "bias_moved": moved, "grads": len(got["grads"])}
    worst = torch.tensor([grad_diff, router_diff, bias_diff or 0.0, abs(got["value"] - ref["value"])])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # a pipeline stage compares its own parameters
    result["worst"] = dict(
        zip(("grad_diff", "router_grad_diff", "bias_diff", "value_diff"), worst.tolist(), strict=True)
    )
    return result


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    dist.init_process_group("gloo")
    try:
        batch, results = tokens(), {}
        for name, layout in LAYOUTS.items():
            results[name] = compare(name, layout, batch)
            if dist.get_rank() == 0:
                print(name, json.dumps(results[name]), flush=True)
        if dist.get_rank() == 0:
            out.write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
