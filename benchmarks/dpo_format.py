"""DPO that counts the chat format's tokens vs DPO that masks them (docs/failures.md #8, dpo.mask_format_tokens):
what the end-of-turn token and the greedy replies do after the same DPO steps from the same chat model.

    python -m benchmarks.dpo_format --out outputs/bench/dpo_format.json

One run, every model made in it through train.py on 2 CPU ranks (gloo), from one seed: the debug Llama (6.2M
parameters) chat-tuned from random initialization on assets/corpus/chat.jsonl for `--sft-steps` steps (the start: it
answers in the corpus's format and ends its turn), then from that checkpoint `--steps` DPO steps on the first
`--pairs` pairs of assets/corpus/preferences.jsonl at the fine-tune's last learning rate (`--lr`), once with the
format tokens counted (dpo.mask_format_tokens = false, configs/fixes/8_dpo_format_tokens.toml) and once masked (the
default), the same pairs in the same order, plain DPO (the sigmoid loss, beta 0.1, no NLL term). The shipped
template closes every assistant reply with <|end_of_text|> and has no header inside the reply, so that one token per
reply is what the two runs differ in. Then the start and both results are scored on the first `--held-out` pairs of
assets/corpus/preferences_validation.jsonl (none of them trained on; its questions are arithmetic the training pairs
do not ask, which the debug model mostly gets wrong). `--start STEP` begins from a chat model of yours instead (the
README's outputs/debug_chat/checkpoint/step-40).

    P(end of turn)    the probability of the <|end_of_text|> that closes the chosen (the rejected) reply, given the
                      prompt and the reply's text: the mean over the held-out pairs
    reply accuracy    the share of held-out pairs whose chosen reply's text (its own tokens only, both sides alike)
                      gained more log-probability from the start than the rejected one's did: DPO's reward
                      accuracy on held-out pairs, measured the same way for both runs
    greedy replies    to each held-out prompt, at most `--new-tokens` tokens: the share that never end their turn
                      (run on), that hold some 3 tokens twice (repeat), that end their turn before half as
                      many tokens as the chosen reply's text (cut short), and that are the chosen reply (right)

No timing is compared: the two runs go one after the other and their numbers do not depend on the order.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import Row
from config import REPO

PROBLEM = "#8 DPO format tokens"
SIDES = {"counted": False, "masked": True}  # broken, fixed: dpo.mask_format_tokens
TOKENIZER = "assets/tokenizer"
COMMON = [
    "--config", "configs/debug.toml", "--data.chat", "--model.attn_mask_type=block_causal",
    "--validation.enable=false", "--eval.enable=false", "--metrics.log_freq=1",
]  # fmt: skip


def train(dump: Path, steps: int, extra: list[str], *, args: argparse.Namespace) -> Path:
    """train.py on 2 CPU ranks into `dump`, its last step saved; that step's folder."""
    (dump / "metrics.jsonl").unlink(missing_ok=True)  # metrics.jsonl appends
    proc = harness.run_python(
        "train.py",
        *COMMON,
        f"--job.dump_folder={dump}",
        f"--training.steps={steps}",
        f"--training.seq_len={args.seq_len}",
        f"--training.local_batch_size={args.batch}",
        f"--checkpoint.interval={steps}",
        f"--data.cache_folder={dump.parent / 'cache'}",
        *extra,
        nproc=2,
    )
    if proc.returncode != 0:
        raise SystemExit(f"train.py ({dump.name}) exited with status {proc.returncode}")
    return dump / "checkpoint" / f"step-{steps}"


