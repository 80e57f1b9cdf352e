"""lm-evaluation-harness's model interface over this repo's model: `RecipeLM`, for `eval.py --tasks` on a checkpoint
in one process and for the in-loop eval (downstream.py) on the model as a run lays it out.

`RecipeLM` is lm-eval's `TemplateLM` (its `LM` interface with the tokenization of context/continuation pairs it
shares with its own `hf` backend) over a model: one that inference.py's loader built from a DCP step folder or a
Hugging Face folder (a DCP checkpoint is scored without converting it), or a run's sharded model. Tokenization follows
the `hf` backend's defaults (a text framed as its tokenizer frames one, data/tokenizers.py; an empty context replaced
by the tokenizer's BOS, or its end-of-text when it names none), so scores equal that backend's on the same weights
(tests/test_eval.py). lm-eval's own data parallelism is not wired here.

    loglikelihood           sum of log-probabilities of the continuation tokens after the context, and whether
                            greedy decoding would have produced them (multiple choice, cloze): what `scores` says
    loglikelihood_rolling   the whole text's log-likelihood over windows of the model's context (perplexity)
    generate_until          greedy (or sampled) continuation by what `continuations` gives (eval.py: generate.py's
                            Generator), cut at the stop strings

Imports lm-eval (an optional extra) at the top: eval.py says it is missing before it imports this module, and
downstream.py imports it only when a run scores tasks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from data.tokenizers import build_tokenizer
from errors import ConfigError
from inference import hf_tokenizer

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


# What continues a prompt for generate_until: (prompt tokens, at most this many new tokens, temperature (0: greedy),
# the stop id) -> the new tokens, up to and with the stop id. eval.py gives generate.py's Generator; the in-loop eval
# gives none (its ranks would not agree on how many forwards a generation takes).
Continuations = Callable[[list[int], int, float, int], list[int]]


class RecipeLM(TemplateLM):
    """lm-eval's model: `model` in one process (WholeModel scores it), or a run's `scores` (downstream.py's
    ShardedScores: the model as the run laid it out); generate_until through `continuations` when given."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer_path: str,
        *,
        batch_size: int = 8,
        max_gen_toks: int = 256,
        scores: Scores | None = None,
        max_length: int | None = None,
        continuations: Continuations | None = None,
    ):
        """`model` in one process; or `scores` (downstream.py's ShardedScores: the model as a run laid it out),
        with `max_length`, the longest sequence to score, and `model` that run's model, which then only
        log-likelihood tasks use. `continuations`: what generate_until continues prompts with (eval.py's, from
        generate.py); without it a generate_until task is refused."""
        super().__init__()
        self.model = model.eval() if scores is None else model
        self.tokenizer = hf_tokenizer(tokenizer_path)
        self.framing = build_tokenizer(tokenizer_path, key="--tokenizer").framing
        self.max_gen_toks = max_gen_toks
        self.max_length = max_length or model.args.max_seq_len
        self.scores = scores or WholeModel(model, batch_size=batch_size)
        self.continuations = continuations

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
        if self.continuations is None:
            names = ", ".join(sorted({str(req.task_name) for req in requests}))
            raise ConfigError(
                f"--tasks: {names} generates text, which this copy of the recipe cannot (it has no generate.py); "
                "list log-likelihood tasks (multiple choice, perplexity)"
            )
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        out = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            # (the hf backend's batch encoding: framed unless the context starts with the BOS's text)
            framed = not (self.tokenizer.bos_token and context.startswith(self.tokenizer.bos_token))
            prompt = self._encode(context, framed=framed)[-(self.max_length - max_new) :]
            text = self.tok_decode(self.continuations(prompt, max_new, temperature, self.eot_token_id))
            for stop in until:
                text = text.split(stop)[0] if stop else text
            out.append(text)
        return out
