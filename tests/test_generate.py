"""generate.py and the KV cache: tokens equal transformers' greedy `generate` for every family, the cache
equals recomputing the whole sequence, sampling repeats with its seed, the compiled decode step is compiled
once, the host reads no value per decoded token, and a cache can never reach a training forward
(docs/failures.md #2).

Reference models: tests/tiny_hf.py's random transformers models in fp32 with O(1) logits, so that greedy
choices are not near ties that float32 rounding could flip."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import generate
from config import ActivationCheckpoint
from data.tokenizers import build_tokenizer
from errors import ConfigError
from generate import STOP_CHECK_EVERY, Generator, Sampling, encode_prompts
from models.hf import from_hf
from models.kv_cache import KVCache
from models.llama3 import FLAVORS, Transformer
from models.llama3.plans import SAC_SAVED_LINEARS
from parallelisms.ac import apply_ac
from tests.launch import REPO, python, torchrun
from tests.tiny_hf import SHIPPED_TOKENIZER, save_hf_folder, tiny_hf_model

NEW_TOKENS = 48


class HostReads(TorchFunctionMode):
    """Counts the calls that bring a tensor's value to the host (on a GPU each waits for the device to finish)."""

    READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "nonzero", "masked_select")

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        if (name := getattr(func, "__name__", "")) in self.READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module", params=["llama3", "qwen3", "olmo2"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A random transformers model and ours loaded from its saved folder."""
    reference = tiny_hf_model(family=request.param, seed=1)
    folder = save_hf_folder(reference, tmp_path_factory.mktemp(request.param) / "hf")
    ours, _ = from_hf(folder)
    return reference, ours.eval(), folder


def prompts_of(vocab: int, lengths: tuple[int, ...] = (5, 11, 8), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], *, eos: int | None) -> list[list[int]]:
    """transformers' generate(do_sample=False) on the prompts left-padded, cut after the first EOS."""
    width = max(len(p) for p in prompts)
    ids, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p), 1
    out = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=eos
    )
    rows = out[:, width:].tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


