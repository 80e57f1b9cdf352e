"""EleutherAI's lm-evaluation-harness over this repo's model: `eval.py --checkpoint CKPT --tasks ...`.

`RecipeLM` is lm-eval's `TemplateLM` (its `LM` interface with the tokenization of context/continuation pairs it
shares with its own `hf` backend) over a model that generate.py's loader built from a DCP step folder or a Hugging
Face folder: a DCP checkpoint is scored without converting it. Tokenization follows the `hf` backend's defaults
(a text framed as its tokenizer frames one, data/tokenizers.py; an empty context replaced by the tokenizer's BOS,
or its end-of-text when it names none), so scores equal that backend's on the same weights (tests/test_eval.py).
One process: lm-eval's own data parallelism is not wired here.

    loglikelihood           sum of log-probabilities of the continuation tokens after the context, and whether
                            greedy decoding would have produced them (multiple choice, cloze)
    loglikelihood_rolling   the whole text's log-likelihood over windows of the model's context (perplexity)
    generate_until          greedy (or sampled) continuation by generate.py's Generator, cut at the stop strings
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from errors import ConfigError


def import_lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError:
        raise ConfigError('--tasks: lm-evaluation-harness is not installed; pip install -e ".[eval]"') from None
    return lm_eval


def run_tasks(opts: argparse.Namespace) -> int:
    """`eval.py --tasks`: lm_eval.simple_evaluate on the checkpoint, its table printed."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("--tasks: lm-evaluation-harness runs in one process here; start eval.py with python")
    lm_eval = import_lm_eval()
    from lm_eval.utils import make_table

    from generate import load_model

    tasks = [t.strip() for t in opts.tasks.split(",") if t.strip()]
    names = ", ".join(tasks)
    with hub_offline_unless_it_answers() as offline:
        # Said before lm-eval indexes its tasks and the model loads (seconds each), not after.
        if offline and uncached_hub_datasets(tasks, opts.include_path):
            raise unreadable(names, why=f"not cached here, and {offline}")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer_path = load_model(opts.checkpoint, config=opts.config, device=device, dtype=torch.float32)
        tokenizer_path = opts.tokenizer or tokenizer_path
        if tokenizer_path is None:
            raise ConfigError(f"--tokenizer: {opts.checkpoint} holds no tokenizer.json; name a tokenizer folder")
        lm = recipe_lm()(model, tokenizer_path, batch_size=opts.batch_size, max_gen_toks=opts.max_new_tokens)
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


def not_loaded(error: OSError, names: str, *, offline: str | None, key: str) -> ConfigError:
    """Why the datasets of tasks `names` could not be read (lm-eval's ConnectionError or OSError), in one line."""
    if isinstance(error, FileNotFoundError) and (missing := re.search(r"Unable to find '(.+?)'", str(error))):
        return ConfigError(
            f"{key}: {missing[1]}, a data file of {names}, does not exist (a task's relative data_files are read from "
            f"the current folder, {Path.cwd()}); start from the folder they are relative to, or fix the task's data_files"
        )
    return unreadable(names, why=f"not cached here, and {offline}" if offline else type(error).__name__, key=key)


def unreadable(names: str, *, why: str, key: str = "--tasks") -> ConfigError:
    return ConfigError(
        f"{key}: {names} needs its dataset, which could not be read ({why}); download it where the Hugging "
        "Face hub is reachable (HF_DATASETS_OFFLINE=0), or give a local task with --include-path"
    )


# A task's own YAML names it on a line of its own: `task: hellaswag`.
_TASK_LINE = re.compile(r"^task:[ \t]*['\"]?([^'\"\s#]+)['\"]?[ \t]*(?:#.*)?$", flags=re.M)


