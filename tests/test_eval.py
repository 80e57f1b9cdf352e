"""eval.py --tasks: lm-evaluation-harness over this repo's model scores what lm-eval's own `hf` backend scores on
the same weights, from a Hugging Face folder and from a DCP checkpoint alike, offline (local task YAMLs over jsonl
files: tests/lm_eval_tasks/). The held-out loss is checked against train.py's logged validation loss in
tests/test_validation.py."""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import eval as eval_py  # (eval.py: not "evaluate", which would shadow the evaluate package lm-eval imports)
from errors import ConfigError
from tests.launch import REPO
from tests.tiny_hf import tiny_hf_folder

TASKS = ["recipe_mc", "recipe_rolling", "recipe_gen"]


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The YAMLs of tests/lm_eval_tasks/ pointing at jsonl documents written here."""
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    animals = ["girl", "boy", "king", "frog", "tree", "fox", "baker", "moon"]
    mc = [{"question": f"Once upon a time there was a {w}.", "choices": [" dog", " cat", " bird"], "answer": i % 3}
          for i, w in enumerate(animals)]  # fmt: skip
    stories = [json.loads(line)["text"] for line in (REPO / "assets/corpus/stories_validation.jsonl").open()][:3]
    rolling = [{"text": " ".join(stories)[:1500]}, {"text": stories[0][:200]}]  # ~375 tokens: two windows of 256
    gen = [{"question": "Once upon a time", "answer": " there"}, {"question": "The cat sat", "answer": " on"}]
    for name, docs in {"mc": mc, "rolling": rolling, "gen": gen}.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    for yaml in (REPO / "tests" / "lm_eval_tasks").glob("*.yaml"):
        (folder / yaml.name).write_text(yaml.read_text().replace("DATA/", f"{folder}/"))
    gen = (folder / "recipe_gen.yaml").read_text()  # a task whose data file is not there
    (folder / "recipe_missing.yaml").write_text(
        gen.replace("recipe_gen", "recipe_missing").replace("gen.jsonl", "no.jsonl")
    )
    return folder


def scores(results: dict) -> dict[str, float]:
    """task/metric -> value, e.g. recipe_mc/acc,none."""
    return {
        f"{task}/{metric}": float(value)
        for task in TASKS
        for metric, value in results["results"][task].items()
        if "," in metric and "stderr" not in metric
    }


def ours_and_theirs(folder: Path, task_folder: Path) -> tuple[dict, dict]:
    """lm-eval's results for TASKS through RecipeLM and through lm-eval's own hf backend, on one HF folder."""
    import lm_eval

    from evaluation.adapter import RecipeLM
    from evaluation.tasks import task_manager
    from inference import load_model

    manager = task_manager(str(task_folder))  # (lm-eval's index of its tasks: built once per process)

    def run(model: object, **kw: str) -> dict:
        return lm_eval.simple_evaluate(model=model, tasks=TASKS, task_manager=manager, log_samples=True, **kw)

    theirs = run("hf", model_args=f"pretrained={folder},dtype=float32,device=cpu")
    model, tokenizer = load_model(folder, config=None, device=torch.device("cpu"), dtype=torch.float32)
    ours = run(RecipeLM(model, tokenizer, continuations=eval_py.generator_of(model)))
    assert scores(ours) == pytest.approx(scores(theirs), rel=1e-6)
    responses = lambda r: [s["resps"] for s in r["samples"]["recipe_gen"]]  # noqa: E731
    assert responses(ours) == responses(theirs) and all(responses(ours))
    assert scores(ours)["recipe_mc/acc,none"] not in (0.0, 1.0)  # the choices are not all alike
    return ours, theirs


@pytest.mark.parametrize("convention", ["smollm2", "qwen3"])
def test_tasks_score_what_the_hf_backend_scores_with_a_tokenizer_that_adds_no_bos(
    convention: str, task_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Llama 3 convention (a BOS before every text) is the test below's; here texts are framed with nothing,
    and the empty context is the named BOS (SmolLM2's) or, naming none, the end-of-text (Qwen3's)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ours_and_theirs(tiny_hf_folder(tmp_path / "hf", seed=1, convention=convention), task_folder)


def test_tasks_score_what_lm_evals_hf_backend_scores_from_an_hf_folder_and_a_dcp_checkpoint(
    task_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tiny_hf_folder(tmp_path / "hf", seed=1)
    ours, _ = ours_and_theirs(folder, task_folder)

    # The same weights as a DCP checkpoint with its run config beside it, through the command: the same table.
    sys.path.insert(0, str(REPO / "scripts"))
    from convert_hf import hf_to_dcp

    checkpoint = tmp_path / "run" / "checkpoint" / "step-0"
    hf_to_dcp(folder, checkpoint, dtype=None)
    (checkpoint.parent / "config.toml").write_text(
        f'[model]\nname = "llama3"\nhf_assets_path = "{folder}"\nshape_from_hf_config = true\ntokenizer_path = "{folder}"\n'
        "[training]\nseq_len = 256\n"
    )
    capsys.readouterr()
    assert (
        eval_py.main(["--checkpoint", str(checkpoint), "--tasks", ",".join(TASKS), "--include-path", str(task_folder)])
        == 0
    )
    table = capsys.readouterr().out
    for key, value in scores(ours).items():
        metric = key.split("/")[1].split(",")[0]
        assert f"|{metric}" in table.replace(" ", "") and f"{value:.4f}" in table, (key, value, table)


def readme_eval_command(line: int) -> list[str]:
    """A line of README's eval.py block, its checkpoint that of `make train`."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("`eval.py` scores a checkpoint") :], flags=re.S)[1]
    readme = shlex.split(block.splitlines()[line])
    assert readme[:4] == [".venv/bin/python", "eval.py", "--checkpoint", "outputs/debug/checkpoint/step-100"], readme
    return readme


