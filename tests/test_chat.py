"""Chat fine-tuning (data/chat.py): a conversation's tokens and loss mask against transformers' own, the mask
through preparation and the loader's windows, the refusals, and `configs/finetune_chat.toml` on 2 ranks
against a cross-entropy over the answers computed from transformers' model."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from config import Data, load_config
from data.chat import IGNORE_INDEX, ChatRenderer, ChatWindows, assistant_mask
from data.corpus import TokenCorpus, open_corpus
from data.loader import GlobalBatchLoader
from data.mixture import open_mixture
from data.prepare import prepare
from data.sources import find_source
from data.tokenizers import build_tokenizer
from errors import ConfigError
from models.qwen3 import FAMILY as qwen3_family
from models.qwen3 import chat as qwen3_chat
from tests.launch import REPO, python, torchrun
from tests.tiny_hf import SHIPPED_TOKENIZER, tiny_hf_folder

CHAT = REPO / "assets" / "corpus" / "chat.jsonl"
CONVERSATIONS = [json.loads(line)["messages"] for line in CHAT.read_text().splitlines()]


def tokenizer_folder(tmp_path: Path, template: str | None, source: Path = SHIPPED_TOKENIZER) -> Path:
    """A copy of the shipped tokenizer (or of `source`) with another chat template (None: none)."""
    folder = tmp_path / "tokenizer"
    folder.mkdir(exist_ok=True)
    for file in source.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(config | ({"chat_template": template} if template else {}))
    )
    return folder


def transformers_render(folder: Path, messages: list[dict]) -> tuple[list[int], list[int]]:
    out = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


# ------------------------------------------------------------------ rendering


def test_tokens_and_mask_are_transformers_assistant_tokens(tmp_path: Path) -> None:
    """The shipped template marks the replies with {% generation %}: transformers' mask of them is ours. Without
    its marks (as Llama 3's has none) we find the same mask from the template's renderings alone."""
    theirs = AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER))
    unmarked = theirs.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    ours, plain = ChatRenderer(str(SHIPPED_TOKENIZER)), ChatRenderer(str(tokenizer_folder(tmp_path, unmarked)))
    assert ours.marked == theirs.chat_template and plain.marked is None  # the marks, and the renderings alone
    for i, messages in enumerate(CONVERSATIONS[:200]):
        out = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        expected = (list(out["input_ids"]), list(out["assistant_masks"]))
        for renderer in (ours, plain):
            ids, mask = renderer.render(messages, where=f"row {i}")
            assert (ids, mask.tolist()) == expected, i
    # A reply is the assistant's text and the EOS that closes its turn; nothing of the prompt counts.
    ids, mask = plain.render(CONVERSATIONS[1], where="row 1")
    assert theirs.decode([t for t, m in zip(ids, mask, strict=True) if m]) == 'A lion says "roar".<|end_of_text|>'
    assert plain.fingerprint != ours.fingerprint  # another template, another preparation


def test_what_cannot_be_rendered_is_one_line(tmp_path: Path) -> None:
    # A template that drops earlier replies once more turns follow (as Qwen3's drops earlier reasoning).
    forgetful = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    renderer = ChatRenderer(str(tokenizer_folder(tmp_path, forgetful)))
    two_turns = CONVERSATIONS[0]
    assert sum(m["role"] == "assistant" for m in two_turns) == 2
    with pytest.raises(ConfigError) as refused:
        renderer.render(two_turns, where="row 0")
    assert re.match(
        r"data.chat: the chat template of \S+ renders the turns before assistant turn \d+ of row 0 differently once "
        r"more turns follow, so its reply cannot be told apart, and no model family has a training variant of it; "
        r"mark what the assistant says in the template with \{% generation %\} ... \{% endgeneration %\}",
        str(refused.value),
    ), refused.value
    ours = ChatRenderer(str(SHIPPED_TOKENIZER))
    for row, problem in [
        ("hello", "data.messages_column: row 7 holds str, not a list of messages; point data.messages_column at"),
        ([{"content": "hi"}], "data.messages_column: row 7 has a message without a role"),
        ([{"role": "user", "content": ["hi"]}], "data.messages_column: row 7 has a user message whose content is not"),
    ]:
        with pytest.raises(ConfigError) as refused:
            ours.render(row, where="row 7")  # type: ignore[arg-type]
        assert str(refused.value).startswith(problem), refused.value
    for path in (str(tokenizer_folder(tmp_path, None)), "byte"):
        with pytest.raises(ConfigError, match=f"^data.chat: model.tokenizer_path {path} has no chat template"):
            ChatRenderer(path)


# ------------------------------------------------------------------ a template that re-renders earlier turns: Qwen3's

QWEN3_TOKENIZER = REPO / "assets" / "tokenizer_qwen3"
# The sha256 of Qwen3's chat template as its post-trained releases ship it (the text TRL identifies Qwen3 by,
# trl/chat_templates/qwen3.jinja).
QWEN3_TEMPLATE_SHA256 = "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"
REASONING = [  # thinking in the content, in reasoning_content, and a tool call
    [
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n2 plus 2 is 4."},
        {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n3 plus 3 is 6."},
    ],
    [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What does a cow say?"},
        {"role": "assistant", "content": 'A cow says "moo".', "reasoning_content": "Cows moo."},
        {"role": "user", "content": "And a lion?"},
        {"role": "assistant", "content": 'A lion says "roar".', "reasoning_content": "Lions roar."},
        {"role": "assistant", "content": "Both are loud.", "reasoning_content": "One more reply."},
    ],
    [
        {"role": "user", "content": "What day is it?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "today", "arguments": {}}}]},
        {"role": "tool", "content": "Tuesday"},
        {"role": "assistant", "content": "It is Tuesday."},
    ],
]  # fmt: skip


def chatml_replies(text: str) -> list[tuple[int, int]]:
    """The characters of each assistant turn of a ChatML rendering: after its header, through its <|im_end|>."""
    return [
        (header.end(), text.index("<|im_end|>", header.end()) + len("<|im_end|>"))
        for header in re.finditer(r"<\|im_start\|>assistant\n", text)
    ]


def test_qwen3s_template_is_trained_through_its_marked_variant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's chat template drops earlier turns' reasoning once a user turn follows, so their replies cannot be found
    from its renderings; models/qwen3/'s marked variant of it renders the same text, and the mask is transformers'
    mask of the variant: each assistant turn after its header, through its <|im_end|>."""
    renderer, hf = ChatRenderer(str(QWEN3_TOKENIZER)), AutoTokenizer.from_pretrained(str(QWEN3_TOKENIZER))
    assert hashlib.sha256(hf.chat_template.encode()).hexdigest() == QWEN3_TEMPLATE_SHA256  # recognized by its text
    assert (renderer.marked_by, renderer.marked) == ("qwen3", qwen3_chat.TRAINING)
    assert sum(m[0]["role"] == "system" for m in CONVERSATIONS) > 0 and max(len(m) for m in CONVERSATIONS) >= 6
    marked = qwen3_chat.TRAINING
    for i, messages in enumerate(CONVERSATIONS + REASONING):
        text = hf.apply_chat_template(messages, tokenize=False)
        assert hf.apply_chat_template(messages, chat_template=marked, tokenize=False) == text, i
        ids, mask = renderer.render(messages, where=f"row {i}")
        out = hf.apply_chat_template(
            messages, chat_template=marked, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert (ids, mask.tolist()) == (list(out["input_ids"]), list(out["assistant_masks"])), i
        ((_, offsets),) = renderer.tokenizer.encode_with_offsets([text])
        assert np.array_equal(mask, assistant_mask(offsets, chatml_replies(text))), i
    # Thinking: kept in the turns after the last user query (an empty block in the last one without any), dropped
    # from earlier ones, as the template renders the whole conversation.
    for messages, counted in zip(REASONING, [
        "2 plus 2 is 4.<|im_end|><think>\nThree and three.\n</think>\n\n3 plus 3 is 6.<|im_end|>",
        'A cow says "moo".<|im_end|><think>\nLions roar.\n</think>\n\nA lion says "roar".<|im_end|>'
        "<think>\nOne more reply.\n</think>\n\nBoth are loud.<|im_end|>",
        '<tool_call>\n{"name": "today", "arguments": {}}\n</tool_call><|im_end|><think>\n\n</think>\n\nIt is Tuesday.'
        "<|im_end|>",
    ], strict=True):  # fmt: skip
        ids, mask = renderer.render(messages, where="")
        assert hf.decode([t for t, m in zip(ids, mask, strict=True) if m]) == counted

    # Not the official text (here one more newline, which renders the same): not recognized, and refused.
    other = ChatRenderer(str(tokenizer_folder(tmp_path, hf.chat_template + "\n", source=QWEN3_TOKENIZER)))
    assert other.marked is None
    with pytest.raises(ConfigError, match=r"^data.chat: the chat template of \S+ renders the turns before assistant"):
        other.render(REASONING[0], where="row 0")
    # A variant that renders otherwise, or a tokenizer.json that transformers' tokenizer does not match: one line.
    broken = copy.copy(renderer)
    broken.marked = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    with pytest.raises(ConfigError, match=r"^data.chat: models/qwen3/'s training variant of the chat template of \S+ "
                       "renders row 3 differently from the template; mark the replies in the folder's own"):  # fmt: skip
        broken.render(REASONING[0], where="row 3")
    broken = copy.copy(renderer)
    broken.tokenizer = build_tokenizer(str(SHIPPED_TOKENIZER))
    with pytest.raises(ConfigError, match=r"^data.chat: transformers' tokenizer of \S+ tokenizes row 3 differently"):
        broken.render(REASONING[0], where="row 3")

    # The variant is a part of the fingerprint that prepared data records: another variant, another mask.
    without_im_end = qwen3_chat.TRAINING.replace(
        "{{- '<|im_end|>' }}\n        {%- endgeneration %}", "{%- endgeneration %}\n        {{- '<|im_end|>' }}"
    )
    monkeypatch.setitem(qwen3_chat.TRAINING_CHAT_TEMPLATES, qwen3_chat.OFFICIAL, without_im_end)
    changed = ChatRenderer(str(QWEN3_TOKENIZER))
    assert changed.fingerprint != renderer.fingerprint
    ids, mask = changed.render(REASONING[2], where="")
    assert hf.decode([t for t, m in zip(ids, mask, strict=True) if m]).endswith("It is Tuesday.")


def test_the_qwen3_tokenizer_is_its_script_s_and_fits_the_qwen3_debug_model(tmp_path: Path) -> None:
    """assets/tokenizer_qwen3 is what scripts/make_qwen3_tokenizer.py writes, byte for byte: the shipped BPE, its
    ordinary tokens' ids unchanged, with Qwen3's special tokens, no BOS, EOS <|im_end|>, within the Qwen3 debug
    model's 2,048 embeddings."""
    assert python("scripts/make_qwen3_tokenizer.py", "--out", str(tmp_path / "t")).returncode == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "t" / name).read_bytes() == (QWEN3_TOKENIZER / name).read_bytes(), name
    ours, hf = build_tokenizer(str(QWEN3_TOKENIZER)), AutoTokenizer.from_pretrained(str(QWEN3_TOKENIZER))
    assert ours.vocab_size == len(hf) == qwen3_family.flavors["debugmodel"].vocab_size
    specials = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2045, "<think>": 2046, "</think>": 2047}
    assert hf.convert_tokens_to_ids(list(specials)) == list(specials.values())
    assert (hf.bos_token, hf.eos_token, hf.pad_token, ours.eos_id) == (None, "<|im_end|>", "<|endoftext|>", 2045)
    text = "<|im_start|>user\nWhat does a cow say?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nMoo."
    assert hf(text)["input_ids"] == ours.encode_batch([text])[0]  # a text is its tokens alone
    shipped = AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER)).get_vocab()
    dropped = {"<|begin_of_text|>", "<|end_of_text|>", "\u0120rise", "\u0120shadows", "\u0120Cookies"}
    assert hf.get_vocab() == {t: i for t, i in shipped.items() if t not in dropped} | specials
    assert hf.tokenize(" rise") == ["\u0120r", "ise"]  # a dropped merge's word: two tokens