def uncached_hub_datasets(tasks: list[str], include_path: str | None) -> list[str]:
    """The hub datasets of `tasks` that this machine has no copy of, for use while the hub does not answer, found
    without lm-eval's index of its tasks (about 14,000 YAML files parsed: 12 s here; their text read: half a second):
    the YAML whose `task:` line names a task, read by lm-eval's own loader (its includes resolved), and its dataset
    opened as lm-eval opens it, offline. A task found otherwise (a group, a tag, a task class) or with data files of
    its own is left to lm-eval, which says the same once it has read its index."""
    import datasets
    import lm_eval.tasks

    try:
        from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval 0.4.13's loader (private): without it, no early word
    except ImportError:
        return []
    roots = [Path(lm_eval.tasks.__file__).parent, *([Path(include_path)] if include_path else [])]
    found: dict[str, Path] = {}
    for root in roots:  # a later root's task replaces an earlier one's, as in lm-eval's index
        for path in sorted(root.rglob("*.yaml")):
            for name in _TASK_LINE.findall(path.read_text(encoding="utf-8", errors="replace")):
                if name in tasks:
                    found[name] = path
    missing = []
    for path in found.values():
        try:
            cfg = load_yaml(path, resolve_func=False)
        except Exception:  # (a YAML lm-eval's index would skip too)
            continue
        hub = cfg.get("dataset_path")
        if not isinstance(hub, str) or "class" in cfg or cfg.get("dataset_kwargs") or cfg.get("custom_dataset"):
            continue
        try:
            datasets.load_dataset_builder(hub, cfg.get("dataset_name"))
        except (ConnectionError, OSError):  # (offline: a dataset not cached)
            missing.append(hub)
    return missing


HUB_TIMEOUT_S = 5.0


@contextlib.contextmanager
def hub_offline_unless_it_answers(timeout_s: float = HUB_TIMEOUT_S) -> Iterator[str | None]:
    """The Hugging Face hub's offline mode while lm-eval reads its datasets, when the hub does not answer one request
    within timeout_s: else huggingface_hub retries each request five times, waiting longer each time (and longer still
    where connections time out), before the run fails. Offline, a cached dataset is read and a missing one fails at once.
    Yields why the hub is not used ("<its address> did not answer", "offline mode is on"), or None when it answered."""
    import datasets.config
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE:
        yield "offline mode is on"
        return
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout_s)
    except Exception:  # no answer: no network, no name resolution, refused, timed out, a proxy's or TLS's error
        pass
    else:
        yield None
        return
    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield f"{constants.ENDPOINT} did not answer"
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


@functools.cache
def task_manager(include_path: str | None) -> Any:
    """lm-eval's index of its tasks (thousands of YAML files: seconds to build), and those of include_path."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


# What scores lm-eval's log-likelihood requests: (sequences, continuation lengths) -> (summed log-probability of the
# continuation, greedy?) per sequence. The model reads each sequence but its last token; the last n are the
# continuation. WholeModel in one process; downstream.py's ShardedScores over a run's layout.
Scores = Callable[[list[list[int]], list[int]], list[tuple[float, bool]]]


class WholeModel:
    """Scores in one process: batches of right-padded sequences through the model, their whole logits."""

    def __init__(self, model: nn.Module, *, batch_size: int):
        self.model, self.batch_size = model, batch_size
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def __call__(self, sequences: list[list[int]], continuations: list[int]) -> list[tuple[float, bool]]:
        out = []
        for start in range(0, len(sequences), self.batch_size):
            chunk = range(start, min(start + self.batch_size, len(sequences)))
            width = max(len(sequences[i]) for i in chunk) - 1
            batch = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, i in enumerate(chunk):  # right padding: the causal rows before it are unaffected
                batch[row, : len(sequences[i]) - 1] = torch.tensor(sequences[i][:-1])
            logprobs = F.log_softmax(self.model(batch.to(self.device)).float(), dim=-1).cpu()
            for row, i in enumerate(chunk):
                n, cont = len(sequences[i]) - 1, continuations[i]
                scored = logprobs[row, n - cont : n]  # (continuation, vocab)
                target = torch.tensor(sequences[i][-cont:])
                greedy = bool((scored.argmax(dim=-1) == target).all())
                out.append((float(scored.gather(-1, target[:, None]).sum()), greedy))
        return out


def task_manager_for(tasks: list[str], include_path: str | None) -> Any:
    """lm-eval's index of the tasks: include_path's alone when it holds every one of `tasks` (a second), else with
    lm-eval's own (thousands of YAML files: seconds). The same YAML either way, so the same scores."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in own.all_tasks for t in tasks):
            return own
    return task_manager(include_path)


