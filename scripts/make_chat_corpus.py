"""Generate a tiny synthetic chat corpus: conversations whose answers a tiny model can learn.

Each line is ``{"messages": [{"role": ..., "content": ...}, ...]}``, the OpenAI-style form every
instruct model is fine-tuned on: an optional system turn, then one to three user questions, each
answered by the assistant. The questions and answers reuse the world of scripts/make_corpus.py
(its animals, days, arithmetic and tiny stories), so the answers are always right and the story
tokenizer knows the words. Like the story corpus, nothing is read or downloaded: the same
``--seed`` and ``--target-mb`` give a byte-identical file.

Usage:
    python scripts/make_chat_corpus.py --out assets/corpus/chat.jsonl --seed 2024 --target-mb 0.3
    python scripts/make_chat_corpus.py --out assets/corpus/chat_validation.jsonl --seed 4202 --target-mb 0.03 \
        --exclude assets/corpus/chat.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_corpus import ANIMALS, DAYS, article, capitalize, make_character, make_tiny_story  # noqa: E402

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly helper who answers in short sentences.",
    "Answer the question in one sentence.",
]


def animal_question(rng: random.Random) -> tuple[str, str]:
    a = rng.choice(ANIMALS)
    one = article(a.name)
    kind = rng.randrange(4)
    if kind == 0:
        return f"What does {one} say?", f'{capitalize(one)} says "{a.sound}".'
    if kind == 1:
        return f"What do {a.plural} eat?", f"{capitalize(a.plural)} eat {a.food}."
    if kind == 2:
        return f"Where does {one} live?", f"{capitalize(one)} lives {a.home}."
    legs = "no legs" if a.legs == 0 else f"{a.legs} legs"
    return f"How many legs does {one} have?", f"{capitalize(one)} has {legs}."


def arithmetic_question(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    op = rng.choice(["plus", "minus", "times"])
    if op == "minus":
        a, b = max(a, b), min(a, b)
    answer = {"plus": a + b, "minus": a - b, "times": a * b}[op]
    return rng.choice([f"What is {a} {op} {b}?", f"How much is {a} {op} {b}?"]), f"{a} {op} {b} is {answer}."


def day_question(rng: random.Random) -> tuple[str, str]:
    i = rng.randrange(7)
    if rng.random() < 0.5:
        return f"What day comes after {DAYS[i]}?", f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."
    return f"What day comes before {DAYS[i]}?", f"Before {DAYS[i]} comes {DAYS[i - 1]}."


def story_request(rng: random.Random) -> tuple[str, str]:
    who = make_character(rng)
    return rng.choice(
        ["Tell me a short story.", "Can you tell me a story?", f"Tell me a story about {who.name}."]
    ), make_tiny_story(rng)


QUESTIONS = [(animal_question, 4), (arithmetic_question, 3), (day_question, 1), (story_request, 2)]


def make_conversation(rng: random.Random) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.5 else []
    makers, weights = zip(*QUESTIONS, strict=True)
    for _ in range(rng.choice([1, 1, 2, 3])):
        question, answer = rng.choices(makers, weights=weights)[0](rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def generate(seed: int, target_bytes: int, exclude: frozenset[str] = frozenset()) -> list[str]:
    """JSON lines of conversations until they reach ``target_bytes``, skipping those in ``exclude``."""
    rng = random.Random(seed)
    lines: list[str] = []
    size = 0
    while size < target_bytes:
        line = json.dumps({"messages": make_conversation(rng)}, ensure_ascii=False)
        if line in exclude:
            continue
        lines.append(line)
        size += len(line.encode("utf-8")) + 1
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("assets/corpus/chat.jsonl"))
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--target-mb", type=float, default=0.3, help="output size in MB (10^6 bytes)")
    parser.add_argument(
        "--exclude", type=Path, help="a chat corpus whose conversations to leave out (a held-out split)"
    )
    args = parser.parse_args()
    exclude = frozenset(args.exclude.read_text(encoding="utf-8").splitlines()) if args.exclude else frozenset()
    lines = generate(args.seed, int(args.target_mb * 1_000_000), exclude)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(line + "\n" for line in lines), encoding="utf-8", newline="\n")
    print(f"wrote {len(lines)} conversations, {args.out.stat().st_size:,} bytes -> {args.out}")


if __name__ == "__main__":
    main()
