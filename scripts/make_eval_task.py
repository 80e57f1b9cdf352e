"""Write the questions of the offline lm-eval task `stories_facts` (assets/eval_tasks/): sentences the shipped
stories corpus writes again and again, each cut before its last word, as multiple choice among four words.

A question is one of scripts/make_corpus.py's templates filled from its lists ("The cow says" -> moo, "Tara
learned that sharing makes everyone" -> happy); its three other choices end sibling sentences, the same template
filled from the same list ("The cat says" -> meow, ...), preferably those whose blank follows the same word, so
that the word before the blank does not give the answer away. lm-eval scores each choice as the context's
continuation after a space. Two groups of facts (`group`, and `kind` within it):

    world   the corpus's world: what each animal says, eats and does, where it lives, the days' and months' order
    story   what its stories always say: their morals, what breaks and how it is rebuilt, how a fear ends, recipes'
            steps, what a toy is for, how a skill first fails, where a hero lives, what one does at a place

Each question's `cue`, the end of its context, is written in the corpus at least MIN_STATED times followed by the
answer and never followed by a distractor or by another answer of its kind (counted in --corpus as written, a
sentence's first letter in either case); sentences written less often are left out. The same --seed and --corpus
always give a byte-identical file.

Usage:
    python scripts/make_eval_task.py    # -> assets/eval_tasks/stories_facts.jsonl (seed 7, from assets/corpus/stories.jsonl)
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_corpus import (  # noqa: E402
    ANIMALS,
    BUILDS,
    COLORS,
    DAYS,
    ENDINGS,
    EPISODES,
    FEARS,
    HOMES,
    MONTHS,
    PLACES,
    PLANTS,
    RECIPES,
    RELATIVES,
    SKILLS,
    THINGS,
    TRANSITIONS,
    Thing,
    article,
    capitalize,
    make_cast,
    make_character,
)

REPO = Path(__file__).resolve().parents[1]
CHOICES = 4
WORD = re.compile(r"[\w-]*")  # a word as the corpus writes it ("yo-yo"), up to its punctuation
MIN_STATED = 20  # make train's 100 steps read about two thirds of the corpus: each sentence a dozen times

# (lead, cue, answer): the context is lead + cue, and cue + " " + answer is what the corpus writes.
Sentence = tuple[str, str, str]


def cut(lead: str, text: str, *, cue_from: str = "") -> Sentence:
    """`text` (a sentence of the corpus after `lead`) cut before its last word; the cue starts at `cue_from`'s
    last occurrence in it (default: the whole text), so that character names in the text stay out of the cue."""
    head, _, last = text.rstrip(".!").rpartition(" ")
    start = head.rfind(cue_from) if cue_from else 0
    assert start >= 0, (cue_from, head)
    return lead + head[:start], head[start:], last


def families(rng: random.Random) -> list[tuple[str, str, list[Sentence]]]:
    """(group, kind, sentences), as make_corpus.py writes them: a kind's answers are each other's distractors."""
    one = lambda a: capitalize(article(a.name))  # noqa: E731  "A cow", "An owl"
    person = lambda: make_character(rng)  # noqa: E731
    next_day = lambda i, n=1: DAYS[(i + n) % 7]  # noqa: E731
    months = [", ".join(MONTHS[: k + 1]).replace(", December", " and December") for k in range(1, 12)]
    lessons = [episode(make_cast(random.Random(0)), random.Random(0))[1] for episode in EPISODES]
    fears = [(person(), fear, helper, truth) for fear, helper, truth in FEARS]
    steps = [(w, step) for _, _, done in RECIPES for w, step in zip(["First", "Then", "At last"], done, strict=True)]

    def frame(text: str) -> Sentence:
        """An ending or a transition of the stories; the cue is what follows its last placeholder."""
        h = person()
        words = text.rpartition("}")[2].split()[:-1] if "}" in text else []
        filled = text.format(name=h.name, Subj=h.Subj, subj=h.subj, poss=h.poss, relative=rng.choice(RELATIVES))
        return cut("", filled, cue_from=" ".join(words))

    def toy(thing: Thing) -> Sentence:
        h = person()
        return cut("", f"{h.Subj} had {article(rng.choice(COLORS))} {thing.name} and loved to {thing.use_by(h)}",
                   cue_from=thing.name)  # fmt: skip

    world = {
        "sound": [("", f"The {a.name} says", a.sound) for a in ANIMALS],
        "food": [cut("", f"{capitalize(a.plural)} eat {a.food}") for a in ANIMALS],
        "home": [cut("", f"{one(a)} lives {a.home}") for a in ANIMALS],
        "seen_at": [cut(f"{person().name} saw ", f"{article(a.name)} {a.home}") for a in ANIMALS],
        "trait": [cut("", f"{one(a)} {a.trait}", cue_from=a.name) for a in ANIMALS],
        "day": [("", f"After {d} comes", next_day(i)) for i, d in enumerate(DAYS)],
        "week": [
            (f"The days of the week, starting on {d}: ", f"{d}, {next_day(i)},", next_day(i, 2))
            for i, d in enumerate(DAYS)
        ],
        "month": [cut("", f"There are twelve months in a year: {m}") for m in months],
    }
    story = {
        "moral": [cut(f"{person().name} ", f"learned that {lesson}") for lesson in lessons],
        "build": [cut(f"{person().name} and {person().name} ", f"built {article(b[0])} {b[1]}") for b in BUILDS],
        "breaks": [cut("Then ", f"{b[2]}, and the {b[0]} {b[3]}") for b in BUILDS],
        "rebuild": [cut("", f"This time they built it {b[4]}") for b in BUILDS],
        "fear": [cut(f"{h.name} ", f"was afraid of {fear}") for h, fear, _, _ in fears],
        "fear_help": [
            cut(f"So {h.poss} {rng.choice(RELATIVES)} helped {h.obj} ", f"with {helper}") for h, _, helper, _ in fears
        ],
        "fear_truth": [cut("", truth.format(poss=h.poss, subj=h.subj)) for h, _, _, truth in fears],
        "recipe": [cut("", "They needed " + ", ".join(needs[:-1]) + f" and {needs[-1]}") for _, needs, _ in RECIPES],
        "recipe_step": [cut("", f"{when} they {step}") for when, step in steps],
        "toy": [toy(thing) for thing in THINGS],
        "skill": [cut(f"{h.Subj} tried once, but {h.subj} ", failure) for _, failure in SKILLS for h in [person()]],
        "plant": [
            cut(f"{person().name} kept watering it, and ", f"by the end of the summer it was {grown}")
            for _, grown, _ in PLANTS
        ],
        "hero_home": [cut(f"{person().Subj} ", f"lived {home}") for home in HOMES],
        "frame": [frame(text) for text in ENDINGS + TRANSITIONS],
        "activity": [
            cut(f"{person().name}: I am going to {p.name}. I want ", f"to {activity}")
            for p in PLACES
            for activity in p.activities
        ],
        "sight": [cut(f"Today I went to {p.name} with Mom. We saw ", sight) for p in PLACES for sight in p.sights],
    }
    return [("world", kind, s) for kind, s in world.items()] + [("story", kind, s) for kind, s in story.items()]


def words_after(corpus: str, cue: str) -> Counter[str]:
    """How often the corpus writes each word right after `cue` (its first letter in either case) and a space."""
    found: Counter[str] = Counter()
    for variant in dict.fromkeys([cue[0].upper() + cue[1:], cue[0].lower() + cue[1:]]):
        at = corpus.find(variant + " ")
        while at >= 0:
            at += len(variant) + 1
            found[WORD.match(corpus, at)[0]] += 1
            at = corpus.find(variant + " ", at)
    return found


def questions(seed: int, corpus: str) -> list[dict]:
    """{"context", "choices", "answer" (the index of the right choice), "group", "kind", "cue"} per sentence the
    corpus states at least MIN_STATED times, in a fixed order."""
    rng = random.Random(seed)
    out, seen = [], set()
    for group, kind, sentences in families(rng):
        siblings = sorted({answer for _, _, answer in sentences})
        before = {w: {cue.rpartition(" ")[2] for _, cue, answer in sentences if answer == w} for w in siblings}
        for lead, cue, answer in sentences:
            if (cue, answer) in seen or len(cue.split()) < 2:
                continue
            after = words_after(corpus, cue)
            wrong = [w for w in siblings if w != answer and after[w] == 0]
            # Stated often, and after its cue no other sentence of its kind is: the answer is the only right one.
            if after[answer] < MIN_STATED or len(wrong) < len(siblings) - 1:
                continue
            seen.add((cue, answer))
            # Distractors that follow the same word elsewhere ("on the" swings, "on the" grass), where there are three:
            # the word before the blank does not give the answer away.
            alike = [w for w in wrong if cue.rpartition(" ")[2] in before[w]]
            choices = [answer, *rng.sample(alike if len(alike) >= CHOICES - 1 else wrong, CHOICES - 1)]
            rng.shuffle(choices)
            out.append({"context": lead + cue, "choices": choices, "answer": choices.index(answer), "group": group,
                        "kind": kind, "cue": cue})  # fmt: skip
    return out


def read_corpus(path: Path) -> str:
    """The documents' texts, one after another."""
    return "\n".join(json.loads(line)["text"] for line in path.open(encoding="utf-8"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "assets/eval_tasks/stories_facts.jsonl")
    parser.add_argument("--corpus", type=Path, default=REPO / "assets/corpus/stories.jsonl")
    parser.add_argument("--seed", type=int, default=7)
    opts = parser.parse_args()
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    written = questions(opts.seed, read_corpus(opts.corpus))
    opts.out.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in written), encoding="utf-8")
    groups = {g: sum(q["group"] == g for q in written) for g in ("world", "story")}
    print(f"{opts.out}: {len(written)} questions ({groups['world']} world, {groups['story']} story)")


if __name__ == "__main__":
    main()
