"""This recipe and torchtitan 0.2.2's own Trainer, side by side: tokens/s, MFU (on a GPU) and peak memory per device.

    python -m benchmarks.vs_torchtitan --out outputs/bench/vs_torchtitan.json [--rounds 3] [--steps 8]
    python -m benchmarks.vs_torchtitan --shape busy --nproc 1 --layouts fsdp2_compile_auto fsdp2_compile_auto_vs_no_ac \
        fsdp2_compile_full_ac --rounds 2 --out X.json [--rehearse]          # make bench-gpu's

Both trainers read one TOML, torchtitan's own debug_model.toml (tests/torchtitan/), in a working
folder laid out as torchtitan's repository expects (tests/assets/tokenizer: the shipped tokenizer;
tests/assets/c4_test: the shipped corpus), with the same command-line overrides: the model shape,
optimizer, schedule, batch shapes, settings and data source are one file's. torchtitan runs
unchanged through tests/torchtitan_trainer.py (what it needs on CPU is said there). Layouts (LAYOUTS: the
overrides both get; fsdp2, tp2, the two compiled ones with op SAC and full AC, and moe_fsdp2 are the default, make
bench's):

    fsdp2                        FSDP 2 (AC on every 2nd block, as the TOML has it)
    tp2                          TP 2 with loss parallel
    fsdp2_compile_op_sac         FSDP 2 + compile + op SAC
    fsdp2_compile_full_ac        FSDP 2 + compile + full AC (--activation_checkpoint.mode=full, both trainers' key)
    fsdp2_compile_auto           FSDP 2 + compile; this recipe's auto AC against torchtitan's default, op SAC
    fsdp2_compile_auto_vs_no_ac  FSDP 2 + compile; this recipe's auto AC against torchtitan without AC
    moe_fsdp2                    FSDP 2 of Qwen3 MoE: this recipe's debugmodel (5.8M parameters, 3.4M active: 8 experts
                                 of 2 per token in each of 4 blocks) in both, as this recipe's qwen3_moe and torchtitan's
                                 qwen3 model (a flavor of its registry, MOE_FLAVOR), balancing off on both sides; the
                                 debug shape's only

The Qwen3 MoE layout gives each trainer its own name of the model (OWN_ARGS, MOE_MODEL); torchtitan computes its
experts with its grouped matmuls on a GPU (its default), and on CPU with its loop over experts, one matmul per
expert and projection, its only path there: its grouped matmuls pad each expert's rows with a Triton kernel, and cast
to bfloat16 whatever the parameters' dtype. This recipe's are grouped matmuls everywhere (models/qwen3_moe). From the
same weights and batches the two give the same losses (tests/test_torchtitan_moe.py); here, on 2 ranks, they read
their documents in different orders, as in the Llama layouts.

The auto AC layouts give each trainer its own setting (OWN_ARGS): this recipe's activation_checkpoint.mode = "auto"
(block by block the least recompute whose estimated peak fits activation_checkpoint.memory_budget_gib, by default
90% of the GPU's memory; on CPU ranks the harness gives it CPU_AC_BUDGET_GIB) has no torchtitan counterpart, so it
meets torchtitan's default and torchtitan's best layout that fits the busy shape on one GPU (no AC). What auto chose
is in the results (`recipe_ac_choice`, as train.py prints it). A trainer given the same overrides in two layouts of
a round (this recipe's auto run) runs once and counts in both (`schedule`): a compiled run at the busy shape is
about 30 s of a GPU's time.

Shapes (--shape):

    debug  the TOML's debugmodel (6M parameters). On CPU: 2 ranks, float32 (`--bf16`: the TOML's bf16, for the
           kernels of a bf16 step), seq_len 256, local batch 8. With CUDA
           the TOML's own bf16 and seq_len 2048, on 2 GPUs, or on 1 where the machine has one (`--nproc 1`). At this
           size both trainers wait on the host: the rows compare their Python and launch overheads.
    busy   Llama 3.1 8B's block (dim 4096, 32 heads, 8 key/value heads, SwiGLU 14336, vocabulary 128256, RoPE theta
           500000 with Llama 3.1 scaling) x --busy-layers (6), bf16, seq_len 4096, local batch 1, for one GPU: the
           GPU does the work (about 50 TFLOP a step, torchtitan's count), so the rows compare the kernels.
           This recipe reads the shape from a config.json the harness writes into the working folder
           (model.shape_from_hf_config, its way of taking a size that is no flavor); torchtitan from a flavor the
           harness registers in its own Llama 3 registry in torchtitan's process (tests/torchtitan_trainer.py,
           FLAVORS_ENV) and names with --model.flavor. `run` checks the flavor and size torchtitan's Trainer logs
           against this recipe's count. Both read the shipped 2048-token tokenizer: the ids stay below 2048, the
           embedding and output projection are the 8B's 128256 rows on both sides, so the FLOPs and memory are the
           8B shape's and the two trainers alike (the losses start near ln 128256 = 11.8).
           Layers, by memory (2,359,349,248 parameters at 6: 1,050.6M embedding + output, 218.1M a block): the fp32
           parameters, gradients and AdamW's two moments are 16 bytes a parameter, 35.2 GiB. On one rank both
           trainers apply no FSDP and train their fp32 weights under autocast; this recipe peaks at 35.2 GiB
           allocated, 36.7 GiB reserved under op SAC (planning/estimate_memory.py's model at 6 layers; 43.4 GiB at 8).
           torchtitan also keeps autocast's bf16 copies of every weight until its forward ends (2 bytes a
           parameter, 4.4 GiB), and its foreach AdamW allocates about 4 more bytes a parameter at the step: some
           45-50 GiB at 6 layers, 60 or more at 8, too near an H100's 78 GiB for a run that has one try. So 6.
    --rehearse  the same code paths on CPU, tiny: one round of 3 steps at seq_len 64, local batch 1, float32 (on a
           GPU bf16); busy becomes the same family of numbers at dim 64 (4 heads, 2 key/value heads, SwiGLU 256), 2
           blocks, the 8B's vocabulary, through the same config.json and torchtitan registration. MFU is n/a on CPU.

On one GPU (`--nproc 1`, TP 2 left out) neither trainer applies FSDP: both train under autocast (above;
parallelisms/fsdp.py applies_fsdp), the layout's label says "FSDP 1" all the same. A round runs both trainers once per layout,
which goes first alternating from round to round (a busy machine slows both alike); a run's tokens/s per device
and MFU are the medians of its steps after the first two (lazy initialization, compilation), its memory the
peak. A row: the median over rounds of each side, and the median and spread (min - max) of the
per-round ratio ours / torchtitan's. MFU is each trainer's own figure (torchtitan's step line; this recipe's
metrics.jsonl), on a GPU only: torchtitan divides by an A100's peak where it finds no GPU it knows. Both trainers
start through benchmarks/count_kernels.py, which
counts the kernels of one untimed step, GPU launches on a GPU (the same in every round): the ops an eager
step dispatches, or the launches of a compiled one. A compiled step is profiled, and says where its time goes (the
first round's, `recipe_profile` and `torchtitan_profile`): on a GPU each kernel's device time, on CPU the CPU time
of its launches; printed for each trainer by kind of kernel (attention, matmul, inductor's generated kernels, the
optimizer's, collectives, copies, other; those totals are rows too) and its top 15 kernels, with their calls and
share of the profiled step's wall time. The two trainers do not read their documents in the same
order (torchtitan packs a streamed dataset, this recipe reads windows of one token stream), so their
losses are close, not equal; both are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import statistics
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.count_kernels import COUNTED_STEP, KINDS
from benchmarks.harness import Row
from models import family
from tests.torchtitan_trainer import FLAVORS_ENV, MOE_FLAVOR, qwen3_moe_flavor, user_folder

PROBLEM = "vs torchtitan"
OP_SAC = ["--activation_checkpoint.selective_ac_option=op"]  # the TOML's mode is selective
AUTO_AC = ["--activation_checkpoint.mode=auto"]  # this recipe's; torchtitan has no such mode
LAYOUTS = {  # the overrides both trainers get
    "fsdp2": [],
    "tp2": ["--parallelism.tensor_parallel_degree=2"],
    "fsdp2_compile_op_sac": ["--compile.enable", *OP_SAC],
    "fsdp2_compile_full_ac": ["--compile.enable", "--activation_checkpoint.mode=full"],
    "fsdp2_compile_auto": ["--compile.enable"],
    "fsdp2_compile_auto_vs_no_ac": ["--compile.enable"],
    "moe_fsdp2": [],
}
# Qwen3 MoE: this recipe's debugmodel (8 experts, 2 per token) in both trainers, torchtitan's qwen3 model taking it as
# a flavor registered under MOE_FLAVOR (tests/torchtitan_trainer.py, FLAVORS_ENV); no balancing on either side (this
# recipe's load-balancing loss off, torchtitan's load_balance_coeff None).
MOE_MODEL = {
    "recipe": ["--model.name=qwen3_moe", "--model.flavor=debugmodel", "--model.moe.router_aux_loss_coef=0"],
    "torchtitan": ["--model.name=qwen3", f"--model.flavor={MOE_FLAVOR}"],
}
# What one trainer gets on top in a layout: this recipe's auto AC against torchtitan's default (op SAC) and against
# its best layout that fits (no AC, at the busy shape on one GPU); each trainer's name of the MoE model.
OWN_ARGS = {
    "fsdp2_compile_auto": {"recipe": AUTO_AC, "torchtitan": OP_SAC},
    "fsdp2_compile_auto_vs_no_ac": {"recipe": AUTO_AC, "torchtitan": ["--activation_checkpoint.mode=none"]},
    "moe_fsdp2": MOE_MODEL,
}
LABELS = {  # n: ranks
    "fsdp2": "FSDP {n}", "tp2": "TP 2", "fsdp2_compile_op_sac": "FSDP {n} + compile + op SAC",
    "fsdp2_compile_full_ac": "FSDP {n} + compile + full AC",
    "fsdp2_compile_auto": "FSDP {n} + compile, auto AC vs torchtitan's op SAC",
    "fsdp2_compile_auto_vs_no_ac": "FSDP {n} + compile, auto AC vs torchtitan's no AC",
    "moe_fsdp2": "Qwen3 MoE, FSDP {n}",
}  # fmt: skip
DEFAULT_LAYOUTS = ["fsdp2", "tp2", "fsdp2_compile_op_sac", "fsdp2_compile_full_ac", "moe_fsdp2"]  # make bench's, on CPU
NEEDS_RANKS = {"tp2": 2}
OWN_MODEL = {"moe_fsdp2"}  # layouts that name their model: the debug shape's only
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TITAN_STEP = re.compile(
    r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%"
)
_TITAN_MODEL = re.compile(r"Model llama3 (\S+) size: ([\d,]+) total parameters")
_AUTO_CHOICE = re.compile(r"activation_checkpoint\.mode = auto: (.+)")  # train.py's line (resolve_auto_ac)
_ESTIMATED_PEAK = re.compile(r"estimated peak ([\d.]+) GiB")  # in that line (planning.memory.ACChoice.describe)
BUSY_LAYERS = 6  # Llama 3 8B blocks on one H100 (module docstring: the memory arithmetic)
BUSY_SEQ_LEN, BUSY_LOCAL_BATCH = 4096, 1
BUSY_FOLDER = "busy-model"  # in the working folder: the busy shape's config.json, this recipe's hf_assets_path
REHEARSAL = {"rounds": 1, "steps": 3, "seq_len": 64, "local_batch": 1}
# auto AC's activation_checkpoint.memory_budget_gib on CPU ranks (with a GPU its default: 90% of the GPU's memory).
# Large: auto keeps every block's activations. At the rehearsal's shape no budget between two choices exists: the
# activations are too small a part of the peak to move its estimate.
CPU_AC_BUDGET_GIB = 64.0


def busy_model(layers: int = BUSY_LAYERS, *, tiny: bool = False) -> Any:
    """This recipe's ModelArgs of the busy shape: Llama 3.1 8B's block (llama3_8b: dim 4096, 32 heads, 8 key/value
    heads, SwiGLU 14336, vocabulary 128256, RoPE theta 500000 with Llama 3.1 scaling), `layers` of them; `tiny`
    (--rehearse): the same family of numbers at dim 64 (4 heads, 2 key/value heads, SwiGLU 256), 2 layers, and the
    8B's vocabulary."""
    from models.llama3.model import FLAVORS

    eight_b = FLAVORS["llama3_8b"]
    if tiny:
        return dataclasses.replace(eight_b, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=64)
    return dataclasses.replace(eight_b, n_layers=layers)


