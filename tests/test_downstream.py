"""[eval] (evaluation/downstream.py): lm-eval tasks scored inside the training loop, on 2 gloo ranks with FSDP and
with TP, equal to the tools that define the scores: eval.py --tasks on the step's checkpoint (one process, the whole
model) and lm-eval's own `hf` backend on the step exported to a Hugging Face folder, request by request. `eval.py --watch`
follows a run while it trains and ends with it; a stop request during an eval loses no score and logs none twice;
the eval changes nothing in training. The shipped offline task (assets/eval_tasks/stories_facts) throughout."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from errors import ConfigError
from tests.conftest import TINY, losses
from tests.launch import REPO, python, torchrun

EVAL = [
    "--eval.enable", "--eval.tasks=stories_facts", "--eval.include_path=assets/eval_tasks", "--eval.limit=40",
    "--eval.batch_size=16",
]  # fmt: skip
WATCH = ["eval.py", "--tasks", "stories_facts", "--include-path", "assets/eval_tasks", "--limit", "40"]


def rows(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def scores(dump: Path) -> dict[int, dict[str, float]]:
    """step -> the eval/ metrics logged at it; a step logged twice fails."""
    out: dict[int, dict[str, float]] = {}
    for row in rows(dump):
        if found := {k: v for k, v in row.items() if k.startswith("eval/")}:
            assert row["step"] not in out, f"step {row['step']} scored twice"
            out[row["step"]] = found
    return out


def samples(results: dict) -> list[dict]:
    from evaluation.downstream import sample_rows

    return sorted(sample_rows(results), key=lambda r: r["doc_id"])


def equal_requests(ours: list[dict], theirs: list[dict], *, what: str) -> None:
    """Accuracy identical document by document, each request's log-likelihood within 1e-5 relative."""
    assert [r["doc_id"] for r in ours] == [r["doc_id"] for r in theirs] and ours, what
    for a, b in zip(ours, theirs, strict=True):
        assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"]), (what, a, b)
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(a["resps"], b["resps"], strict=True):
            assert ll_a == pytest.approx(ll_b, rel=1e-5), (what, a, b)
            assert greedy_a == greedy_b, (what, a, b)


def outside_tools(step_folder: Path, tmp_path: Path) -> tuple[list[dict], list[dict]]:
    """The step's per-document samples from eval.py --tasks's path (eval.py run_tasks: inference.py's one-process
    model, RecipeLM) and from lm-eval's hf backend on the step exported with scripts/convert_hf.py."""
    import lm_eval

    sys.path.insert(0, str(REPO / "scripts"))
    import convert_hf

    from evaluation.adapter import RecipeLM
    from evaluation.tasks import task_manager_for
    from inference import load_model

    manager = task_manager_for(["stories_facts"], "assets/eval_tasks")
    run = lambda model, **kw: lm_eval.simple_evaluate(  # noqa: E731
        model=model, tasks=["stories_facts"], limit=40, task_manager=manager, log_samples=True, **kw
    )
    model, tokenizer = load_model(step_folder, config=None, device=torch.device("cpu"), dtype=torch.float32)
    ours = samples(run(RecipeLM(model, tokenizer)))
    hf = tmp_path / "hf"
    assert convert_hf.main(["to-hf", str(step_folder), str(hf), "--flavor=debugmodel",
                            "--tokenizer-path=assets/tokenizer", "--dtype=float32"]) == 0  # fmt: skip
    theirs = samples(run("hf", model_args=f"pretrained={hf},dtype=float32,device=cpu"))
    return ours, theirs


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks FSDP, 3 steps, scored at steps 2 and 3 (log_samples on), checkpoints at both, while `eval.py --watch`
    follows the run from a process of its own, started first."""
    dump = tmp_path_factory.mktemp("straight") / "run"
    watcher = threading.Thread(target=lambda: watched.append(watch(dump)))
    watched: list[subprocess.CompletedProcess[str]] = []
    watcher.start()
    try:
        torchrun("train.py", *TINY, *EVAL, f"--job.dump_folder={dump}", "--training.steps=3", "--eval.interval=2",
                 "--eval.log_samples", "--checkpoint.enable", "--checkpoint.interval=2", nproc=2)  # fmt: skip
    finally:
        watcher.join(timeout=300)
    (dump / "watch.out").write_text(watched[0].stdout + watched[0].stderr)
    assert watched[0].returncode == 0, (dump / "watch.out").read_text()[-3000:]
    return dump


def watch(dump: Path) -> subprocess.CompletedProcess[str]:
    """eval.py --watch on a run folder that does not exist yet: it waits for the run's config, then its steps."""
    deadline = time.monotonic() + 120
    while not (dump / "checkpoint" / "config.toml").is_file():
        assert time.monotonic() < deadline, "the run never wrote its config"
        time.sleep(0.2)
    return python(*WATCH, "--watch", str(dump), "--poll-seconds=0.5", timeout=300)