def test_greedy_tokens_equal_transformers_generate_for_a_batch_of_prompts_of_different_lengths(pair: tuple) -> None:
    reference, ours, _ = pair
    prompts = prompts_of(reference.config.vocab_size)
    eos = 7  # a token the random model does emit in some rows: the rows stop at different steps
    generator = Generator(ours)
    ours_tokens = generator.generate(prompts, max_new_tokens=NEW_TOKENS, stop_ids=[eos])
    assert ours_tokens == hf_greedy(reference, prompts, eos=eos)
    assert ours_tokens == hf_greedy(reference, prompts, eos=None) or any(eos in row for row in ours_tokens)
    with HostReads() as reads:  # the first call's decode state, reused
        no_stop = generator.generate(prompts, max_new_tokens=NEW_TOKENS)
    assert no_stop == hf_greedy(reference, prompts, eos=None) and all(len(row) == NEW_TOKENS for row in no_stop)
    # No host read per token: whether every row stopped, once every STOP_CHECK_EVERY tokens; the tokens at the end.
    assert reads.counts == {"__bool__": -(-(NEW_TOKENS - 1) // STOP_CHECK_EVERY), "tolist": 1}, reads.counts


@pytest.mark.parametrize("convention", ["llama3", "smollm2", "qwen3"])
def test_greedy_text_equals_transformers_generate_on_its_own_tokenization_in_each_tokenizer_convention(
    convention: str, tmp_path: Path
) -> None:
    """Prompts framed as the tokenizer frames them (Llama 3's BOS first; SmolLM2's and Qwen3's nothing), so a
    batch of texts of different lengths continues as transformers continues `tokenizer(texts)`."""
    from transformers import AutoTokenizer

    reference = tiny_hf_model(family="llama3", seed=1)
    folder = save_hf_folder(reference, tmp_path / "hf", convention=convention)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    texts = ["Once upon a time", "The dog", "She said that the little bird was"]
    ours = encode_prompts(texts, build_tokenizer(str(folder)), str(folder), chat=False)
    assert ours == [theirs(t)["input_ids"] for t in texts] and len({len(p) for p in ours}) == 3
    model, _ = from_hf(folder)
    eos = theirs.eos_token_id
    assert Generator(model.eval()).generate(ours, max_new_tokens=NEW_TOKENS, stop_ids=[eos]) == hf_greedy(
        reference, [theirs(t)["input_ids"] for t in texts], eos=eos
    )


def test_decoding_from_the_cache_equals_recomputing_the_whole_sequence(pair: tuple) -> None:
    _, ours, _ = pair
    tokens = torch.tensor(prompts_of(ours.args.vocab_size, (40,)))
    with torch.no_grad():
        whole = ours(tokens)
        cache = KVCache.for_model(ours, torch.tensor([0]), max_len=64)  # longer than the sequence
        for buffer in [*cache.keys.values(), *cache.values.values()]:
            buffer.normal_()  # what an earlier batch left there: masked until written
        steps = [ours(tokens[:, :10], positions=torch.arange(10), cache=cache)]
        steps += [ours(tokens[:, i : i + 1], positions=torch.tensor([i]), cache=cache) for i in range(10, 40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=0)


def test_a_left_padded_row_gives_the_logits_of_the_prompt_alone(pair: tuple) -> None:
    """RoPE is relative: a prompt starting at cache position 6 (after padding) computes what it does at 0."""
    _, ours, _ = pair
    prompt = prompts_of(ours.args.vocab_size, (5,))[0]
    with torch.no_grad():
        alone = ours(torch.tensor([prompt]))
        padded = torch.tensor([[0] * 6 + prompt])
        cached = ours(padded, positions=torch.arange(11), cache=KVCache.for_model(ours, torch.tensor([6]), max_len=11))
    torch.testing.assert_close(cached[:, 6:], alone, atol=1e-5, rtol=0)


def test_sampling_repeats_with_its_seed_and_top_k_1_is_greedy(pair: tuple) -> None:
    _, ours, _ = pair
    prompts = prompts_of(ours.args.vocab_size)
    warm, sampler = Sampling(temperature=1.0, top_k=50, top_p=0.9), Generator(ours)
    with HostReads() as reads:
        first = sampler.generate(prompts, max_new_tokens=16, sampling=warm, seed=1)
    assert reads.counts == {"__bool__": 1, "tolist": 1}, reads.counts  # the draws too stay on the device
    again, other = (sampler.generate(prompts, max_new_tokens=16, sampling=warm, seed=s) for s in (1, 2))
    assert first == again and first != other
    greedy = Generator(ours).generate(prompts, max_new_tokens=16)
    assert Generator(ours).generate(prompts, max_new_tokens=16, sampling=Sampling(1.0, top_k=1), seed=3) == greedy


def test_top_p_keeps_the_smallest_set_of_likeliest_tokens_with_that_mass() -> None:
    from generate import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {sample(logits, Sampling(1.0, top_p=0.7), torch.Generator().manual_seed(s)).item() for s in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    assert {sample(logits, Sampling(1.0, top_p=0.4), None).item() for _ in range(50)} == {0}


def test_the_compiled_decode_step_is_compiled_once_and_never_recompiled(tmp_path: Path) -> None:
    """48 tokens, then another batch of the same size whose cache rounds to the same length: one graph, and the
    first batch's decode state reused, whatever it left in the cache never read. (On a tiny Llama only: the decode
    step is the generator's, the same for every family.)"""
    from torch._dynamo.utils import counters

    ours, _ = from_hf(save_hf_folder(tiny_hf_model(family="llama3", seed=1), tmp_path / "hf"))
    ours.eval()
    torch._dynamo.reset()
    counters.clear()
    prompts = prompts_of(ours.args.vocab_size)
    generator = Generator(ours, compile=True)
    compiled = generator.generate(prompts, max_new_tokens=NEW_TOKENS)
    state = generator._state  # its cache and tensors: on a GPU, what the captured graph replays on
    compiled += generator.generate(prompts_of(ours.args.vocab_size, (3, 9, 4), seed=1), max_new_tokens=NEW_TOKENS)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters["stats"])
    assert generator._state is state and not generator.cuda_graphs  # (CPU: compiled, no graph)
    eager = Generator(ours).generate(prompts, max_new_tokens=NEW_TOKENS)
    eager += Generator(ours).generate(prompts_of(ours.args.vocab_size, (3, 9, 4), seed=1), max_new_tokens=NEW_TOKENS)
    assert compiled == eager
    torch._dynamo.reset()


# ------------------------------------------------ the cache never reaches training


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    args = FLAVORS["debugmodel"].__class__(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64)
    model = Transformer(args)
    model.init_weights()
    return model


def train_under_ac(model: Transformer, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A few AdamW steps of `model` under selective op AC: the losses and the final weights."""
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"), saved_linears=SAC_SAVED_LINEARS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(5))
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_training_under_ac_is_bit_for_bit_unchanged_after_generating_with_the_same_model() -> None:
    straight = train_under_ac(tiny_model())
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Generator(model).generate(prompts_of(256), max_new_tokens=12)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing kept in the model
    after = train_under_ac(model)
    assert after[0] == straight[0]
    assert all(torch.equal(straight[1][k], v) for k, v in after[1].items())


def test_a_cache_is_refused_with_grad_enabled_under_ac_and_under_fsdp(tmp_path: Path) -> None:
    model, tokens = tiny_model(), torch.tensor([[1, 2, 3]])
    cache = lambda: KVCache.for_model(model, torch.tensor([0]), max_len=8)  # noqa: E731
    with pytest.raises(RuntimeError, match="for inference only; call the model under torch.no_grad"):
        model(tokens, positions=torch.arange(3), cache=cache())
    with torch.no_grad(), pytest.raises(ValueError, match="pass positions="):
        model(tokens, cache=cache())
    apply_ac(model, ActivationCheckpoint(mode="full"))
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"layers.0 \(CheckpointedTransformerBlock\) is wrapped"):
        model(tokens, positions=torch.arange(3), cache=cache())

    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        sharded = tiny_model()
        fully_shard(sharded)
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"the model \(FSDPTransformer\) is wrapped"):
            sharded(tokens, positions=torch.arange(3), cache=cache())
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------- the command


def test_the_command_generates_from_an_hf_folder_and_from_a_dcp_step_with_its_config_beside_it(
    pair: tuple, seed: Path, tmp_path: Path
) -> None:
    """A Hugging Face folder on one process and tensor-parallel on two, and train.py's seed checkpoint, whose config.toml train.py wrote
    beside it; bad input in one line, exit 2."""
    reference, _, folder = pair
    if reference.config.model_type != "llama":  # the tiny Qwen3 embeds 512 tokens, the shipped tokenizer has 2048
        with pytest.raises(ConfigError, match="gives token id .* but the model embeds only 512 tokens"):
            generate.main(["--checkpoint", str(folder), "--prompt", "Once upon a time"])
        return
    args = [
        "--checkpoint",
        str(folder),
        "--prompt",
        "Once upon a time",
        "--prompt",
        "The dog",
        "--max-new-tokens",
        "24",
    ]
    proc = python("generate.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("Once upon a time") and "\nThe dog" in proc.stdout
    assert "prefill: " in proc.stderr and "tokens/s); decode: " in proc.stderr
    # Tensor parallel over 2 ranks with the family's plan (for models one GPU cannot hold): the same tokens.
    tp = torchrun("generate.py", *args, nproc=2)
    assert tp.stdout == proc.stdout, (tp.stdout, proc.stdout)
    # README's command after `make train`, on the seed checkpoint instead of step 100 (the debug model too).
    assert (seed.parent / "config.toml").is_file()
    text = (REPO / "README.md").read_text()
    command = re.search(r"```bash\n(.*?)```", text[text.index("## Generate and evaluate") :], flags=re.S)[1].strip()
    assert command.startswith(".venv/bin/python generate.py --checkpoint outputs/debug/checkpoint/step-100 "), command
    command = command.replace(".venv/bin/python", sys.executable).replace(
        "outputs/debug/checkpoint/step-100", str(seed)
    )
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("Once upon a time"), proc.stderr[-3000:]

    lonely = tmp_path / "step-3"
    lonely.mkdir()
    for argv, problem in [
        (["--checkpoint", str(lonely)], f"--config: no config.toml beside {lonely} (train.py writes one when it "),
        # train.py's dump folder and its checkpoint folder, where a step folder is wanted: its newest step named.
        (["--checkpoint", str(seed.parent.parent)], f"--checkpoint: {seed.parent.parent} is a run folder; point it "
         f"at one of its step folders, e.g. {seed}"),
        (["--checkpoint", str(seed.parent)], f"--checkpoint: {seed.parent} is a checkpoint folder; point it at one of "
         f"its step folders, e.g. {seed}"),
        (["--checkpoint", str(folder), "--max-new-tokens", "300"], "--max-new-tokens: the longest prompt (3 tokens) "
         "plus 300 new ones exceeds the model's 256 positions"),
        (["--checkpoint", str(folder), "--top-p", "0"], "--top-p: must be in (0, 1]"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as refused:
            generate.main([*argv, "--prompt", "Hi"])
        assert refused.value.problems[0].startswith(problem), refused.value.problems


def test_chat_prompts_are_the_tokenizer_templates_tokens(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for file in SHIPPED_TOKENIZER.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours = encode_prompts(["Hello there", "Hi"], build_tokenizer(str(folder)), str(folder), chat=True)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    expected = [
        theirs.apply_chat_template([{"role": "user", "content": t}], tokenize=True) for t in ["Hello there", "Hi"]
    ]
    assert ours == [list(e["input_ids"]) if hasattr(e, "keys") else list(e) for e in expected]
    shipped = str(REPO / "assets" / "tokenizer")
    plain = encode_prompts(["Hello there"], build_tokenizer(shipped), shipped, chat=False)[0]
    assert plain[0] == theirs.bos_token_id and len(plain) < len(ours[0])
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as refused:
        encode_prompts(["Hi"], build_tokenizer(str(folder)), str(folder), chat=True)
    assert str(refused.value) == f"--chat: {folder} has no chat_template (tokenizer_config.json); drop --chat"


def test_chat_replies_are_printed_under_their_prompts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """README: with --chat each reply is printed under its prompt and a `---` line; without it the completion
    continues the prompt."""
    folder = save_hf_folder(tiny_hf_model(seed=1), tmp_path / "hf")  # with the shipped tokenizer's chat template
    args = ["--checkpoint", str(folder), "--prompt", "What does a cow say?", "--prompt", "Hi", "--max-new-tokens", "8"]
    assert generate.main([*args, "--chat"]) == 0
    chat = capsys.readouterr().out
    assert chat.startswith("What does a cow say?\n---\n") and "\n\nHi\n---\n" in chat, chat
    assert generate.main(args) == 0
    plain = capsys.readouterr().out
    assert plain.startswith("What does a cow say?") and not plain.startswith("What does a cow say?\n---\n"), plain