def first_rows(path: Path, n: int, into: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    into.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    work = args.out.parent / "dpo_format"
    shutil.rmtree(work, ignore_errors=True)  # every model made anew, the reference too
    work.mkdir(parents=True)
    first_rows(args.corpus / "preferences.jsonl", args.pairs, work / "pairs.jsonl")
    held_out = first_rows(args.corpus / "preferences_validation.jsonl", args.held_out, work / "held_out.jsonl")
    begin = time.perf_counter()
    start = args.start or train(work / "sft", args.sft_steps, [
        f"--data.path={args.corpus / 'chat.jsonl'}", f"--lr_scheduler.warmup_steps={max(args.sft_steps // 10, 1)}",
    ], args=args)  # fmt: skip
    runs: dict[str, Any] = {}
    for side, mask in SIDES.items():
        t0 = time.perf_counter()
        step = train(work / side, args.steps, [
            "--dpo.enable", f"--dpo.mask_format_tokens={str(mask).lower()}", f"--data.path={work / 'pairs.jsonl'}",
            f"--checkpoint.initial_load_path={start}", f"--optimizer.lr={args.lr}",
            f"--lr_scheduler.warmup_steps={max(args.steps // 10, 1)}",
        ], args=args)  # fmt: skip
        metrics = [json.loads(line) for line in (work / side / "metrics.jsonl").read_text().splitlines()]
        runs[side] = {"train": [m for m in metrics if "rewards/accuracies" in m], "seconds": time.perf_counter() - t0,
                      "checkpoint": str(step)}  # fmt: skip
    scored = {"start": score(start, held_out, args=args)}
    for side in SIDES:
        scored[side] = score(Path(runs[side]["checkpoint"]), held_out, args=args, start=scored["start"])
    return {
        "settings": vars(args)
        | {"out": str(args.out), "corpus": str(args.corpus), "start": str(start), "made_start": args.start is None},
        "runs": runs,
        "scored": scored,
        "seconds": time.perf_counter() - begin,
    }


@torch.no_grad()
def score(
    step: Path, rows: list[dict[str, Any]], *, args: argparse.Namespace, start: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A checkpoint on the held-out pairs: per pair, the end-of-turn probability after each reply and the log-probs of
    each reply's own text; its greedy replies to the prompts (module docstring). `start`: the start's score, which
    reply accuracy is measured from."""
    from data.preference import CONTENT, PairRenderer
    from data.tokenizers import build_tokenizer
    from generate import Generator, stop_ids
    from inference import hf_tokenizer, load_model

    model, _ = load_model(step, config=None, device=torch.device("cpu"), dtype=torch.float32)
    renderer = PairRenderer(TOKENIZER)
    sequences = []  # chosen, rejected of each pair: (ids, mask)
    for i, row in enumerate(rows):
        out = renderer.render(row, where=f"held-out pair {i}")
        assert not isinstance(out, str), out
        sequences += [(out[0], out[1]), (out[2], out[3])]
    width = max(len(ids) for ids, _ in sequences)
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)  # right-padded: causal, the padding sees nothing back
    for row, (ids, _) in enumerate(sequences):
        tokens[row, : len(ids)] = torch.tensor(ids)
    logp = model(tokens[:, :-1]).float().log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]  # (seqs, width - 1)
    eot, text = [], []
    for row, (ids, mask) in enumerate(sequences):
        assert mask[-1] != CONTENT  # the template's end of turn closes the reply
        picked = logp[row, : len(ids) - 1]
        eot.append(picked[-1].exp().item())
        text.append(picked[torch.from_numpy(mask[1:] == CONTENT)].sum().item())
    eot_pairs = [eot[i : i + 2] for i in range(0, len(eot), 2)]  # [chosen, rejected] per pair
    text_pairs = [text[i : i + 2] for i in range(0, len(text), 2)]
    tokenizer = build_tokenizer(TOKENIZER)
    template = hf_tokenizer(TOKENIZER)
    prompts = tokenizer.encode_batch(
        [template.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False) for row in rows]
    )
    stops = stop_ids(tokenizer, TOKENIZER)
    replies = Generator(model).generate(prompts, max_new_tokens=args.new_tokens, stop_ids=stops)
    greedy = []
    for i, (row, reply) in enumerate(zip(rows, replies, strict=True)):
        ended = bool(reply) and reply[-1] in stops
        said = reply[:-1] if ended else reply
        chosen, spoken = int((sequences[2 * i][1] == CONTENT).sum()), tokenizer.decode(said)
        greedy.append({
            "text": spoken, "ended": ended, "repeats": repeats(reply),
            "cut_short": ended and 2 * len(said) < chosen, "right": spoken == row["chosen"][0]["content"],
        })  # fmt: skip
    out: dict[str, Any] = {"eot": eot_pairs, "text_logps": text_pairs, "greedy": greedy}
    if start is not None:
        gained = [
            (c - c0) - (r - r0) for (c, r), (c0, r0) in zip(text_pairs, start["text_logps"], strict=True)
        ]  # the implicit reward margin of the replies' own text, over beta
        out["reply_accuracy"] = statistics.fmean(g > 0 for g in gained)
    return out


def repeats(tokens: list[int], n: int = 3) -> bool:
    """Whether some n consecutive tokens occur twice: a reply's tail repeating itself."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) < len(grams)


def summary(scored: dict[str, Any]) -> dict[str, float]:
    """The means over the held-out pairs of one scored model."""
    greedy = scored["greedy"]
    out = {
        "eot_chosen": statistics.fmean(p[0] for p in scored["eot"]),
        "eot_rejected": statistics.fmean(p[1] for p in scored["eot"]),
        "run_on": statistics.fmean(not g["ended"] for g in greedy),
        "repeats": statistics.fmean(g["repeats"] for g in greedy),
        "cut_short": statistics.fmean(g["cut_short"] for g in greedy),
        "right": statistics.fmean(g["right"] for g in greedy),
    }
    if "reply_accuracy" in scored:
        out["reply_accuracy"] = scored["reply_accuracy"]
    return out


def rows(results: dict[str, Any]) -> list[Row]:
    s = results["settings"]
    start, broken, fixed = (summary(results["scored"][k]) for k in ("start", *SIDES))

    def row(metric: str, key: str) -> Row:
        at_start = f"; {start[key]:.4g} at the start" if key in start else ""
        return Row(PROBLEM, f"{metric} ({s['steps']} DPO steps{at_start})", "", "format counted", broken[key],
                   "format masked", fixed[key])  # fmt: skip

    return [
        row("P(end of turn) after held-out chosen replies", "eot_chosen"),
        row("P(end of turn) after held-out rejected replies", "eot_rejected"),
        row("held-out pairs whose chosen text gained more than the rejected", "reply_accuracy"),
        row("greedy replies to held-out prompts that never end", "run_on"),
        row("greedy replies that repeat 3 tokens", "repeats"),
        row("greedy replies under half the chosen one's length", "cut_short"),
        row("greedy replies that are the chosen reply", "right"),
    ]


def table(results: dict[str, Any]) -> str:
    s = results["settings"]
    made = f"chat-tuned {s['sft_steps']} steps from random init" if s["made_start"] else f"from {s['start']}"
    lines = [
        f"debug Llama {made}, then {s['steps']} DPO steps (sigmoid, beta 0.1, lr {s['lr']:g}) on {s['pairs']} pairs, "
        f"2 ranks x {s['batch']} x {s['seq_len']} tokens; scored on {s['held_out']} held-out pairs, greedy replies of "
        f"at most {s['new_tokens']} tokens; {results['seconds']:.0f} s"
    ]
    for name in ("start", *SIDES):
        m = summary(results["scored"][name])
        train = results["runs"].get(name, {}).get("train")
        trained = ""
        if train:
            acc = statistics.fmean(t["rewards/accuracies"] for t in train[-5:])
            trained = (
                f" | training: loss {train[0]['loss']:.4f} -> {train[-1]['loss']:.4f}, rewards/accuracies {acc:.3f}"
            )
        shown = ", ".join(f"{k} {v:.5f}" if k.startswith("eot") else f"{k} {v:.3f}" for k, v in m.items())
        lines.append(f"{name}: {shown}{trained}")
        lines.append("  e.g. " + " | ".join(repr(g["text"]) for g in results["scored"][name]["greedy"][:3]))
    counted, masked = (results["scored"][side]["greedy"] for side in SIDES)
    differ = sum(a["text"] != b["text"] for a, b in zip(counted, masked, strict=True))
    lines.append(f"counted vs masked: {differ} of {len(counted)} greedy replies differ")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    # Fewer leave a model that gives nearly one reply to every question (100 steps: "14 times 5 is 5." to most).
    p.add_argument("--sft-steps", type=int, default=200, help="chat fine-tuning steps from random initialization")
    p.add_argument("--start", type=Path, help="a chat model's step folder to start from instead (--sft-steps unused)")
    p.add_argument("--steps", type=int, default=30, help="DPO steps per side")
    # The chat fine-tune's last learning rate (3e-3 decayed to a tenth). 1e-4 moved no reward in 20 steps; 1e-3
    # broke both runs' greedy replies (docs/benchmarks.md#8-dpo-that-counts-the-chat-formats-tokens).
    p.add_argument("--lr", type=float, default=3e-4, help="the DPO runs' peak learning rate")
    p.add_argument("--pairs", type=int, default=256, help="the first pairs of preferences.jsonl trained on")
    p.add_argument("--held-out", type=int, default=64, help="the first pairs of preferences_validation.jsonl scored")
    p.add_argument("--batch", type=int, default=2, help="windows per rank per step (training.local_batch_size)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per reply at most")
    p.add_argument("--corpus", type=Path, default=REPO / "assets" / "corpus", help="chat.jsonl and the preferences")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the scoring (this process)")


def main(argv: list[str] | None = None) -> int:
    return harness.main("dpo_format", argv, doc=__doc__, add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