# ------------------------------------------------------------------ prepared data and windows


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped chat corpus prepared in 3 shards (the windows straddle none: each holds whole conversations)."""
    source = dataclasses.replace(find_source(str(CHAT), text_column="messages"), chat=True)
    folder = tmp_path_factory.mktemp("chat") / "prepared"
    prepare(source, str(SHIPPED_TOKENIZER), folder, workers=0, chunk_bytes=100_000)
    return folder


@pytest.mark.parametrize("pad", [False, True])
def test_windows_hold_whole_conversations_and_label_only_the_replies(prepared: Path, pad: bool) -> None:
    corpus = TokenCorpus(prepared)
    assert len(corpus.manifest["shards"]) == 3 and corpus.manifest["documents"] == len(CONVERSATIONS)
    window, renderer = 193, ChatRenderer(str(SHIPPED_TOKENIZER))  # the longest conversation has 188 tokens
    ld = GlobalBatchLoader(
        corpus, window=window, local_batch_size=2, global_batch_size=4, dp_rank=0, dp_degree=1, pad_samples=pad
    )
    chat, eos = ld.chat[0], renderer.tokenizer.eos_id
    assert chat is not None and chat.count == ld.num_windows
    for j in range(chat.count):  # every window: its conversations whole and in corpus order, then padding
        tokens, segments, mask = chat.get(j)
        first, n = int(chat.first[j]), int(chat.first[j + 1] - chat.first[j])
        assert n == 1 if pad else n >= 1
        for d in range(n):
            ids, expected = renderer.render(CONVERSATIONS[first + d], where="")
            at = np.flatnonzero(segments == d)
            assert tokens[at].tolist() == ids and np.array_equal(mask[at], expected)
        padding = segments == n
        assert (tokens[padding] == eos).all() and (mask[padding] == 0).all() and segments.max() <= n
    assert int(chat.first[-1]) == len(CONVERSATIONS)
    for _ in range(10):  # the labels: token t + 1 where it is the assistant's, else IGNORE_INDEX
        first = ld.sample_index
        step = list(ld.next_step())
        for row, labels in enumerate(torch.cat([b.labels for b in step])):
            tokens, _, mask, _ = ld.sample(first + row)
            assert labels.tolist() == np.where(mask[1:] == 1, tokens[1:], IGNORE_INDEX).tolist()
        counted = sum(int((b.labels != IGNORE_INDEX).sum()) for b in step)
        # The divisor makes the step's loss the mean over its counted labels (2 rows per micro-batch).
        assert step[0].loss_divisor == pytest.approx(counted / (2 * (window - 1)))
    # Shorter windows cut the longer conversations to them (and say so).
    lengths = [len(renderer.render(m, where="")[0]) for m in CONVERSATIONS]
    short = ChatWindows(corpus, 129, pad=pad)
    assert short.cut == sum(n > 129 for n in lengths) > 0 and int(short.lengths.max()) == 129


def test_chat_settings_that_cannot_work_are_one_line(prepared: Path, tmp_path: Path) -> None:
    tokenizer, path = build_tokenizer(str(SHIPPED_TOKENIZER)), str(SHIPPED_TOKENIZER)
    cache = str(tmp_path / "cache")
    with pytest.raises(
        ConfigError, match=r"^data.chat: .*prepared was not prepared as plain text; set data.chat = true"
    ):
        open_corpus(Data(path=str(prepared), cache_folder=cache), tokenizer, path)
    with pytest.raises(
        ConfigError, match=r"^data.chat: .*prepared was not prepared as plain text; set data.chat = true"
    ):
        open_mixture(Data(mixture=[str(prepared)], cache_folder=cache), tokenizer, path)
    mixed = open_mixture(Data(mixture=[str(prepared)], chat=True), tokenizer, path)  # chat folders: chat windows
    ld = GlobalBatchLoader(mixed, window=193, local_batch_size=2, global_batch_size=2, dp_rank=0, dp_degree=1)
    assert ld.chat[0] is not None and (next(ld.next_step()).labels == IGNORE_INDEX).any()
    plain = REPO / "assets" / "corpus" / "stories_validation.jsonl"
    with pytest.raises(ConfigError, match="^data.messages_column: document 0 of .* has no column 'messages'"):
        open_corpus(Data(path=str(plain), chat=True, cache_folder=cache), tokenizer, path)
    base = ["--config", "configs/finetune_chat.toml", f"--model.hf_assets_path={REPO / 'assets/tokenizer'}"]
    for extra, problem in [
        (["--model.attn_mask_type=causal"], 'data.chat: packed conversations would attend to each other under '
         'model.attn_mask_type = "causal"; set model.attn_mask_type = "block_causal", or data.pad_samples = true'),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as refused:
            load_config([*base, *extra])
        assert problem in refused.value.problems, refused.value.problems


FORGETFUL = (  # drops earlier replies once more turns follow: refused (test_what_cannot_be_rendered_is_one_line)
    "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_template_refused_while_the_cache_is_prepared_leaves_it_empty_and_is_told_once_on_two_ranks(
    tmp_path: Path,
) -> None:
    """A new user's path: the chat template is refused while train.py prepares raw chat data into the cache, and they
    try again with the same tokenizer files copied to another folder, on 2 ranks. The refusal leaves nothing in the
    cache, so the second try is refused for the same reason, not for a half-made folder the first left (its tokenizer
    path differs, its cache key does not); rank 0 tells it in one line, and rank 1, which tokenized nothing (the corpus
    is one chunk, rank 0's), prints nothing: it leaves with rank 0 instead of failing in a collective rank 0 left."""
    first = tokenizer_folder(tmp_path, FORGETFUL)
    cache = tmp_path / "cache"
    refusal = r"data.chat: the chat template of {} renders the turns before assistant turn 2 of document 0 of {}"
    with pytest.raises(ConfigError, match="^" + refusal.format(first, CHAT)):
        open_corpus(Data(path=str(CHAT), chat=True, cache_folder=str(cache)), build_tokenizer(str(first)), str(first))
    assert list(cache.iterdir()) == []
    copied = tmp_path / "copied"
    copied.mkdir()
    for file in first.iterdir():
        (copied / file.name).write_bytes(file.read_bytes())
    proc = torchrun(
        "train.py",
        "--config",
        "configs/debug.toml",
        f"--model.tokenizer_path={copied}",
        f"--data.path={CHAT}",
        "--data.chat",
        "--model.attn_mask_type=block_causal",
        f"--data.cache_folder={cache}",
        f"--job.dump_folder={tmp_path / 'run'}",
        nproc=2,
        check=False,
    )
    told = [line for line in proc.stderr.splitlines() if not line.startswith("warning: ")]
    assert proc.returncode != 0 and len(told) == 1, proc.stderr[-3000:]
    assert re.match("^error: " + refusal.format(copied, CHAT), told[0]), told
    assert list(cache.iterdir()) == []


# ------------------------------------------------------------------ the command, against transformers


def test_chat_fine_tune_on_two_ranks_is_transformers_cross_entropy_over_the_replies(tmp_path: Path) -> None:
    """configs/finetune_chat.toml through the CLI, FSDP over 2 ranks: the first step's loss is the cross-entropy of
    transformers' model over the assistant tokens of the first global batch's conversations (as transformers
    renders and masks them), each conversation scored alone: the packing and the document masks change nothing.
    The held-out loss after it is the same of transformers' model of the run's own export, on the held-out chat."""
    hf_folder = tiny_hf_folder(tmp_path / "hf", seed=3)
    dump, seq, local_bs = tmp_path / "run", 191, 2  # windows of 192 tokens: no conversation is cut
    run = torchrun(
        "train.py",
        "--config",
        "configs/finetune_chat.toml",
        f"--model.hf_assets_path={hf_folder}",
        "--model.shape_from_hf_config",
        f"--job.dump_folder={dump}",
        f"--data.cache_folder={tmp_path / 'cache'}",
        "--training.steps=1",
        f"--training.seq_len={seq}",
        f"--training.local_batch_size={local_bs}",
        "--training.mixed_precision_param=float32",
        "--activation_checkpoint.mode=none",
        "--metrics.log_freq=1",
        "--checkpoint.export_dtype=float32",
        "--validation.enable",
        "--validation.dataset_path=assets/corpus/chat_validation.jsonl",
        f"--validation.seq_len={seq}",
        "--validation.steps=-1",
        nproc=2,
    )
    assert "world 2 = replicate 1 x shard 2 x tp 1" in run.stdout, run.stdout
    step1, held_out = (json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()[:2])

    # The first global batch: 2 ranks x 2 windows of seq + 1 tokens, conversations packed whole in corpus order.
    rendered = [transformers_render(hf_folder, m) for m in CONVERSATIONS[:64]]
    windows, used = [[]], 0
    for ids, mask in rendered:
        if used + len(ids) > seq + 1:
            windows.append([])
            used = 0
        windows[-1].append((ids, mask))
        used += len(ids)
    first_batch = [conversation for window in windows[: 2 * local_bs] for conversation in window]
    expected = answer_cross_entropy(hf_folder, first_batch)
    measured = f"2-rank chat step-1 loss {step1['loss']!r} vs transformers' {expected!r}"
    print(measured)
    assert abs(step1["loss"] - expected) <= 1e-4 * expected, measured

    # The held-out loss after the step: transformers' model of the step's own export, every held-out conversation.
    held_out_rows = (REPO / "assets" / "corpus" / "chat_validation.jsonl").read_text().splitlines()
    rendered = [transformers_render(hf_folder, json.loads(line)["messages"]) for line in held_out_rows]
    expected = answer_cross_entropy(dump / "checkpoint" / "step-1-hf", rendered)
    measured = f"held-out chat loss {held_out['validation_loss']!r} vs transformers' {expected!r}"
    print(measured)
    assert abs(held_out["validation_loss"] - expected) <= 1e-4 * expected, measured


def answer_cross_entropy(model_folder: Path, conversations: list[tuple[list[int], list[int]]]) -> float:
    """transformers' model's cross-entropy over the assistant tokens of (ids, mask) conversations, each alone."""
    hf = AutoModelForCausalLM.from_pretrained(model_folder, torch_dtype=torch.float32)
    total, counted = 0.0, 0
    with torch.no_grad():
        for ids, mask in conversations:
            logits = hf(torch.tensor([ids])).logits[0, :-1]
            labels = torch.where(torch.tensor(mask[1:]).bool(), torch.tensor(ids[1:]), IGNORE_INDEX)
            total += F.cross_entropy(logits, labels, reduction="sum").item()
            counted += int((labels != IGNORE_INDEX).sum())
    return total / counted


def test_the_readmes_chat_commands_fine_tune_a_checkpoint_and_answer(seed: Path, tmp_path: Path) -> None:
    """README's "Fine-tune on chat data" as written, on the seed checkpoint instead of `make train`'s step 100, for 2
    steps instead of 40, into a temporary folder."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("## Fine-tune on chat data") :], flags=re.S)[1]
    train, ask = block.strip().splitlines()
    assert (
        "--checkpoint.initial_load_path=outputs/debug/checkpoint/step-100" in train and "--training.steps=40" in train
    )
    dump = tmp_path / "debug_chat"
    train = (
        train.replace("outputs/debug/checkpoint/step-100", str(seed))
        .replace("--training.steps=40", "--training.steps=2")
        .replace("outputs/debug_chat", str(dump))
    )
    nproc, script, *args = shlex.split(train.removeprefix(".venv/bin/torchrun "))
    run = torchrun(script, *args, nproc=int(nproc.removeprefix("--nproc_per_node=")))
    assert f"initialized model weights from {seed}" in run.stdout and "validation at step 2" in run.stdout
    # The banner: configs/debug.toml's description with what the command changes, and the data this run reads.
    description, numbers = run.stdout.splitlines()[:2]
    said = "Llama 3 debug model, shipped synthetic corpus (the config's description; the command line changes "
    assert description.startswith(said) and "data.path" in description and "data.chat" in description, description
    assert " tokens of assets/corpus/chat.jsonl (chat) | " in numbers, numbers
    ask = ask.replace(".venv/bin/python", sys.executable).replace("outputs/debug_chat", str(dump))
    ask = ask.replace("step-40", "step-2")
    proc = subprocess.run(["bash", "-c", ask], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("What does a cow say?"), proc.stderr[-3000:]


def test_the_readmes_qwen3_chat_commands_fine_tune_from_scratch_and_answer(tmp_path: Path) -> None:
    """docs/data.md's Qwen3 lines of "Chat fine-tuning" as written, for 2 steps instead of 100, into a temporary
    folder: Qwen3's debug model trains on the conversations as Qwen3's template renders them, validates on the
    held-out ones, and its checkpoint answers a question in that template."""
    text = (REPO / "docs" / "data.md").read_text()
    section = text[text.index("## Chat fine-tuning") :]
    train, ask = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0].strip().splitlines()
    assert "--model.tokenizer_path=assets/tokenizer_qwen3" in train and "--training.steps=100" in train
    dump = tmp_path / "qwen3_debug_chat"
    train = train.replace("--training.steps=100", "--training.steps=2").replace("outputs/qwen3_debug_chat", str(dump))
    nproc, script, *args = shlex.split(train.removeprefix(".venv/bin/torchrun "))
    run = torchrun(script, *args, nproc=int(nproc.removeprefix("--nproc_per_node=")))
    assert "validation at step 1" in run.stdout and "validation at step 2" in run.stdout, run.stdout
    ask = ask.replace(".venv/bin/python", sys.executable).replace("outputs/qwen3_debug_chat", str(dump))
    ask = ask.replace("step-100", "step-2")
    proc = subprocess.run(["bash", "-c", ask], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("What does a cow say?"), proc.stderr[-3000:]