def test_tasks_refusals_are_one_line(task_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Among them README's --tasks command where the hub does not answer: its hub task's dataset cannot be read, said
    at once (not after huggingface_hub's retries); a local task's missing data file, named; a run folder given where a
    step folder is wanted."""
    import datasets.config
    from huggingface_hub import constants

    from evaluation.tasks import task_manager

    folder = tiny_hf_folder(tmp_path / "hf", seed=1)
    readme = readme_eval_command(1)
    # Online as configured, but the hub refuses connections; nothing cached (a machine that downloaded hellaswag).
    for module, name, value in [(constants, "HF_HUB_OFFLINE", False), (datasets.config, "HF_HUB_OFFLINE", False),
                                (constants, "ENDPOINT", "http://127.0.0.1:9"), (constants, "HF_HUB_CACHE", str(tmp_path)),
                                (datasets.config, "HF_DATASETS_CACHE", str(tmp_path))]:  # fmt: skip
        monkeypatch.setattr(module, name, value)
    task_manager(str(task_folder))  # (built once per process: seconds, not part of the refusal's time)
    begin = time.perf_counter()
    with pytest.raises(ConfigError, match=r"--tasks: hellaswag needs its dataset, which could not be read \(not cached "
                       r"here, and http://127.0.0.1:9 did not answer\); download it where"):  # fmt: skip
        eval_py.main(["--checkpoint", str(folder), *readme[4:], "--include-path", str(task_folder)])
    assert time.perf_counter() - begin < 10  # huggingface_hub's five retries wait 23 s
    assert constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False  # offline only meanwhile
    missing = ["--checkpoint", str(folder), "--tasks", "recipe_missing", "--include-path", str(task_folder)]
    with pytest.raises(ConfigError, match=rf"^--tasks: {task_folder / 'no.jsonl'}, a data file of recipe_missing, does"
                       rf" not exist \(a task's relative data_files are read from the current folder, "):  # fmt: skip
        eval_py.main(missing)
    run = tmp_path / "run"
    (run / "checkpoint" / "step-7").mkdir(parents=True)
    (run / "checkpoint" / "step-7" / ".metadata").touch()
    for path, kind in [(run, "a run folder"), (run / "checkpoint", "a checkpoint folder")]:
        with pytest.raises(ConfigError, match=rf"^--checkpoint: {path} is {kind}; point it at one of its step folders, "
                           rf"e.g. {run / 'checkpoint' / 'step-7'}$"):  # fmt: skip
            eval_py.main(["--checkpoint", str(path), *readme[4:]])
    base = ["--checkpoint", str(folder), "--tasks", "recipe_nope", "--include-path", str(task_folder)]
    with pytest.raises(ConfigError, match=r"--tasks: no lm-eval task named recipe_nope \(lm-eval --tasks list"):
        eval_py.main(base)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="--tasks: lm-evaluation-harness runs in one process here"):
        eval_py.main(base)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    with pytest.raises(ConfigError, match=r'lm-evaluation-harness is not installed; pip install -e "\.\[eval\]"'):
        eval_py.main(base)
    with pytest.raises(
        ConfigError, match="is a Hugging Face folder; name the TOML with the data, tokenizer and layout"
    ):
        eval_py.main(["--checkpoint", str(folder)])


def test_the_shipped_task_is_what_the_corpus_states() -> None:
    """assets/eval_tasks/stories_facts.jsonl is scripts/make_eval_task.py's, and right by the corpus: each question's
    cue (the end of its context) is written in assets/corpus/stories.jsonl at least MIN_STATED times followed by its
    answer and never by one of its three distractors; 304 questions of 24 kinds, a third of them the world's facts."""
    sys.path.insert(0, str(REPO / "scripts"))
    from make_corpus import ANIMALS, DAYS
    from make_eval_task import MIN_STATED, questions, read_corpus

    corpus = read_corpus(REPO / "assets/corpus/stories.jsonl")
    shipped = [json.loads(line) for line in (REPO / "assets/eval_tasks/stories_facts.jsonl").open(encoding="utf-8")]
    assert shipped == questions(seed=7, corpus=corpus)
    kinds = Counter(q["kind"] for q in shipped)
    assert len(shipped) == 304 and Counter(q["group"] for q in shipped) == {"world": 105, "story": 199}, kinds
    assert len(kinds) == 24 and min(kinds.values()) >= 4 and max(kinds.values()) <= 0.15 * len(shipped), kinds

    lowered = corpus.lower()  # (a sentence's first letter in either case)
    whole = lambda text: re.findall(re.escape(text.lower()) + r"(?![\w-])", lowered)  # noqa: E731  ("pan", not "pancake")
    for q in shipped:
        answer, cue = q["choices"][q["answer"]], q["cue"]
        assert len(set(q["choices"])) == 4 and q["context"].endswith(cue) and len(cue.split()) >= 2, q
        assert len(whole(f"{cue} {answer}")) >= MIN_STATED, q
        wrong = [w for w in q["choices"] if w != answer and f"{cue} {w}".lower() in lowered and whole(f"{cue} {w}")]
        assert not wrong, (q, wrong)

    # The world's facts are make_corpus.py's: what each animal says, what day comes after which.
    said = {q["context"]: q["choices"][q["answer"]] for q in shipped}
    assert said["The cow says"] == "moo" and said["After Sunday comes"] == "Monday"
    assert {said[f"The {a.name} says"] for a in ANIMALS} == {a.sound for a in ANIMALS}
    assert [said[f"After {day} comes"] for day in DAYS] == DAYS[1:] + DAYS[:1]


def test_the_readmes_offline_task_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """README's third eval.py command, from the repo root and offline, on a tiny model in place of `make train`'s:
    assets/eval_tasks/'s stories_facts. The tiny model is untrained, and scores what chance does (0.25, within three
    standard errors): no choice wins by its length alone, so a score above it is learned."""
    import datasets.config
    from huggingface_hub import constants

    readme = readme_eval_command(2)
    assert readme[4:] == ["--tasks", "stories_facts", "--include-path", "assets/eval_tasks"], readme
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(REPO)
    capsys.readouterr()
    assert eval_py.main(["--checkpoint", str(tiny_hf_folder(tmp_path / "hf", seed=1)), *readme[4:]]) == 0
    table = capsys.readouterr().out.replace(" ", "")
    assert "|stories_facts|" in table, table
    for metric in ("acc", "acc_norm"):
        value, stderr = map(float, re.search(rf"\|{metric}\|↑\|([\d.]+)\|±\|([\d.]+)\|", table).groups())
        assert abs(value - 0.25) < 3 * stderr, (metric, value, stderr, table)