def torchtitan_flavor(args: Any) -> dict[str, Any]:
    """The fields of torchtitan 0.2.2's TransformerModelArgs for this recipe's Llama 3 `args` (JSON), the same
    model: torchtitan sizes the SwiGLU from ffn_dim_multiplier and multiple_of as models/llama3 does, and always
    scales RoPE the Llama 3.1 way (RoPEScalingArgs); it has no tied embeddings and no size override."""
    if args.tie_word_embeddings or args.hidden_dim_override is not None or args.rope_scaling is None:
        raise ValueError(f"torchtitan's Llama 3 cannot build {args}")
    s = args.rope_scaling
    return {
        "dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.kv_heads,
        "vocab_size": args.vocab_size, "multiple_of": args.multiple_of, "ffn_dim_multiplier": args.ffn_dim_multiplier,
        "norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling_args": {
            "scaling_factor": s.factor, "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        },
    }  # fmt: skip


def flavor_name(args: Any) -> str:
    """The name the busy shape is registered under in torchtitan's Llama 3 flavors."""
    return f"vs_recipe_{args.dim}d_{args.n_layers}l"


@dataclass(frozen=True)
class Shape:
    """What both trainers train beyond the TOML: its model (None: the TOML's debugmodel) and batch shapes."""

    name: str  # debug | busy
    model: Any = None  # this recipe's ModelArgs (busy)
    seq_len: int | None = None  # None: the TOML's
    local_batch: int | None = None
    float32: bool = False  # on CPU: float32 parameters (bf16 matmuls there are slow)
    ac_budget_gib: float | None = None  # auto AC's budget without a CUDA device (None: its default, from the GPU's)
    grouped_mm: bool = False  # torchtitan's MoE experts as its grouped matmuls (a GPU's), else its loop over experts

    def args(self, trainer: str) -> list[str]:
        out = [f"--training.seq_len={self.seq_len}"] if self.seq_len else []
        out += [f"--training.local_batch_size={self.local_batch}"] if self.local_batch else []
        out += ["--training.mixed_precision_param=float32"] if self.float32 else []
        if self.model is not None and trainer == "recipe":  # the shape from a config.json, the TOML's tokenizer
            out += [f"--model.hf_assets_path={BUSY_FOLDER}", "--model.shape_from_hf_config",
                    "--model.tokenizer_path=tests/assets/tokenizer"]  # fmt: skip
        elif self.model is not None:  # the flavor registered in torchtitan's registry (FLAVORS_ENV)
            out.append(f"--model.flavor={flavor_name(self.model)}")
        return out

    def env(self) -> dict[str, str]:
        """The environment of torchtitan's process: the busy shape as a flavor of its Llama 3 registry, this recipe's
        Qwen3 MoE debugmodel as one of its qwen3 registry (MOE_FLAVOR), with torchtitan's grouped-matmul experts where
        they run (a GPU: they pad each expert's rows with a Triton kernel) and its loop over experts elsewhere."""
        moe = qwen3_moe_flavor(family("qwen3_moe").flavors["debugmodel"], grouped_mm=self.grouped_mm)
        flavors: dict[str, Any] = {"qwen3": {MOE_FLAVOR: moe}}
        if self.model is not None:
            flavors["llama3"] = {flavor_name(self.model): torchtitan_flavor(self.model)}
        return {FLAVORS_ENV: json.dumps(flavors)}

    def prepare(self, folder: Path) -> None:
        """The busy shape's config.json in `folder`, for this recipe (model.shape_from_hf_config)."""
        if self.model is not None:
            from models.hf import hf_config

            (folder / BUSY_FOLDER).mkdir(exist_ok=True)
            config = hf_config(family("llama3"), self.model, dtype=torch.bfloat16)
            (folder / BUSY_FOLDER / "config.json").write_text(json.dumps(config, indent=1))

    def describe(self) -> str:
        if self.model is None:
            return "debugmodel (the TOML's)"
        m = self.model
        return (
            f"Llama 3 8B block x {m.n_layers} (dim {m.dim}, {m.n_heads} heads, {m.kv_heads} kv heads, ffn "
            f"{m.hidden_dim}, vocab {m.vocab_size})"
        )


def shape_of(name: str, *, cuda: bool, rehearse: bool, layers: int = BUSY_LAYERS, bf16: bool = False) -> Shape:
    """debug: the TOML's model, and on CPU seq_len 256 in float32 (a GPU: the TOML's bf16, seq_len 2048 and batch 8).
    busy: `busy_model`, seq_len 4096, local batch 1 in bf16. rehearse: the same code paths at seq_len 64, batch 1, the
    busy model `tiny`. bf16: the TOML's bf16 parameters on CPU too (slow there; for the kernels of a bf16 step)."""
    model = busy_model(layers, tiny=rehearse) if name == "busy" else None
    float32 = not (cuda or bf16)
    budget = None if cuda else CPU_AC_BUDGET_GIB
    if rehearse:
        return Shape(name, model, REHEARSAL["seq_len"], REHEARSAL["local_batch"], float32=float32, ac_budget_gib=budget,
                     grouped_mm=cuda)  # fmt: skip
    if name == "busy":
        return Shape(
            name, model, BUSY_SEQ_LEN, BUSY_LOCAL_BATCH, float32=float32, ac_budget_gib=budget, grouped_mm=cuda
        )
    return Shape(name, grouped_mm=True) if cuda else Shape(name, seq_len=256, float32=float32, ac_budget_gib=budget)


def dump_folder(folder: Path, trainer: str, layout: str) -> Path:
    return folder / "outputs" / f"{trainer}-{layout}"


def layout_args(layout: str, trainer: str) -> list[str]:
    """The overrides of `layout` for `trainer`: those both get (LAYOUTS), then its own (OWN_ARGS)."""
    return [*LAYOUTS[layout], *OWN_ARGS.get(layout, {}).get(trainer, [])]


def trainer_args(trainer: str, layout: str, *, folder: Path, steps: int, shape: Shape) -> list[str]:
    """The command-line arguments `trainer` gets in `folder` (user_folder): the TOML, the overrides both trainers get,
    and its own in a layout that gives each its own (auto AC: with the shape's budget where there is no GPU)."""
    dump = dump_folder(folder, trainer, layout)
    shutil.rmtree(dump, ignore_errors=True)
    overrides = layout_args(layout, trainer)
    args = ["--job.config_file", "debug_model.toml", f"--training.steps={steps}", "--metrics.log_freq=1",
            f"--job.dump_folder={dump}", *shape.args(trainer), *overrides]  # fmt: skip
    if trainer == "recipe":
        args.append(f"--data.cache_folder={folder / 'token-cache'}")  # this recipe's key: raw data prepared once
        if AUTO_AC[0] in overrides and shape.ac_budget_gib is not None:
            args.append(f"--activation_checkpoint.memory_budget_gib={shape.ac_budget_gib:g}")
    return args


def schedule(layouts: list[str], rounds: int) -> list[tuple[int, str, str, str | None]]:
    """The runs of a measurement in order, as (round, layout, trainer, same_as): each round runs both trainers in every
    layout, which one first alternating from round to round; a trainer whose overrides in a layout are those of an
    earlier layout of the round (this recipe's auto AC against two settings of torchtitan's) runs once, and `same_as`
    names the layout whose run it shares (None: a run of its own)."""
    out = []
    for round_ in range(rounds):
        first: dict[tuple[str, ...], str] = {}  # (trainer, *overrides) -> the round's layout that ran it
        for layout in layouts:
            for trainer in ["recipe", "torchtitan"] if round_ % 2 == 0 else ["torchtitan", "recipe"]:
                key = (trainer, *layout_args(layout, trainer))
                out.append((round_, layout, trainer, first.get(key)))
                first.setdefault(key, layout)
    return out


def compiled(layout: str) -> bool:
    return "--compile.enable" in LAYOUTS[layout]


def step_kind(layout: str) -> str:
    return "compiled" if compiled(layout) else "eager"


def label(layout: str, nproc: int) -> str:
    return LABELS[layout].format(n=nproc)


def run(trainer: str, layout: str, *, folder: Path, steps: int, shape: Shape, cuda: bool, nproc: int) -> dict[str, Any]:
    """One run of `trainer` ("recipe" or "torchtitan"): tokens/s per device, MFU (on a GPU), peak memory, losses by
    step."""
    args = trainer_args(trainer, layout, folder=folder, steps=steps, shape=shape)
    dump = dump_folder(folder, trainer, layout)
    kernels = folder / f"kernels-{trainer}-{layout}.json"
    entry = ["-m", "benchmarks.count_kernels", trainer, str(kernels)]  # one step's kernels, outside the timed steps
    env = shape.env() if trainer == "torchtitan" else {}
    proc = harness.run_python(*entry, *args, nproc=nproc, capture=True, cwd=folder, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{trainer} ({layout}) exited with status {proc.returncode}:\n{proc.stderr[-4000:]}")
    # step: (loss, tokens/s, memory GiB, MFU %)
    ac_choice = None  # what this recipe's auto AC chose, as train.py printed it
    if trainer == "recipe":
        rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
        steps_ = {r["step"]: (r["loss"], r["tps"], r["memory_gib"], r.get("mfu")) for r in rows if "tps" in r}
        if choice := _AUTO_CHOICE.search(_ANSI.sub("", proc.stdout + proc.stderr)):
            ac_choice = choice[1].strip()
    else:  # every rank logs; the first line of each step is kept
        steps_ = {}
        log = _ANSI.sub("", proc.stdout + proc.stderr)
        for m in _TITAN_STEP.finditer(log):
            steps_.setdefault(int(m[1]), (float(m[2]), float(m[4].replace(",", "")), float(m[3]), float(m[5])))
        if shape.model is not None:  # the registered flavor reached torchtitan's Trainer: its model, its size
            built = _TITAN_MODEL.search(log)
            expected = (flavor_name(shape.model), family("llama3").num_params(shape.model))
            if built is None or (built[1], int(built[2].replace(",", ""))) != expected:
                found = built and (built[1], int(built[2].replace(",", "")))
                raise SystemExit(f"torchtitan ({layout}) built {found}, not the busy shape {expected}")
    if sorted(steps_) != list(range(1, steps + 1)):
        raise SystemExit(f"{trainer} ({layout}): expected steps 1..{steps} in its log, found {sorted(steps_)}")
    warm = [steps_[s] for s in range(3, steps + 1)]
    mfus = [mfu for *_, mfu in warm if mfu is not None]
    return {
        "tps": statistics.median(t for _, t, _, _ in warm),
        # torchtitan divides by an A100's peak where it finds no GPU it knows: MFU is a GPU's figure only.
        "mfu": statistics.median(mfus) if cuda and mfus else None,
        "memory_gib": max(m for _, _, m, _ in warm),
        "losses": [steps_[s][0] for s in range(1, steps + 1)],
        "kernels": json.loads(kernels.read_text()) if kernels.exists() else None,
        "ac_choice": ac_choice,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    nproc = args.nproc or (min(2, torch.cuda.device_count()) if cuda else 2)
    if args.shape == "busy" and not cuda and not args.rehearse:
        raise SystemExit(
            "--shape busy is a GPU's run: Llama 3 8B blocks at seq_len 4096 (35 GiB of fp32 state and AdamW moments "
            "at 6 layers) would take hours on CPU ranks and found no GPU here; add --rehearse for its code paths, tiny"
        )
    rounds, steps = (REHEARSAL["rounds"], REHEARSAL["steps"]) if args.rehearse else (args.rounds, args.steps)
    shape = shape_of(args.shape, cuda=cuda, rehearse=args.rehearse, layers=args.busy_layers, bf16=args.bf16)
    layouts = [layout for layout in args.layouts if NEEDS_RANKS.get(layout, 1) <= nproc]
    for layout in sorted(set(args.layouts) - set(layouts)):
        print(f"{layout}: left out, it needs {NEEDS_RANKS[layout]} ranks and this run has {nproc}", flush=True)
    if shape.model is not None and (own := [layout for layout in layouts if layout in OWN_MODEL]):
        layouts = [layout for layout in layouts if layout not in own]
        print(f"{', '.join(own)}: left out, a layout with its own model is the debug shape's", flush=True)
    if not cuda:
        dtype = "float32" if shape.float32 else "bfloat16 parameters (--bf16)"
        print(f"no GPU: {dtype} on CPU ranks, MFU not measured (n/a)", flush=True)
    print(f"model: {shape.describe()}, seq_len {shape.seq_len or 'as the TOML has it'}", flush=True)
    with tempfile.TemporaryDirectory(prefix="vs-torchtitan-") as tmp:
        folder = user_folder(Path(tmp))
        shape.prepare(folder)
        runs: dict[str, dict[str, list]] = {layout: {"recipe": [], "torchtitan": []} for layout in layouts}
        for round_, layout, trainer, same_as in schedule(layouts, rounds):
            if same_as is None:
                result = run(trainer, layout, folder=folder, steps=steps, shape=shape, cuda=cuda, nproc=nproc)
            else:  # the same arguments as in an earlier layout of this round: its run
                result = runs[same_as][trainer][-1]
            runs[layout][trainer].append(result)
            shared = f" ({same_as}'s run)" if same_as else ""
            print(f"round {round_ + 1} {layout} {trainer}: {result['tps']:,.0f} tokens/s{shared}", flush=True)
    results: dict[str, Any] = {
        "device": "cuda" if cuda else "cpu", "nproc": nproc, "rounds": rounds, "steps": steps,
        "shape": shape.name, "model": shape.describe(), "seq_len": shape.seq_len, "local_batch": shape.local_batch,
        "rehearsal": args.rehearse,
    }  # fmt: skip
    for layout, sides in runs.items():
        results[layout] = compare(layout, sides)
    return results


def compare(layout: str, sides: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """A layout's result from its runs ({"recipe": [run per round], "torchtitan": [...]}, each as `run` returns it):
    the medians of each side, the per-round ratios, the first round's losses, kernels and profile (the same in every
    round but for the profile's times), what each trainer got of its own and what auto AC chose."""
    ratios = [ours["tps"] / theirs["tps"] for ours, theirs in zip(sides["recipe"], sides["torchtitan"], strict=True)]
    result = {
        **{f"{side}_tps": statistics.median(r["tps"] for r in rs) for side, rs in sides.items()},
        **{f"{side}_memory_gib": statistics.median(r["memory_gib"] for r in rs) for side, rs in sides.items()},
        **{f"{side}_mfu": _median_or_none([r["mfu"] for r in rs]) for side, rs in sides.items()},
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        **{f"{side}_losses": rs[0]["losses"] for side, rs in sides.items()},
    }  # fmt: skip
    if layout in OWN_ARGS:
        result["own_args"] = OWN_ARGS[layout]
    if choice := sides["recipe"][0].get("ac_choice"):
        result["recipe_ac_choice"] = choice
    ours, theirs = sides["recipe"][0]["kernels"], sides["torchtitan"][0]["kernels"]
    if ours and theirs:
        mine, peer = Counter(ours["by_op"]), Counter(theirs["by_op"])
        result |= {
            "recipe_kernels": ours["kernels"], "torchtitan_kernels": theirs["kernels"],
            "kernels_more_here": dict((mine - peer).most_common()), "kernels_fewer_here": dict((peer - mine).most_common()),
        }  # fmt: skip
        if "profile" in ours and "profile" in theirs:
            result |= {"recipe_profile": ours["profile"], "torchtitan_profile": theirs["profile"]}
    return result


def _median_or_none(values: list[float | None]) -> float | None:
    return statistics.median(values) if values and None not in values else None


def measured(results: dict[str, Any]) -> list[str]:
    """The layouts of `results`, in the order they ran (--layouts)."""
    return [key for key in results if key in LAYOUTS]


def rows(results: dict[str, Any]) -> list[Row]:
    def row(metric: str, unit: str, key: str) -> Row:
        return Row(PROBLEM, metric, unit, "torchtitan 0.2.2", r[f"torchtitan_{key}"], "this recipe", r[f"recipe_{key}"])

    out = []
    for layout in measured(results):
        r, name = results[layout], label(layout, results["nproc"])
        # The ratio column divides the two medians; the per-round ratios (each run against the one beside it)
        # are the comparison, and the metric carries their median and spread.
        paired = f"per round {r['ratio']:.3f}x ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})"
        out.append(row(f"tokens/s per device, {name}; {paired}", "tok/s", "tps"))
        if "recipe_kernels" in r:
            what = "launches but views" if compiled(layout) else "ops dispatched but views"
            out.append(
                row(f"kernels per {step_kind(layout)} step ({what}, step {COUNTED_STEP}), {name}", "ops", "kernels")
            )
        if r.get("recipe_mfu") is not None and r.get("torchtitan_mfu") is not None:
            out.append(row(f"MFU, {name}", "%", "mfu"))
        out.append(row(f"peak memory per device, {name}", "GiB", "memory_gib"))
        if (choice := r.get("recipe_ac_choice")) and (estimated := _ESTIMATED_PEAK.search(choice)):
            # The estimate auto chose by (planning/memory.py: the reserved peak plus CUDA context and NCCL, on a GPU)
            # beside the peak this recipe's run measured (max reserved; on CPU the process's RSS): its error.
            metric = f"auto AC's estimated peak (reserved + context) vs the measured peak (reserved), {name}"
            out.append(Row(PROBLEM, metric, "GiB", "estimate", float(estimated[1]), "measured", r["recipe_memory_gib"]))
        if "recipe_profile" in r:
            ours, theirs = r["recipe_profile"], r["torchtitan_profile"]
            what = f"{'GPU' if ours['device'] == 'cuda' else 'CPU'} time in the profiled step {COUNTED_STEP}"
            spent = {"all": (theirs["kernels_ms"], ours["kernels_ms"])} | {
                kind: (theirs["by_kind"].get(kind, 0.0), ours["by_kind"].get(kind, 0.0)) for kind in kinds(ours, theirs)
            }
            for kind, (titans, recipes) in spent.items():
                metric = f"{what}, {kind} kernels, {name}"
                out.append(Row(PROBLEM, metric, "ms", "torchtitan 0.2.2", titans, "this recipe", recipes))
    return out


def kinds(*profiles: dict[str, Any]) -> list[str]:
    """The kinds of kernel (count_kernels.KINDS, then "other") that any of `profiles` spent time in, in that order."""
    order = [*(kind for kind, _ in KINDS), "other"]
    return [kind for kind in order if any(p["by_kind"].get(kind) for p in profiles)]


def table(results: dict[str, Any]) -> str:
    lines = [
        f"this recipe vs torchtitan 0.2.2 ({results['device']}, {results['nproc']} ranks, {results['rounds']} rounds, "
        f"alternated; {results.get('model', 'debugmodel')}"
        f"{', seq_len ' + str(results['seq_len']) if results.get('seq_len') else ''}"
        f"{'; a rehearsal' if results.get('rehearsal') else ''}):"
    ]
    width = max((len(label(layout, results["nproc"])) for layout in measured(results)), default=0)
    for layout in measured(results):
        r, name = results[layout], label(layout, results["nproc"])
        lines.append(
            f"  {name:<{width}} tokens/s {r['recipe_tps']:>9,.0f} vs {r['torchtitan_tps']:>9,.0f}  ratio {r['ratio']:.3f}x "
            f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f})  memory {r['recipe_memory_gib']:.2f} vs "
            f"{r['torchtitan_memory_gib']:.2f} GiB  MFU {_percent(r.get('recipe_mfu'))} vs "
            f"{_percent(r.get('torchtitan_mfu'))}  losses {r['recipe_losses'][-1]:.4f} vs {r['torchtitan_losses'][-1]:.4f}"
        )
        if "recipe_kernels" in r:
            more = ", ".join(f"{op} +{n}" for op, n in r["kernels_more_here"].items())
            fewer = ", ".join(f"{op} -{n}" for op, n in r["kernels_fewer_here"].items())
            lines.append(
                f"  {'':<{width}} kernels per {step_kind(layout)} step {r['recipe_kernels']} vs {r['torchtitan_kernels']}: "
                f"{'; '.join(part for part in (more, fewer) if part) or 'the same ops'}"
            )
        if choice := r.get("recipe_ac_choice"):
            lines.append(f"  {'':<{width}} this recipe's auto AC: {choice}")
    for layout in measured(results):
        if "recipe_profile" in (r := results[layout]):
            lines += ["", *time_table(label(layout, results["nproc"]), r["recipe_profile"], r["torchtitan_profile"])]
    return "\n".join(lines)


def time_table(name: str, ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The profiled step of each trainer (benchmarks/count_kernels.py): its time by kind of kernel side by side, then
    each trainer's top kernels by total time."""
    what = "GPU time of its kernels" if ours["device"] == "cuda" else "CPU time of its launches"
    lines = [
        f"where the time goes, {name}: the profiled step {COUNTED_STEP} (untimed), {what}, ms and share of the step's "
        f"wall time ({ours['step_ms']:,.1f} vs {theirs['step_ms']:,.1f} ms under the profiler)",
        f"  {'':<12} {'this recipe':>18} {'torchtitan':>18}",
    ]
    for kind, key in [*((k, k) for k in kinds(ours, theirs)), ("all kernels", None)]:
        cells = []
        for p in (ours, theirs):
            ms = p["kernels_ms"] if key is None else p["by_kind"].get(key, 0.0)
            cells.append(f"{ms:>9,.1f} {ms / p['step_ms']:>7.1%}")
        lines.append(f"  {kind:<12} {cells[0]:>18} {cells[1]:>18}")
    for side, p in (("this recipe", ours), ("torchtitan", theirs)):
        lines += [f"  {side}'s top {len(p['top'])} by time:", f"    {'ms':>9} {'share':>7} {'calls':>6}  kernel"]
        lines += [f"    {k['ms']:>9,.2f} {k['share']:>7.1%} {k['count']:>6}  {_short(k['name'])}" for k in p["top"]]
    return lines


def _short(name: str, width: int = 100) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}%"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="runs of each trainer per layout, alternated")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the first two are not timed)")
    parser.add_argument(
        "--layouts", nargs="+", default=DEFAULT_LAYOUTS, choices=list(LAYOUTS),
        help=f"default: {' '.join(DEFAULT_LAYOUTS)} (the auto AC ones are the GPU run's, benchmarks/gpu_run.py)",
    )  # fmt: skip
    parser.add_argument(
        "--nproc", type=int, choices=(1, 2), help="ranks per run (default: 2, or 1 on a machine with one GPU)"
    )
    parser.add_argument(
        "--shape", choices=("debug", "busy"), default="debug",
        help="debug: the TOML's 6M-parameter model; busy: Llama 3 8B's block x --busy-layers, seq_len 4096",
    )  # fmt: skip
    parser.add_argument("--busy-layers", type=int, default=BUSY_LAYERS, help="blocks of the busy shape")
    parser.add_argument(
        "--bf16", action="store_true", help="on CPU too, the TOML's bf16 parameters (slow there): a bf16 step's kernels"
    )
    parser.add_argument(
        "--rehearse", action="store_true",
        help=f"the same code paths, tiny: seq_len {REHEARSAL['seq_len']}, {REHEARSAL['rounds']} round of "
        f"{REHEARSAL['steps']} steps, the busy shape at dim 64 x 2 layers (a CPU check of a GPU run)",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return harness.main("vs_torchtitan", argv, doc=__doc__ or "", add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
