"""Downstream scores while it trains (`[eval]`): lm-evaluation-harness tasks scored on the live model, in the layout
that trains it, every `eval.interval` steps and after the last one.

    [eval]
    enable = true
    tasks = ["stories_facts"]            # or --eval.tasks=hellaswag,arc_easy
    include_path = "assets/eval_tasks"   # task YAMLs of your own
    interval = 50

The scores are lm-eval's own: every rank runs `lm_eval.simple_evaluate` over the same requests with the model
adapter of `eval.py --tasks` (adapter.py RecipeLM), whose log-likelihoods come from `ShardedScores` here:
the requests are split over the data-parallel ranks, each rank scores its share through the sharded model
(`ForwardBackward.score_tokens`: FSDP and TP tested, CP and EP compared by hand, HSDP and compile not run), and one all-reduce gives every rank every request's
score; lm-eval aggregates them on rank 0, which logs `eval/<task>/<metric>` where the other metrics go
(console, metrics.jsonl, TensorBoard, wandb). They equal `eval.py --tasks` on the step's checkpoint and lm-eval's
own `hf` backend on the step exported to Hugging Face (tests/test_downstream.py).

What it leaves alone: the model returns to training mode with nothing changed (no gradient, no RNG draw: lm-eval
seeds Python's, NumPy's and torch's generators, and they are restored afterwards), the data loader is not read, the
eval's time is left out of tokens/s and the ETA. Log-likelihood tasks only (multiple choice, perplexity): a
generation's length differs from rank to rank, where FSDP and TP need every rank in every forward; eval.py scores
them. Not under pipeline parallel (the schedule carries a loss, not per-request scores): config/sections.py Eval
refuses it and points at `eval.py --watch` (watch.py), which scores a run's checkpoints beside it.

Stop requests are agreed between eval batches: a request during an eval abandons it (nothing logged) and the
run saves the step as it would have; the resumed run scores that step first, before training on (its checkpoint
holds the same weights), so a score is neither lost nor logged twice. A task that cannot run (an unknown name, data
that is not there, a hub that does not answer) is refused in one line at start-up, before the first step.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from errors import ConfigError

if TYPE_CHECKING:
    from config import Eval
    from fleet.stop import StopRequest
    from forward import ForwardBackward


class Interrupted(Exception):
    """A stop request came during an eval: the eval is abandoned, the run stops as after any step."""


class ShardedScores:
    """lm-eval's log-likelihood requests (adapter.Scores) over the data-parallel ranks of a run.

    Every rank of the job is called with the same requests (lm-eval builds them alike everywhere) and runs the same
    number of forwards: the requests, longest first, in global batches of `batch_size` x dp_degree, rank r taking
    rows r x batch_size onward of each (a rank with none left runs a row of padding: FSDP, TP and EP need every rank
    in every forward). The ranks of a TP group score the same rows alike, those of a CP group parts of each row.
    Each row is padded on the right to a multiple of `multiple` (context and sequence parallel split it); compiled,
    widths are powers of two and every batch `batch_size` rows, so that few shapes reach the compiler."""

    def __init__(
        self,
        forward: ForwardBackward,
        *,
        dp_rank: int,
        dp_degree: int,
        reports: bool,
        batch_size: int,
        multiple: int = 8,
        compiled: bool = False,
        stop: StopRequest | None = None,
    ):
        self.forward, self.dp_rank, self.dp_degree = forward, dp_rank, dp_degree
        self.reports = reports  # this rank's rows go into the sum: TP rank 0 of its group (every CP rank: parts)
        self.batch_size, self.multiple, self.compiled, self.stop = batch_size, multiple, compiled, stop
        self.forwards = self.requests = 0  # forwards run and requests scored so far, for the cost of each

    def __call__(self, sequences: list[list[int]], continuations: list[int]) -> list[tuple[float, bool]]:
        self.requests += len(sequences)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        per_batch = self.batch_size * self.dp_degree
        totals = torch.zeros(len(sequences), 2, dtype=torch.float64, device=self.forward.device)
        with self.forward.scoring():
            for start in range(0, len(order), per_batch):
                if self.stop is not None and self.stop.requested():  # (a collective: every rank asks here)
                    raise Interrupted
                first = start + self.dp_rank * self.batch_size
                mine = order[first : min(first + self.batch_size, start + per_batch)]
                scored = self.forward.score_tokens(*self._batch([sequences[i] for i in mine], continuations, mine))
                self.forwards += 1
                if self.reports and mine:
                    totals[mine] = scored[: len(mine)].double()
        dist.all_reduce(totals)  # each request's row from the ranks that scored it; zeros elsewhere
        return [(logprob, missed == 0) for logprob, missed in totals.tolist()]

    def _batch(
        self, rows: list[list[int]], continuations: list[int], indices: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, targets, counted) of a batch: each sequence but its last token read, its continuation counted."""
        longest = max((len(r) - 1 for r in rows), default=1)
        width = -(-longest // self.multiple) * self.multiple
        if self.compiled:
            width = max(self.multiple, 2 ** math.ceil(math.log2(width)))
        height = self.batch_size if self.compiled else max(len(rows), 1)
        inputs = torch.zeros(height, width, dtype=torch.long)
        targets = torch.zeros(height, width, dtype=torch.long)
        counted = torch.zeros(height, width, dtype=torch.bool)
        for row, (tokens, i) in enumerate(zip(rows, indices, strict=True)):
            n = len(tokens) - 1
            inputs[row, :n], targets[row, :n] = torch.tensor(tokens[:-1]), torch.tensor(tokens[1:])
            counted[row, n - continuations[i] : n] = True
        return inputs, targets, counted


def check_tasks(cfg: Eval) -> Any:
    """The task manager for `cfg.tasks`, once each task has been loaded (its documents read) and found a
    log-likelihood task; else one line naming eval.tasks and what to do. Before the first step."""
    return _loaded(tuple(cfg.tasks), cfg.include_path)[0]


@functools.cache
def _loaded(tasks: tuple[str, ...], include_path: str | None) -> tuple[Any, dict[str, Any]]:
    """(task manager, {name: lm-eval Task}) of check_tasks, once per process (the doctor's estimate reads them too)."""
    from evaluation.tasks import (
        hub_offline_unless_it_answers,
        not_loaded,
        task_manager_for,
        uncached_hub_datasets,
        unreadable,
    )

    names = ", ".join(tasks)
    manager = task_manager_for(list(tasks), include_path)
    if unknown := [t for t in tasks if t not in manager.all_tasks]:
        where = f" in {include_path} or lm-eval's own" if include_path else " (set eval.include_path for your own)"
        raise ConfigError(
            f"eval.tasks: no lm-eval task named {', '.join(unknown)}{where}; `lm-eval ls tasks` lists them"
        )
    with hub_offline_unless_it_answers() as offline, quiet_lm_eval():
        if offline and uncached_hub_datasets(list(tasks), include_path):
            raise unreadable(names, why=f"not cached here, and {offline}", key="eval.tasks")
        try:
            loaded = manager.load(list(tasks))["tasks"]
        except (ConnectionError, OSError) as e:
            raise not_loaded(e, names, offline=offline, key="eval.tasks") from None
    if generative := [name for name, task in loaded.items() if task.get_config("output_type") == "generate_until"]:
        raise ConfigError(
            f"eval.tasks: {', '.join(generative)} generates text, which the ranks of a run cannot do in step; "
            "score it with eval.py --tasks on a checkpoint (or --watch RUN_FOLDER), and list log-likelihood tasks here"
        )
    return manager, loaded


def compute_share(cfg: Any, *, dp: int) -> tuple[float, int, int]:
    """(share of the run's FLOPs its evals would take, evals, requests per eval), estimated before it starts: each
    request's tokens (the run's tokenizer) through one forward, a third of a trained token's FLOPs (the family's
    count), against every step's global batch. Padding, small batches and lm-eval's own Python make an eval's
    share of the time larger than of the FLOPs (EvalStep says what it measured after the first eval)."""
    from config import global_batch_size, model_args
    from data.tokenizers import build_tokenizer
    from models import family

    e, t = cfg.eval, cfg.training
    texts = []
    with quiet_lm_eval():
        for task in _loaded(tuple(e.tasks), e.include_path)[1].values():
            docs = len(task.eval_docs)
            limit = None if e.limit is None else math.ceil(docs * e.limit) if e.limit < 1 else int(e.limit)
            task.build_all_requests(limit=limit, rank=0, world_size=1)
            texts += ["".join(instance.args[:2]) for instance in task.instances]
    tokens = sum(len(ids) for ids in build_tokenizer(cfg.model.tokenizer_path).encode_batch(texts))
    evals = t.steps // e.interval + (t.steps % e.interval > 0)
    per_token = family(cfg.model.name).num_flops_per_token(model_args(cfg.model), t.seq_len)
    trained = t.steps * global_batch_size(t, dp=dp) * t.seq_len * per_token
    scored = evals * tokens * per_token / 3
    return scored / (scored + trained), evals, len(texts)


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """lm-eval's INFO and WARNING lines (a dozen per evaluation, from every rank), its progress bars (one per task
    and rank, built with tqdm imported into its modules: no argument turns them off) and those of `datasets` (its
    first read of a task's files, on every rank) kept out of the log; and
    its Jinja templates compiled once each: lm-eval 0.4.13 compiles a document's template anew for every document
    and choice (`lm_eval.utils.apply_template`), a third of an eval of the shipped task in one process."""
    import datasets
    import lm_eval.api.model
    import lm_eval.api.task
    import lm_eval.utils

    logger, modules = logging.getLogger("lm_eval"), [lm_eval.api.model, lm_eval.api.task]
    level, bars = logger.level, [m.tqdm for m in modules]
    env = getattr(lm_eval.utils, "env", None)  # (its Jinja environment; a later lm-eval may have none)
    env = env if env is not None and "from_string" not in vars(env) else None  # (None inside an outer one)
    datasets_bars = not datasets.are_progress_bars_disabled()
    logger.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    for module, bar in zip(modules, bars, strict=True):
        module.tqdm = functools.partial(_no_bar, bar)
    if env is not None:
        env.from_string = functools.lru_cache(maxsize=256)(env.from_string)
    try:
        yield
    finally:
        logger.setLevel(level)
        if datasets_bars:
            datasets.enable_progress_bars()
        for module, bar in zip(modules, bars, strict=True):
            module.tqdm = bar
        if env is not None:
            del env.from_string  # the class's method again


def _no_bar(bar: Any, *args: Any, **kwargs: Any) -> Any:
    return bar(*args, **{**kwargs, "disable": True})  # (lm-eval passes disable=False itself)


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's random state as it was: simple_evaluate seeds all three."""
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class DownstreamEval:
    """`cfg.tasks` scored through `lm` (RecipeLM over ShardedScores): a collective, every rank calls `evaluate`."""

    def __init__(self, cfg: Eval, *, lm: Any, manager: Any, num_fewshot: int | None = None):
        self.cfg, self.lm, self.manager, self.num_fewshot = cfg, lm, manager, num_fewshot
        self.device = lm.scores.forward.device
        self.samples: list[dict[str, Any]] = []  # the last evaluation's, with eval.log_samples (rank 0)

    def evaluate(self) -> tuple[dict[str, float], int, float]:
        """({"eval/<task>/<metric>": value} on rank 0, {} elsewhere; documents scored; seconds)."""
        import lm_eval

        begin = time.perf_counter()
        with quiet_lm_eval(), rng_kept():
            results = lm_eval.simple_evaluate(
                model=self.lm,
                tasks=self.cfg.tasks,
                num_fewshot=self.num_fewshot,
                limit=self.cfg.limit,
                task_manager=self.manager,
                log_samples=self.cfg.log_samples,
            )
        self.samples = sample_rows(results) if self.cfg.log_samples else []
        return flat_scores(results), documents_of(results), time.perf_counter() - begin


def sample_rows(results: dict | None) -> list[dict[str, Any]]:
    """Per document of each task: its id, the log-likelihood and greedy flag of each of its requests (a choice of
    a multiple-choice question, a window of a rolling one), and its scores, as lm-eval logged them."""
    rows = []
    for task, samples in (results or {}).get("samples", {}).items():
        for sample in samples:
            metrics = {
                m: float(sample[m]) for m in sample.get("metrics", []) if isinstance(sample.get(m), (int, float))
            }
            resps = [r[0] if isinstance(r, (list, tuple)) and r and isinstance(r[0], (list, tuple)) else r
                     for r in sample["resps"]]  # fmt: skip
            rows.append({"task": task, "doc_id": sample["doc_id"], "resps": resps, **metrics})
    return rows


def flat_scores(results: dict | None) -> dict[str, float]:
    """lm-eval's results as metrics: "eval/<task>/<metric>" (its filter "none" dropped), stderrs left out."""
    if results is None:  # (simple_evaluate returns them on rank 0 only)
        return {}
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            if kind and "stderr" not in metric and isinstance(value, (int, float)):
                out[f"eval/{task}/{metric}" + (f"_{kind}" if kind != "none" else "")] = float(value)
    return out


def documents_of(results: dict | None) -> int:
    if results is None:
        return 0
    return sum(int(n["effective"]) for n in results.get("n-samples", {}).values())


def build_downstream(
    cfg: Any, *, forward: ForwardBackward, mesh: Any, dp_rank: int, dp_degree: int, stop: StopRequest | None
) -> DownstreamEval:
    """The run's evaluator: its tasks checked (before any step), its scores through the run's layout."""
    from distributed import collective_on_every_rank
    from evaluation.adapter import RecipeLM

    e = cfg.eval
    manager = collective_on_every_rank(lambda: check_tasks(e))  # one line from rank 0 when a rank cannot load one
    tp, cp = mesh["tp"], mesh["cp"]
    scores = ShardedScores(
        forward,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        reports=tp.get_local_rank() == 0,
        batch_size=e.batch_size,
        multiple=math.lcm(8, 2 * cp.size() * tp.size()),  # CP splits a row in 2 x cp chunks, SP each part over TP
        compiled=cfg.compile.enable and "model" in cfg.compile.components,
        stop=stop,
    )
    model = forward.model
    lm = RecipeLM(model, cfg.model.tokenizer_path, scores=scores, max_length=model.args.max_seq_len)
    return DownstreamEval(e, lm=lm, manager=manager)


class EvalStep:
    """After every eval.interval steps and the last: the tasks scored and logged. A run resumed from an eval step
    whose scores metrics.jsonl lacks (a stop during that eval) scores it first, at construction, on the weights just
    loaded."""

    def __init__(self, evaluator: DownstreamEval, *, interval: int, total_steps: int, start_step: int, logger: Any):
        self.evaluator, self.interval, self.total_steps, self.logger = evaluator, interval, total_steps, logger
        self.start_step, self.begin, self.scoring_s, self.measured = start_step, time.perf_counter(), 0.0, False
        if start_step > 0 and self.due(start_step) and not scored_in(logger, start_step, device=evaluator.device):
            self.score(start_step)

    @classmethod
    def for_run(
        cls, cfg: Any, *, forward: ForwardBackward, mesh: Any, dp_rank: int, dp_degree: int, stop: StopRequest | None,
        start_step: int, logger: Any,
    ) -> EvalStep:  # fmt: skip
        """The run's in-loop evaluation ([eval]): its tasks checked, scored through the run's layout."""
        evaluator = build_downstream(cfg, forward=forward, mesh=mesh, dp_rank=dp_rank, dp_degree=dp_degree, stop=stop)
        steps = cfg.training.steps
        return cls(evaluator, interval=cfg.eval.interval, total_steps=steps, start_step=start_step, logger=logger)

    def due(self, step: int) -> bool:
        return step % self.interval == 0 or step == self.total_steps

    def __call__(self, step: int, result: Any) -> bool:
        if self.due(step):
            self.score(step)
        return False

    def score(self, step: int) -> None:
        try:
            scores, documents, seconds = self.evaluator.evaluate()
        except Interrupted:  # the stop step that follows saves `step`; the resumed run scores it
            if self.logger.enabled:
                print(f"eval at step {step}: abandoned for a stop request; a resumed run scores step {step} first")
            return
        self.logger.log_eval(step, scores, documents=documents, seconds=seconds)
        self.scoring_s += seconds
        if not self.measured and step > self.start_step:
            self.measured = True
            self.warn_if_costly(step, seconds)
        if self.evaluator.samples and self.logger.enabled:
            write_rows(Path(self.logger.jsonl).parent / "eval" / f"step-{step}.jsonl", self.evaluator.samples)

    def warn_if_costly(self, step: int, seconds: float) -> None:
        """After the first eval of this run: the share of the run's time its evals will take, measured (the steps'
        mean time so far against this eval's), said once when above MAX_SHARE."""
        from errors import warn

        step_s = (time.perf_counter() - self.begin - self.scoring_s) / (step - self.start_step)
        evals = len([s for s in range(step, self.total_steps + 1) if self.due(s)])
        share = evals * seconds / (evals * seconds + (self.total_steps - self.start_step) * step_s)
        if share > MAX_SHARE:
            warn(
                f"eval.interval: each eval takes {seconds:.1f} s, {seconds / step_s:.1f} steps' time: the {evals} evals "
                f"of this run take {share:.0%} of it; raise eval.interval (now {self.interval}) or set eval.limit"
            )


MAX_SHARE = 0.1  # of a run's time for its evals, above which the doctor and EvalStep warn


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """A jsonl file written whole: a temporary beside it renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)


def scored_in(logger: Any, step: int, *, device: torch.device) -> bool:
    """Whether metrics.jsonl holds step's scores, as rank 0 reads it, on every rank (a collective)."""
    found = torch.zeros(1, device=device)
    path: Path = logger.jsonl
    if logger.enabled and path.exists():
        rows = (json.loads(line) for line in path.read_text().splitlines())
        found[0] = any(row["step"] == step and any(k.startswith("eval/") for k in row) for row in rows)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found[0])
