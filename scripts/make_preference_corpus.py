"""Generate a tiny synthetic preference corpus: one question, its right answer and a plausible wrong one.

Each line is a pair in TRL's conversational preference form: ``{"prompt": [...], "chosen":
[{"role": "assistant", ...}], "rejected": [{"role": "assistant", ...}]}``, the prompt an optional
system turn and one user question. The questions and right answers are the chat corpus's own
(scripts/make_chat_corpus.py's animal, arithmetic and day questions, drawn in its proportions), so a
model fine-tuned on assets/corpus/chat.jsonl has seen their form. The wrong answer is the right
one with its fact swapped for another of the same kind: another animal's sound, food, home or
number of legs; a sum off by one to three or computed with another operation; the day on the other
side or one day too far. Stories are left out: a pair's two sequences share one training window.
Nothing is read or downloaded: the same ``--seed`` and ``--pairs`` give a byte-identical file.

Usage:
    python scripts/make_preference_corpus.py --out assets/corpus/preferences.jsonl --seed 2025 --pairs 2000
    python scripts/make_preference_corpus.py --out assets/corpus/preferences_validation.jsonl --seed 5202 \
        --pairs 200 --exclude assets/corpus/preferences.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_chat_corpus import QUESTIONS, SYSTEM_PROMPTS, animal_question, arithmetic_question, day_question  # noqa: E402
from make_corpus import ANIMALS, DAYS  # noqa: E402

# A pair's two sequences share a window with other pairs: the chat corpus's shortest system prompt keeps a pair
# well within half of the debug model's 256-token window (tests/test_preference_corpus.py measures every pair),
# where its longest would take some past it.
SYSTEM_PROMPT = min(SYSTEM_PROMPTS, key=len)


def swap_last(answer: str, right: str, wrong: str) -> str:
    """`answer` with its last `right` replaced by `wrong`."""
    at = answer.rindex(right)
    return answer[:at] + wrong + answer[at + len(right) :]


def legs_words(n: int) -> str:
    return "no legs" if n == 0 else f"{n} legs"


def wrong_animal_answer(question: str, answer: str, rng: random.Random) -> str:
    """The answer with the fact it states swapped for another animal's fact of the same kind (never the same)."""
    words = question.rstrip("?").split()
    (animal,) = [a for a in ANIMALS if a.name in words or a.plural in words]
    for field in ("sound", "food", "home"):
        right = getattr(animal, field)
        if answer.endswith((f"{right}.", f'{right}".')):
            wrong = rng.choice(sorted({getattr(a, field) for a in ANIMALS} - {right}))
            return swap_last(answer, right, wrong)
    right = legs_words(animal.legs)
    assert answer.endswith(f"{right}."), f"no fact of the {animal.name} in {answer!r}"
    return swap_last(answer, right, legs_words(rng.choice(sorted({a.legs for a in ANIMALS} - {animal.legs}))))


def wrong_arithmetic_answer(question: str, answer: str, rng: random.Random) -> str:
    """The answer ("a op b is n.") with n off by one to three or, one time in three, a and b combined by another
    operation (times for plus, plus for minus and times) where that gives another number."""
    a, op, b, _, n = answer.rstrip(".").split()
    right = int(n)
    other = {"plus": int(a) * int(b), "minus": int(a) + int(b), "times": int(a) + int(b)}[op]
    if rng.random() < 1 / 3 and other != right:
        wrong = other
    else:
        wrong = right + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if right + d >= 0])
    return swap_last(answer, n, str(wrong))


def wrong_day_answer(question: str, answer: str, rng: random.Random) -> str:
    """The answer with its day swapped for the asked day's other neighbour or the day one step too far."""
    asked, right = answer.split()[1], answer.rstrip(".").split()[-1]
    step = (DAYS.index(right) - DAYS.index(asked)) % 7  # 1 after, 6 (-1) before
    wrong = rng.choice([DAYS[(DAYS.index(asked) - step) % 7], DAYS[(DAYS.index(right) + step) % 7]])
    return swap_last(answer, right, wrong)


WRONG_ANSWERS: dict[Callable[[random.Random], tuple[str, str]], Callable[[str, str, random.Random], str]] = {
    animal_question: wrong_animal_answer,
    arithmetic_question: wrong_arithmetic_answer,
    day_question: wrong_day_answer,
}
KINDS = [(maker, weight) for maker, weight in QUESTIONS if maker in WRONG_ANSWERS]  # the chat corpus's proportions


def make_pair(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    prompt = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.5 else []
    makers, weights = zip(*KINDS, strict=True)
    maker = rng.choices(makers, weights=weights)[0]
    question, answer = maker(rng)
    wrong = WRONG_ANSWERS[maker](question, answer, rng)
    assert wrong != answer and wrong, (question, answer)
    prompt.append({"role": "user", "content": question})
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": answer}],
        "rejected": [{"role": "assistant", "content": wrong}],
    }


def prompt_key(pair: dict[str, list[dict[str, str]]]) -> str:
    return json.dumps(pair["prompt"], ensure_ascii=False)


def generate(seed: int, pairs: int, exclude: frozenset[str] = frozenset()) -> list[str]:
    """`pairs` JSON lines of preference pairs, none whose prompt (its `prompt_key`) is in `exclude`."""
    rng = random.Random(seed)
    lines: list[str] = []
    draws = 0
    while len(lines) < pairs:
        if (draws := draws + 1) > 100 * pairs:
            raise SystemExit(f"--exclude leaves too few new prompts for {pairs} pairs: ask for fewer --pairs")
        pair = make_pair(rng)
        if prompt_key(pair) not in exclude:
            lines.append(json.dumps(pair, ensure_ascii=False))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("assets/corpus/preferences.jsonl"))
    parser.add_argument("--seed", type=int, default=2025)
    parser.add_argument("--pairs", type=int, default=2000, help="how many pairs to write")
    parser.add_argument(
        "--exclude", type=Path, help="a preference corpus whose prompts to leave out (a held-out split)"
    )
    args = parser.parse_args()
    exclude = frozenset()
    if args.exclude:
        lines = args.exclude.read_text(encoding="utf-8").splitlines()
        exclude = frozenset(prompt_key(json.loads(line)) for line in lines)
    lines = generate(args.seed, args.pairs, exclude)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(line + "\n" for line in lines), encoding="utf-8", newline="\n")
    print(f"wrote {len(lines)} pairs, {args.out.stat().st_size:,} bytes -> {args.out}")


if __name__ == "__main__":
    main()
