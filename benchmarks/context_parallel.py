"""Context parallel on CPU ranks: the activations each rank saves for backward at a long sequence, and the keys
and values it all-gathers, with CP 1, 2 and 4; against planning/estimate_memory.py's prediction of both.

    python -m benchmarks.context_parallel --out outputs/bench/context_parallel.json   # starts torchrun per CP degree

For each CP degree a torchrun launch of that many CPU ranks (gloo) builds the debug model as train.py does
(build_model: CP wraps the attention cores, FSDP shards over the CP ranks), fp32, no activation
checkpointing (what CP saves is what the rank's own tokens need), and runs one window of `--seq-len` tokens
forward and backward, each rank on its head-tail chunks (parallelisms/cp.py). Measured on rank 0:

  * the bytes autograd saves from forward to backward (benchmarks.memory.ActivationCensus: unique storages,
    parameters excluded), against estimate_memory.activation_bytes of the same job (Job.dims.cp);
  * the bytes of the keys and values all-gathered (the gathered tensors, forward) and of their gradients
    reduce-scattered (backward), from the functional collectives the dispatcher runs (FSDP's own all-gathers
    are c10d calls and not counted), against planning.exchanges.cp_kv_bytes x blocks.

A rank's queries shrink with cp, its saved keys and values do not (they span the window): that is why the
saved bytes fall by less than cp and why the all-gathered bytes grow with it ((cp - 1) / cp of them cross
the links).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import harness
from benchmarks.harness import MiB, Row
from benchmarks.memory import ActivationCensus
from config import ActivationCheckpoint, Compile, JobConfig, Parallelism, Training
from loss import build_loss_fn
from models import with_seq_len
from models.llama3 import FLAVORS
from parallelisms.cp import context_parallel
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import build_model, init_model
from planning.exchanges import cp_kv_bytes
from planning.job import CPU, Job
from planning.memory import activation_bytes
from tests.instruments import observe_ops

PROBLEM = "context parallel"
funcol = torch.ops._c10d_functional


def model_args(n_layers: int, seq_len: int) -> Any:
    """The debug model with `n_layers` blocks and a RoPE table of `seq_len` positions."""
    return with_seq_len(dataclasses.replace(FLAVORS["debugmodel"], n_layers=n_layers), seq_len)


def job(cp: int, seq_len: int) -> JobConfig:
    """The config one launch runs: CP over `cp` ranks (FSDP over them), one window of `seq_len` tokens, fp32, no AC.
    Built, not loaded: the debug model's RoPE table is stretched to seq_len (model_args), past what its flavor allows
    a training run."""
    cfg = JobConfig()
    cfg.model.flavor = "debugmodel"
    cfg.parallelism = Parallelism(data_parallel_shard_degree=1, context_parallel_degree=cp)
    cfg.training = Training(seq_len=seq_len, local_batch_size=1, mixed_precision_param="float32")
    cfg.activation_checkpoint = ActivationCheckpoint(mode="none")
    return cfg


def predicted(cp: int, *, seq_len: int, n_layers: int) -> dict[str, int]:
    """estimate_memory's activation bytes and K/V all-gather bytes for the job one launch runs."""
    estimated = Job.of(job(cp, seq_len), CPU, world_size=cp, args=model_args(n_layers, seq_len))
    return {
        "activation_bytes": activation_bytes(estimated)["total"],
        "kv_gathered_bytes": n_layers * cp_kv_bytes(estimated)["gathered"] if cp > 1 else 0,
    }


