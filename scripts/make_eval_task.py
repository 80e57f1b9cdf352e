"""Write the questions of the offline lm-eval task `stories_facts` (assets/eval_tasks/): the shipped stories
corpus's world facts (scripts/make_corpus.py's animals and days) as multiple choice, each question a sentence
start the corpus completes ("The cow says" -> moo) among four choices, the other three the same fact of other
animals (or other days). The same --seed always gives a byte-identical file.

Usage:
    python scripts/make_eval_task.py    # -> assets/eval_tasks/stories_facts.jsonl (seed 7)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_corpus import ANIMALS, DAYS, article, capitalize  # noqa: E402

CHOICES = 4


def questions(seed: int) -> list[dict]:
    """{"context", "choices", "answer" (the index of the right choice)} per fact, in a fixed order."""
    rng = random.Random(seed)
    facts = [(f"The {a.name} says", a.sound, "sound") for a in ANIMALS]
    facts += [(f"{capitalize(a.plural)} eat", a.food, "food") for a in ANIMALS]
    facts += [(f"{capitalize(article(a.name))} lives", a.home, "home") for a in ANIMALS]
    days = [(f"After {day} comes", DAYS[(i + 1) % 7], "day") for i, day in enumerate(DAYS)]
    values = {kind: sorted({getattr(a, kind) for a in ANIMALS}) for kind in ("sound", "food", "home")} | {"day": DAYS}
    out = []
    for context, right, kind in facts + days:
        choices = [right, *rng.sample([v for v in values[kind] if v != right], CHOICES - 1)]
        rng.shuffle(choices)
        out.append({"context": context, "choices": choices, "answer": choices.index(right)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "assets/eval_tasks/stories_facts.jsonl"
    )
    parser.add_argument("--seed", type=int, default=7)
    opts = parser.parse_args()
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    written = questions(opts.seed)
    opts.out.write_text("".join(json.dumps(q) + "\n" for q in written), encoding="utf-8")
    print(f"{opts.out}: {len(written)} questions")


if __name__ == "__main__":
    main()
