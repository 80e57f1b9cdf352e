"""Evaluate a checkpoint without training it: the held-out loss and perplexity, or downstream tasks.

torchrun --nproc_per_node=2 eval.py --checkpoint outputs/debug/checkpoint/step-100
torchrun --nproc_per_node=2 eval.py --checkpoint CKPT --validation.dataset_path=DATA --validation.steps=-1 \\
    --parallelism.tensor_parallel_degree=2
python eval.py --checkpoint HF_FOLDER --config configs/finetune_hf.toml --validation.dataset_path=DATA
python eval.py --checkpoint CKPT --tasks hellaswag,arc_easy --limit 100     # lm-evaluation-harness

--checkpoint is a DCP step folder written by train.py (any step, saved on any number of ranks and any layout;
the run's config.toml beside it is read unless --config is given) or a Hugging Face folder (then --config names
the data, tokenizer and layout; the shape comes from the folder's config.json). The other arguments are train.py's:
`--section.key=value` overrides of that config, the layout (`[parallelism]`) included, so a checkpoint trained
on 64 GPUs with FSDP is evaluated on 2 with TP. The held-out loss is `[validation]`'s, computed by the same
Validator (evaluation/validation.py) that train.py logs, over `validation.dataset_path` (raw or prepared) for
`validation.steps` global batches (-1: all of it once). Nothing is written; rank 0 prints one line.

A LoRA run's step is its base (the config's checkpoint.initial_load_path or model.hf_assets_path, or --base) with
the step's adapters merged into the weights once, in memory; --adapter PEFT_FOLDER merges a PEFT adapter into
--checkpoint (an HF folder or DCP step) alike: the model evaluated is a plain one.

--tasks runs EleutherAI's lm-evaluation-harness (`pip install -e ".[eval]"`) on the same checkpoint through
`lm_eval.simple_evaluate` and this repo's model (evaluation/adapter.py RecipeLM; generate_until through generate.py's
Generator), one process: a DCP checkpoint is scored without converting it.

--tasks ... --watch RUN_FOLDER scores every step folder of a run as it lands, in this launch's layout (under
torchrun as train.py's in-loop `[eval]` scores, evaluation/downstream.py), until the run's last step:

torchrun --nproc_per_node=2 eval.py --tasks stories_facts --include-path assets/eval_tasks --watch outputs/debug
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from config import env_world_size
from errors import ConfigError, RecipeError, is_rank0, report
from evaluation.watch import add_watch_arguments, check_watch
from inference import add_adapter_arguments

if TYPE_CHECKING:
    from evaluation.adapter import Continuations


def main(argv: list[str]) -> int:
    opts, overrides = parse_args(argv)
    if opts.watch:
        return watch(opts, overrides)
    if opts.tasks:
        return run_tasks(opts)
    loss, tokens, seconds, data = held_out_loss(opts.checkpoint, opts.config, overrides, adapter=opts.adapter,
                                                base=opts.base)  # fmt: skip
    if is_rank0():
        print(
            f"eval: {opts.checkpoint} | loss {loss:.4f} | perplexity {math.exp(loss):.3f} | {tokens:,} tokens of {data}"
            f" | {seconds:.1f} s",
            flush=True,
        )
    return 0


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This command's own options; the rest are train.py's config overrides."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--checkpoint", type=Path, help="a DCP step-<N> folder or a Hugging Face folder")
    parser.add_argument("--config", type=Path, help="the run's TOML (default: config.toml beside the step folders)")
    add_adapter_arguments(parser)  # (inference.py)
    parser.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated (instead of the held-out loss)")
    parser.add_argument("--include-path", help="a folder of lm-eval task YAMLs of your own")
    parser.add_argument("--limit", type=float, help="lm-eval: at most this many examples per task (or a fraction)")
    parser.add_argument("--num-fewshot", type=int, help="lm-eval: in-context examples per prompt")
    parser.add_argument("--batch-size", type=int, default=8, help="lm-eval: sequences per forward")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="lm-eval generate_until: at most this many")
    parser.add_argument(
        "--tokenizer", help="tokenizer folder (default: the run's model.tokenizer_path / the HF folder)"
    )
    add_watch_arguments(parser)  # (evaluation/watch.py)
    opts, overrides = parser.parse_known_args(argv)
    if opts.watch is not None:
        check_watch(opts)
        return opts, overrides
    if opts.checkpoint is None:
        raise ConfigError("--checkpoint: name a step-<N> folder or a Hugging Face folder to evaluate (or --watch RUN)")
    if not opts.checkpoint.is_dir():
        raise ConfigError(f"--checkpoint: {opts.checkpoint} is not a folder; point it at a step-<N> or HF folder")
    from checkpoint import refuse_folder_of_steps

    refuse_folder_of_steps(opts.checkpoint, key="--checkpoint")  # a run folder or its checkpoint folder, not a step
    return opts, overrides


def import_lm_eval() -> Any:
    """lm-eval, or one line saying how to install it (an optional extra)."""
    try:
        import lm_eval
    except ImportError:
        raise ConfigError('--tasks: lm-evaluation-harness is not installed; pip install -e ".[eval]"') from None
    return lm_eval


def run_tasks(opts: argparse.Namespace) -> int:
    """`eval.py --tasks`: lm_eval.simple_evaluate on the checkpoint, its table printed."""
    if (env_world_size() or 1) > 1:
        raise ConfigError("--tasks: lm-evaluation-harness runs in one process here; start eval.py with python")
    lm_eval = import_lm_eval()
    from lm_eval.utils import make_table

    from evaluation.adapter import RecipeLM
    from evaluation.tasks import (
        hub_offline_unless_it_answers,
        not_loaded,
        task_manager_for,
        uncached_hub_datasets,
        unreadable,
    )
    from inference import load_model

    tasks = [t.strip() for t in opts.tasks.split(",") if t.strip()]
    names = ", ".join(tasks)
    with hub_offline_unless_it_answers() as offline:
        # Said before lm-eval indexes its tasks and the model loads (seconds each), not after.
        if offline and uncached_hub_datasets(tasks, opts.include_path):
            raise unreadable(names, why=f"not cached here, and {offline}")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer_path = load_model(opts.checkpoint, config=opts.config, device=device, dtype=torch.float32,
                                           adapter=opts.adapter, base=opts.base)  # fmt: skip
        tokenizer_path = opts.tokenizer or tokenizer_path
        if tokenizer_path is None:
            raise ConfigError(f"--tokenizer: {opts.checkpoint} holds no tokenizer.json; name a tokenizer folder")
        lm = RecipeLM(model, tokenizer_path, batch_size=opts.batch_size, max_gen_toks=opts.max_new_tokens,
                      continuations=generator_of(model))  # fmt: skip
        manager = task_manager_for(tasks, opts.include_path)
        if unknown := [t for t in tasks if t not in manager.all_tasks]:
            raise ConfigError(f"--tasks: no lm-eval task named {', '.join(unknown)} (lm-eval --tasks list shows them)")
        try:
            results = lm_eval.simple_evaluate(
                model=lm, tasks=tasks, num_fewshot=opts.num_fewshot, limit=opts.limit, task_manager=manager
            )
        except (ConnectionError, OSError) as e:
            raise not_loaded(e, names, offline=offline, key="--tasks") from None
    print(make_table(results), flush=True)
    return 0


def generator_of(model: torch.nn.Module) -> Continuations:
    """generate.py's Generator as RecipeLM's generate_until continues a prompt (evaluation.adapter.Continuations):
    one Generator for the whole evaluation, so calls of one shape reuse its decode state."""
    from generate import Generator, Sampling

    generator = Generator(model)

    def continuations(prompt: list[int], max_new_tokens: int, temperature: float, stop_id: int) -> list[int]:
        (tokens,) = generator.generate([prompt], max_new_tokens=max_new_tokens, sampling=Sampling(temperature),
                                       stop_ids=[stop_id])  # fmt: skip
        return tokens

    return continuations


def config_args(checkpoint: Path, config: Path | None) -> list[str]:
    """train.py's arguments that load the checkpoint's run config and its model shape."""
    hf = (checkpoint / "config.json").is_file()
    if config is None and hf:
        raise ConfigError(
            f"--config: {checkpoint} is a Hugging Face folder; name the TOML with the data, tokenizer and layout "
            "to evaluate it with (e.g. configs/finetune_hf.toml)"
        )
    config = config or checkpoint.parent / "config.toml"
    if not config.is_file():
        raise ConfigError(
            f"--config: no config.toml beside {checkpoint} (train.py writes one when it checkpoints); pass the TOML "
            "it was trained with, --config FILE"
        )
    if not hf:
        return ["--config", str(config)]
    from models.hf import family_of_hf_config

    name = family_of_hf_config(checkpoint).name
    return ["--config", str(config), f"--model.name={name}", f"--model.hf_assets_path={checkpoint}",
            "--model.shape_from_hf_config"]  # fmt: skip


def held_out_loss(
    checkpoint: Path,
    config: Path | None,
    overrides: list[str],
    *,
    adapter: Path | None = None,
    base: Path | None = None,
) -> tuple[float, int, float, str]:
    """(loss, tokens, seconds, data path) of `[validation]` on the checkpoint's weights, with the config's layout
    (a LoRA step's base, or --checkpoint, with the adapters merged)."""
    from config import load_config, validation_path
    from data.tokenizers import build_tokenizer
    from evaluation.validation import Validator
    from inference import weights_and_adapters
    from models import family

    argv = [*config_args(checkpoint, config), *overrides]
    run = load_config(argv)
    weights = checkpoint
    weights, _, merges = weights_and_adapters(
        checkpoint, run, config=config or checkpoint.parent / "config.toml", fam=family(run.model.name),
        adapter=adapter, base=base,
    )  # fmt: skip
    argv += ["--validation.enable=true", "--checkpoint.enable=false"]
    if run.lora.enable:  # built without adapters: they are merged into the weights below
        argv.append("--lora.enable=false")
    with scoring_run(argv) as (cfg, dims, mesh, forward, args):
        if validation_path(cfg.validation) is None:
            raise ConfigError(
                "validation.dataset_path: name the held-out data to evaluate on (a file or prepared folder)"
            )
        load_weights(weights, forward.model, forward.pipeline, args=args, family_name=cfg.model.name)
        for adapters, s in merges:
            merge_into_parts(adapters, s, forward.model, forward.pipeline)
        tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        validator = Validator(cfg, tokenizer=tokenizer, dp_rank=dims.dp_rank(mesh), dp_degree=dims.dp, forward=forward)
        loss, tokens, seconds = validator.validate()
        dist.barrier()
        return loss, tokens, seconds, str(validation_path(cfg.validation))


@contextlib.contextmanager
def scoring_run(argv: list[str]) -> Iterator[tuple[Any, Any, Any, Any, Any]]:
    """(config, ParallelDims, mesh, ForwardBackward, model args) of train.py's arguments `argv`: the model built in
    the config's layout on the ranks of this launch, its weights initialized (the caller loads a checkpoint's), the
    process group torn down on the way out."""
    from config import ActivationCheckpoint, load_config, run_model_args
    from distributed import init_distributed
    from forward import ForwardBackward
    from loss import build_loss_fn
    from parallelisms.parallel_dims import ParallelDims, layout_checks, uses_loss_parallel
    from parallelisms.parallelize import build_model, init_model

    world = env_world_size() or 1
    cfg = load_config(argv, extra_checks=layout_checks(world))
    # No backward here: nothing to recompute (and mode "auto" plans training's memory, not this).
    cfg.activation_checkpoint = ActivationCheckpoint(mode="none")
    device, _, world_size = init_distributed(cfg.comm, dump_folder=cfg.job.dump_folder)
    try:
        dims = ParallelDims.from_config(cfg.parallelism, world_size=world_size)
        mesh = dims.build_mesh(device.type)
        args = run_model_args(cfg)
        vocab_shards = dims.tp if uses_loss_parallel(cfg, dims) else 1
        loss_fn = build_loss_fn(cfg.compile, chunk_tokens=cfg.training.loss_chunk_tokens, vocab_shards=vocab_shards)
        model, pipeline = build_model(cfg, args, dims=dims, mesh=mesh, loss_fn=loss_fn, device=device)
        init_model(model, pipeline, device=device)
        yield (
            cfg,
            dims,
            mesh,
            ForwardBackward.for_run(cfg, model, pipeline, loss_fn, dims=dims, mesh=mesh, device=device),
            args,
        )
    finally:
        dist.destroy_process_group()


def watch(opts: argparse.Namespace, overrides: list[str]) -> int:
    """`--tasks ... --watch RUN_FOLDER`: each step folder of the run scored as it lands (oldest first), in the
    layout of this launch (its own `[parallelism]` overrides; under torchrun as train.py's in-loop eval,
    evaluation/downstream.py), the scores appended to RUN_FOLDER/eval/watch-<tasks>.jsonl (evaluation/watch.py), a
    file of this command's own (train.py writes metrics.jsonl). A step already in it is skipped, so a restart goes on
    where it stopped; it ends once the run's last step (its training.steps) is scored, or on Ctrl-C, saying where it
    stopped."""
    import time

    from checkpoint.folder import complete_checkpoints
    from evaluation.downstream import build_downstream
    from evaluation.watch import scored_steps, write_watch_row

    # RUN_FOLDER: a run's job.dump_folder, or its checkpoint folder, where train.py writes the run's config.toml.
    given = opts.watch
    steps_here = (given / "config.toml").is_file()
    run = given.parent if steps_here else given
    config = opts.config or next(
        iter([given / "config.toml"] if steps_here else sorted(given.glob("*/config.toml"))), None
    )
    if config is None or not config.is_file():
        raise ConfigError(
            f"--watch: no config.toml in {given} or a folder in it (train.py writes one beside the run's checkpoints "
            "when it starts); point --watch at a run's job.dump_folder, or name its TOML with --config"
        )
    tasks = [t.strip() for t in opts.tasks.split(",") if t.strip()]
    argv = ["--config", str(config), *overrides, "--checkpoint.enable=false", "--validation.enable=false",
            "--eval.enable=true", f"--eval.tasks={','.join(tasks)}", f"--eval.batch_size={opts.batch_size}",
            *([f"--eval.include_path={opts.include_path}"] if opts.include_path else []),
            *([f"--eval.limit={opts.limit}"] if opts.limit is not None else [])]  # fmt: skip
    out = run / "eval" / f"watch-{'+'.join(tasks)}.jsonl"
    with scoring_run(argv) as (cfg, dims, mesh, forward, args):
        evaluator = build_downstream(
            cfg, forward=forward, mesh=mesh, dp_rank=dims.dp_rank(mesh), dp_degree=dims.dp, stop=None
        )
        evaluator.num_fewshot = opts.num_fewshot
        folder, last = given if steps_here else run / cfg.checkpoint.folder, cfg.training.steps
        done = scored_steps(out)
        try:
            while last not in done:
                # What rank 0 sees is what every rank scores: a step published between two ranks' listings
                # would otherwise be loaded by one and not the other.
                listed = [[(s, str(p)) for s, p in complete_checkpoints(folder) if s not in done]]
                dist.broadcast_object_list(listed, src=0)
                for step, path in listed[0]:
                    load_weights(Path(path), forward.model, forward.pipeline, args=args, family_name=cfg.model.name)
                    scores, documents, seconds = evaluator.evaluate()
                    if is_rank0():
                        write_watch_row(out, {"step": step, **scores, "eval_documents": documents, "eval_s": seconds})
                        said = " ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in scores.items())
                        print(f"eval: {path} | {said} | {documents:,} documents | {seconds:.1f} s", flush=True)
                    done.add(step)
                if last not in done:
                    time.sleep(opts.poll_seconds)
        except KeyboardInterrupt:
            if is_rank0():
                print(f"stopped: steps {sorted(done) or 'none'} scored in {out}; the same command goes on", flush=True)
            return 130
        if is_rank0():
            print(f"end: the run's last step, {last}, is scored; scores in {out}", flush=True)
    return 0


def merge_into_parts(adapters: dict[str, torch.Tensor], s: float, model: torch.nn.Module, pipeline: Any) -> None:
    """Adapters merged into the built (sharded) model, each pipeline stage taking those of its own linears."""
    from lora import merge_adapters

    merged = 0
    for part in pipeline.parts if pipeline else [model]:
        own = {n for n, _ in part.named_parameters()}
        merged += merge_adapters(part, {k: t for k, t in adapters.items() if f"{k.rsplit('.', 2)[0]}.weight" in own}, s)
    if merged * 2 != len(adapters):
        raise ConfigError(
            f"the adapters hold {len(adapters)} tensors, of which the model took {merged * 2}; is it an adapter of this model?"
        )


def load_weights(checkpoint: Path, model: torch.nn.Module, pipeline: Any, *, args: Any, family_name: str) -> None:
    """The checkpoint's weights into the built (sharded) model: DCP reshards, an HF folder is split as it is read."""
    from checkpoint import load_model_weights
    from models import family
    from models.hf import load_hf_weights

    for part in pipeline.parts if pipeline else [model]:
        if (checkpoint / "config.json").is_file():
            load_hf_weights(part, checkpoint, family(family_name), args)
        else:
            load_model_weights(checkpoint, part, key="--checkpoint")


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except RecipeError as e:
        sys.exit(report(e))