def measure_rank(args: argparse.Namespace) -> dict[str, Any]:
    """One launch (under torchrun): this world's CP degree, rank 0's numbers."""
    with harness.process_group() as device:
        cp_degree = dist.get_world_size()
        cfg = job(cp_degree, args.seq_len)
        parallelism = cfg.parallelism
        dims = ParallelDims.from_config(parallelism, world_size=cp_degree)
        mesh = dims.build_mesh(device.type)
        shape = model_args(args.n_layers, args.seq_len)
        loss_fn = build_loss_fn(Compile())
        model, _ = build_model(cfg, shape, dims=dims, mesh=mesh, loss_fn=loss_fn, device=device)
        init_model(model, None, device=device)
        tokens = torch.randint(0, shape.vocab_size, (1, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
        inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        if (cp := context_parallel(mesh, parallelism)) is not None:
            inputs, labels = cp.shard(inputs), cp.shard(labels)
        moved = {"all_gather": 0, "reduce_scatter": 0}

        def count(op: Any, args_: tuple, kwargs: dict, out: Any) -> None:
            if op is funcol.all_gather_into_tensor.default:
                moved["all_gather"] += out.numel() * out.element_size()
            elif op is funcol.reduce_scatter_tensor.default:
                moved["reduce_scatter"] += args_[0].numel() * args_[0].element_size()

        census = ActivationCensus(model)
        with observe_ops(count):
            with census():
                loss = model(inputs, head=functools.partial(loss_fn, model, labels=labels)).total
            kept = census.kept()
            loss.backward()
    return {
        "cp": cp_degree, "seq_len": args.seq_len, "n_layers": args.n_layers,
        "activation_bytes": sum(kept.by_source.values()), "kv_gathered_bytes": moved["all_gather"],
        "kv_grad_reduce_scattered_bytes": moved["reduce_scatter"],
        "predicted": predicted(cp_degree, seq_len=args.seq_len, n_layers=args.n_layers),
    }  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if "RANK" in os.environ:  # one launch of the loop below
        return measure_rank(args)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cps:
            out = Path(tmp) / f"cp{cp}.json"
            proc = harness.run_python(
                "-m",
                "benchmarks.context_parallel",
                "--out",
                str(out),
                "--seq-len",
                str(args.seq_len),
                "--n-layers",
                str(args.n_layers),
                nproc=cp,
            )
            if proc.returncode != 0:
                raise SystemExit(f"benchmarks.context_parallel (cp {cp}) exited with status {proc.returncode}")
            runs[str(cp)] = json.loads(out.read_text())["results"]
    return {"seq_len": args.seq_len, "n_layers": args.n_layers, "runs": runs}


def rows(results: dict[str, Any]) -> list[Row]:
    runs = results["runs"]
    first, last = runs[min(runs, key=int)], runs[max(runs, key=int)]
    split = runs[min((c for c in runs if int(c) > 1), key=int, default=max(runs, key=int))]  # the least CP > 1
    label = f"seq {results['seq_len']:,}, {results['n_layers']} blocks"
    return [
        Row(problem=PROBLEM, metric=f"activations saved per rank ({label})", unit="MiB",
            broken=f"CP {first['cp']}", broken_value=first["activation_bytes"] / MiB,
            fixed=f"CP {last['cp']}", fixed_value=last["activation_bytes"] / MiB),
        # Every rank gathers the whole window's keys and values, whatever cp: (cp - 1) / cp of them cross links.
        Row(problem=PROBLEM, metric=f"keys + values all-gathered per rank and step ({label})", unit="MiB",
            broken=f"CP {split['cp']}", broken_value=split["kv_gathered_bytes"] / MiB,
            fixed=f"CP {last['cp']}", fixed_value=last["kv_gathered_bytes"] / MiB),
    ]  # fmt: skip


def table(results: dict[str, Any]) -> str:
    if "runs" not in results:  # a launch of the loop
        return f"CP {results['cp']}: {results['activation_bytes'] / MiB:.2f} MiB saved"
    lines = [
        f"debug model, {results['n_layers']} blocks, one window of {results['seq_len']:,} tokens, fp32, no AC (rank 0)",
        f"{'CP':>3} {'saved MiB':>10} {'predicted':>10} {'K/V gathered MiB':>17} {'predicted':>10} {'K/V grads RS MiB':>17}",
    ]
    for r in results["runs"].values():
        p = r["predicted"]
        lines.append(
            f"{r['cp']:>3} {r['activation_bytes'] / MiB:>10.2f} {p['activation_bytes'] / MiB:>10.2f} "
            f"{r['kv_gathered_bytes'] / MiB:>17.2f} {p['kv_gathered_bytes'] / MiB:>10.2f} "
            f"{r['kv_grad_reduce_scattered_bytes'] / MiB:>17.2f}"
        )
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, default=8192, help="tokens of the window (a multiple of 2 x each CP degree)")
    p.add_argument("--n-layers", type=int, default=2, help="blocks of the debug model to keep")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4], help="CP degrees, one torchrun launch each")


def main(argv: list[str] | None = None) -> int:
    return harness.main("context_parallel", argv, doc=__doc__ or "", add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