@functools.cache
def recipe_lm() -> type:
    """RecipeLM, a subclass of lm-eval's TemplateLM: a class made on first use, since lm-eval is an optional extra."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import handle_stop_sequences
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from data.tokenizers import build_tokenizer
    from generate import Generator, Sampling, hf_tokenizer

    class RecipeLM(TemplateLM):
        def __init__(
            self,
            model: nn.Module,
            tokenizer_path: str,
            *,
            batch_size: int = 8,
            max_gen_toks: int = 256,
            scores: Scores | None = None,
            max_length: int | None = None,
        ):
            """`model` in one process; or `scores` (downstream.py's ShardedScores: the model as a run laid it out),
            with `max_length`, the longest sequence to score, and `model` that run's model, which then only
            log-likelihood tasks use (the ranks would not agree on how many forwards a generation takes)."""
            super().__init__()
            self.model = model.eval() if scores is None else model
            self.tokenizer = hf_tokenizer(tokenizer_path)
            self.framing = build_tokenizer(tokenizer_path, key="--tokenizer").framing
            self.max_gen_toks = max_gen_toks
            self.max_length = max_length or model.args.max_seq_len
            self.scores = scores or WholeModel(model, batch_size=batch_size)

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:
            bos = self.tokenizer.bos_token_id
            return bos if bos is not None else self.eot_token_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            """As the hf backend encodes: framed as the tokenizer frames a text (data/tokenizers.py) unless told
            not to, or (not told) when the text already starts with the prefix token."""
            if add_special_tokens is None:
                add_special_tokens = not string.startswith(self.tokenizer.decode(self.prefix_token_id))
            return self._encode(string, framed=add_special_tokens)

        def _encode(self, string: str, *, framed: bool) -> list[int]:
            ids = self.tokenizer.encode(string, add_special_tokens=False)
            return self.framing.prompt(ids) if framed else ids

        def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
            return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
            """(sum of the continuation's log-probabilities, greedy?) per (key, context tokens, continuation tokens):
            the last max_length + 1 tokens of context + continuation, of which the model reads all but the last."""
            sequences = [(ctx + cont)[-(self.max_length + 1) :] for _, ctx, cont in requests]
            return self.scores(sequences, [len(cont) for _, _, cont in requests])

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            """Each text scored whole, in disjoint windows of the model's context, the first after BOS."""
            results = []
            for (text,) in (req.args for req in requests):
                windows = map(
                    make_disjoint_window,
                    get_rolling_token_windows(
                        token_list=self.tok_encode(text),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    ),
                )
                scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
                results.append(sum(logprob for logprob, _ in scored))
            return results

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
            generator, out = Generator(self.model), []
            for context, gen_kwargs in (req.args for req in requests):
                kwargs = dict(gen_kwargs)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
                sampling = Sampling(float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0)
                # (the hf backend's batch encoding: framed unless the context starts with the BOS's text)
                framed = not (self.tokenizer.bos_token and context.startswith(self.tokenizer.bos_token))
                prompt = self._encode(context, framed=framed)[-(self.max_length - max_new) :]
                (tokens,) = generator.generate([prompt], max_new_tokens=max_new, sampling=sampling,
                                               stop_ids=[self.eot_token_id])  # fmt: skip
                text = self.tok_decode(tokens)
                for stop in until:
                    text = text.split(stop)[0] if stop else text
                out.append(text)
            return out

    return RecipeLM