def test_in_loop_scores_equal_eval_py_and_the_hf_backend_on_the_steps_checkpoint_fsdp(
    straight: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    logged = scores(straight)
    assert sorted(logged) == [2, 3] and 0 < logged[3]["eval/stories_facts/acc"] < 1, logged
    in_loop = sorted(
        (json.loads(line) for line in (straight / "eval" / "step-3.jsonl").open()), key=lambda r: r["doc_id"]
    )
    assert len(in_loop) == 40 and sum(r["acc"] for r in in_loop) / 40 == pytest.approx(
        logged[3]["eval/stories_facts/acc"]
    )
    ours, theirs = outside_tools(straight / "checkpoint" / "step-3", tmp_path)
    equal_requests(in_loop, ours, what="in the loop (FSDP 2) vs eval.py --tasks")
    equal_requests(in_loop, theirs, what="in the loop (FSDP 2) vs lm-eval's hf backend")


def test_watch_follows_the_run_and_ends_with_it_then_skips_what_it_scored(straight: Path) -> None:
    watched = [json.loads(line) for line in (straight / "eval" / "watch-stories_facts.jsonl").open()]
    assert [row["step"] for row in watched] == [2, 3], watched
    logged = scores(straight)
    for row in watched:  # the same weights, the same scores (documents in another order: sums round alike)
        for key, value in logged[row["step"]].items():
            assert row[key] == pytest.approx(value, abs=1e-12), (row, logged)
    assert "end: the run's last step, 3, is scored" in (straight / "watch.out").read_text()
    again = python(*WATCH, "--watch", str(straight), timeout=120)  # restarted: nothing left to score, it ends at once
    assert again.returncode == 0 and "eval: " not in again.stdout and "is scored" in again.stdout, again.stdout


def test_a_stop_during_an_eval_neither_loses_nor_repeats_a_score_and_evals_change_no_loss(
    straight: Path, tmp_path: Path
) -> None:
    """STOP lands while step 2 is scored (the eval of 40 documents takes seconds; metrics.jsonl shows step 2's
    loss just before it starts): the eval is abandoned, step 2 saved; the same command scores step 2 first, then
    trains step 3 and scores it. Scores and losses are the straight run's, and a run without [eval] has its losses."""
    dump = tmp_path / "run"
    args = [*TINY, *EVAL, f"--job.dump_folder={dump}", "--training.steps=3", "--eval.interval=2",
            "--checkpoint.enable", "--checkpoint.interval=2"]  # fmt: skip
    stopper = threading.Thread(target=stop_at_step, args=(dump, 2))
    stopper.start()
    first = torchrun("train.py", *args, nproc=2)
    stopper.join()
    assert "eval at step 2: abandoned for a stop request" in first.stdout, first.stdout[-3000:]
    assert sorted(p.name for p in (dump / "checkpoint").glob("step-*")) == ["step-2"] and scores(dump) == {}
    (dump / "STOP").unlink(missing_ok=True)
    torchrun("train.py", *args, nproc=2)
    assert scores(dump) == scores(straight)
    assert losses(dump) == losses(straight)
    plain = tmp_path / "plain"
    torchrun("train.py", *TINY, f"--job.dump_folder={plain}", "--training.steps=3", nproc=2)
    assert losses(plain) == losses(straight)  # to the digit: the evals at step 2 changed nothing


def stop_at_step(dump: Path, step: int) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if (dump / "metrics.jsonl").is_file() and any(r.get("step") == step and "loss" in r for r in rows(dump)):
            (dump / "STOP").touch()
            return
        time.sleep(0.05)


def test_in_loop_scores_equal_eval_py_and_the_hf_backend_under_tp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP 2 with loss parallel: the log-softmax, the target's entry and the maximum on vocabulary shards."""
    dump = tmp_path / "run"
    torchrun("train.py", *TINY, *EVAL, f"--job.dump_folder={dump}", "--training.steps=2", "--eval.interval=2",
             "--eval.log_samples", "--checkpoint.enable", "--parallelism.tensor_parallel_degree=2",
             "--parallelism.data_parallel_shard_degree=1", nproc=2)  # fmt: skip
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    in_loop = sorted((json.loads(line) for line in (dump / "eval" / "step-2.jsonl").open()), key=lambda r: r["doc_id"])
    ours, theirs = outside_tools(dump / "checkpoint" / "step-2", tmp_path)
    equal_requests(in_loop, ours, what="in the loop (TP 2) vs eval.py --tasks")
    equal_requests(in_loop, theirs, what="in the loop (TP 2) vs lm-eval's hf backend")


def test_tasks_that_cannot_run_are_refused_at_start_up_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any step: the config's checks, then each task loaded (evaluation.downstream.check_tasks, which train.py calls on
    every rank before step 1)."""
    from lm_eval.tasks import TaskManager

    import evaluation.tasks
    from config import load_config
    from evaluation.downstream import check_tasks

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # lm-eval's own index of its thousands of tasks takes seconds to build: here it is empty.
    monkeypatch.setattr(evaluation.tasks, "task_manager", lambda path: TaskManager(path, include_defaults=False))
    base = ["--config", "configs/debug.toml", "--eval.enable", "--eval.include_path=assets/eval_tasks"]

    def refusal(*args: str) -> str:
        with pytest.raises(ConfigError) as e:
            check_tasks(load_config([*base, *args]).eval)
        assert len(e.value.problems) == 1 and "\n" not in e.value.problems[0], e.value.problems
        return e.value.problems[0]

    assert check_tasks(load_config(base).eval).all_tasks == ["stories_facts"]  # configs/debug.toml's, as shipped
    assert refusal("--eval.tasks=").startswith("eval.tasks: name the lm-eval tasks")
    assert refusal("--eval.tasks=stories_factz").startswith(
        "eval.tasks: no lm-eval task named stories_factz in assets/"
    )
    assert "--watch RUN_FOLDER" in refusal("--eval.tasks=stories_facts", "--parallelism.pipeline_parallel_degree=2")
    own = tmp_path / "tasks"
    own.mkdir()
    yaml = (REPO / "assets/eval_tasks/stories_facts.yaml").read_text()
    (own / "gen.yaml").write_text(yaml.replace("task: stories_facts", "task: facts_gen").replace(
        "output_type: multiple_choice", "output_type: generate_until"))  # fmt: skip
    (own / "gone.yaml").write_text(yaml.replace("task: stories_facts", "task: facts_gone").replace(
        "stories_facts.jsonl", "gone.jsonl"))  # fmt: skip
    said = refusal("--eval.tasks=facts_gen", f"--eval.include_path={own}")
    assert said.startswith("eval.tasks: facts_gen generates text") and "eval.py --tasks" in said, said
    said = refusal("--eval.tasks=facts_gone", f"--eval.include_path={own}")
    assert said.startswith("eval.tasks: ") and "gone.jsonl, a data file of facts_gone, does not exist" in said, said


def test_evals_that_would_take_a_tenth_of_the_run_are_warned_of_before_and_after_the_first(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The doctor, from the task's tokens against the run's (configs/debug.toml as shipped: 2 evals, no warning; one
    every 2 steps: a warning); the run, from what its first eval took against its steps so far."""
    from config import load_config
    from evaluation.downstream import EvalStep
    from planning.doctor import Machine, check_recipe

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    machine = Machine(cuda=False, cpu_has_bf16=True, device_memory_gib=64)
    findings = lambda *args: [f for f in check_recipe(load_config(["--config", "configs/debug.toml", *args]),  # noqa: E731
                                                      world_size=2, machine=machine) if f.key == "eval.interval"]  # fmt: skip
    assert findings() == []
    (warned,) = findings("--eval.interval=2")
    assert "50 evals of 1,216 requests each would take" in warned.message, warned

    class Evaluator:
        samples: list[dict] = []

        def __init__(self, seconds: float):
            self.seconds = seconds

        def evaluate(self) -> tuple[dict[str, float], int, float]:
            return {"eval/t/acc": 0.5}, 10, self.seconds

    class Logger:
        enabled = False

        def log_eval(self, *args: object, **kwargs: object) -> None:
            pass

    # 50 evals of 0.2 s against 100 steps of about 10 ms; 20 of 1 ms against 100 of 10 ms.
    for interval, seconds, warns in ((2, 0.2, True), (5, 0.001, False)):
        step = EvalStep(Evaluator(seconds), interval=interval, total_steps=100, start_step=0, logger=Logger())
        time.sleep(interval * 0.01)
        capsys.readouterr()
        step(interval, None)
        said = capsys.readouterr().err
        assert ("warning: eval.interval: each eval takes" in said) == warns, said
