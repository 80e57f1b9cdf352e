"""Generate a small synthetic English corpus for tiny-model training runs.

Every document is produced by this script from the hand-written word lists and
templates below, driven by a seeded ``random.Random``. No external text is read,
downloaded or copied, so the output is ours and free to ship with the repository.
The same ``--seed`` and ``--target-mb`` always give a byte-identical file.

The corpus is meant to have learnable structure, so a tiny transformer's loss
falls visibly within a few hundred steps:

* short stories with a recurring cast, consistent pronouns, places with their
  own details, and simple cause-and-effect plots (often several episodes long);
* fixed "world facts" (what each animal says, eats and where it lives) that are
  reused consistently by stories, fact sheets and question/answer pages;
* arithmetic facts and word problems whose answers are always correct;
* lists, letters, counting sequences and short dialogues.

Output: one JSON object per line, ``{"text": "..."}``, UTF-8 (a few names and
places carry accents, so the tokenizer sees some non-ASCII text).

Usage:
    python scripts/make_corpus.py --out assets/corpus/stories.jsonl --seed 1234 --target-mb 2.5
    # the held-out split: other documents, none of the training ones
    python scripts/make_corpus.py --out assets/corpus/stories_validation.jsonl --seed 4321 --target-mb 0.25 \
        --exclude assets/corpus/stories.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# --------------------------------------------------------------------------- #
# Word lists: the whole "world" of the corpus.
# --------------------------------------------------------------------------- #
# fmt: off

GIRL_NAMES = [
    "Mia", "Lily", "Emma", "Ava", "Sara", "Nora", "Ella", "Ruby", "Anna", "Lucy",
    "Maya", "Ivy", "Rosa", "Hana", "Amara", "Chloé", "Ines", "Kira", "Lena", "Nina",
    "Priya", "Tara", "Yuki", "Zoë", "Greta", "Fatima", "Elif", "Sofia", "June", "Wren",
]
BOY_NAMES = [
    "Tom", "Leo", "Sam", "Ben", "Max", "Noah", "Omar", "Jack", "Finn", "Eli",
    "Hugo", "Ravi", "Kai", "Liam", "Theo", "Ali", "Jonas", "Mateo", "Ivan", "Kofi",
    "Luca", "Arlo", "Oscar", "Felix", "José", "Ken", "Milo", "Tariq", "Pablo", "Owen",
]
HERO_ADJECTIVES = [
    "kind", "curious", "brave", "shy", "happy", "clever", "quiet", "funny",
    "busy", "gentle", "cheerful", "careful", "friendly", "small", "bright",
]
RELATIVES = ["mom", "dad", "grandma", "grandpa", "aunt", "uncle", "big sister", "big brother"]
HOMES = [
    "in a small house by the river", "in a yellow house near the park",
    "on a farm at the edge of town", "in a flat above the bakery",
    "in a blue house on a quiet street", "in a little cottage near the forest",
    "in a tall building in the city", "in a house by the sea",
]
COLORS = ["red", "blue", "green", "yellow", "orange", "purple", "pink", "white", "brown", "black"]
NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
    "eighteen", "nineteen", "twenty",
]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July",
    "August", "September", "October", "November", "December",
]
SEASONS = {
    "spring": "flowers grow and baby birds hatch",
    "summer": "the days are long and hot",
    "autumn": "the leaves turn red and fall from the trees",
    "winter": "it is cold and sometimes it snows",
}
FEELINGS_GOOD = ["happy", "glad", "proud", "excited", "thankful"]
FEELINGS_BAD = ["sad", "worried", "upset", "scared", "grumpy"]
TRANSITIONS = [
    "The next day was a new day.", "A week went by.", "Some time later, there was another adventure.",
    "The days went by.", "Then came another day.", "Not long after, something else happened.",
]
ENDINGS = [
    "That night, {name} went to bed with a big smile.",
    "It was the best day ever.",
    "The end.",
    "And that is how the day ended.",
    "{Subj} could not wait to tell {poss} {relative} all about it.",
    "When {subj} got home, {subj} told {poss} {relative} the whole story.",
]


@dataclass(frozen=True)
class Animal:
    """Fixed facts about one animal; every document that mentions it agrees."""

    name: str
    plural: str
    sound: str
    food: str
    home: str
    legs: int
    trait: str


ANIMALS = [
    Animal("cat", "cats", "meow", "fish", "in a warm house", 4, "can climb trees"),
    Animal("dog", "dogs", "woof", "bones", "in a house with people", 4, "can run very fast"),
    Animal("cow", "cows", "moo", "grass", "on a farm", 4, "gives us milk"),
    Animal("duck", "ducks", "quack", "seeds", "on a pond", 2, "can swim and fly"),
    Animal("sheep", "sheep", "baa", "grass", "on a farm", 4, "has soft wool"),
    Animal("horse", "horses", "neigh", "hay", "in a stable", 4, "can pull a cart"),
    Animal("owl", "owls", "hoot", "mice", "in a hollow tree", 2, "is awake at night"),
    Animal("frog", "frogs", "ribbit", "flies", "near a pond", 4, "can jump very far"),
    Animal("bee", "bees", "buzz", "nectar from flowers", "in a hive", 6, "makes honey"),
    Animal("pig", "pigs", "oink", "corn", "on a farm", 4, "likes to roll in the mud"),
    Animal("lion", "lions", "roar", "meat", "on the grassland", 4, "is very strong"),
    Animal("hen", "hens", "cluck", "seeds", "in a hen house", 2, "lays eggs"),
    Animal("mouse", "mice", "squeak", "cheese", "in a small hole", 4, "is very small"),
    Animal("goat", "goats", "bleat", "leaves", "on a hill", 4, "can climb rocks"),
    Animal("rabbit", "rabbits", "squeak", "carrots", "in a burrow", 4, "has long ears"),
    Animal("snake", "snakes", "hiss", "eggs", "under the rocks", 0, "has no legs"),
]
PETS = ["cat", "dog", "rabbit", "duck", "hen", "mouse", "goat"]
PET_NAMES = ["Pip", "Rex", "Daisy", "Biscuit", "Coco", "Pepper", "Bean", "Sunny", "Muffin", "Ziggy"]


@dataclass(frozen=True)
class Place:
    """A place with its own hiding spots, sights and activities."""

    name: str
    spots: tuple[str, ...]
    sights: tuple[str, ...]
    activities: tuple[str, ...]


PLACES = [
    Place("the park",
          ("under the slide", "behind a big tree", "near the pond", "under a bench", "in the tall grass"),
          ("ducks on the pond", "children on the swings", "a man walking his dog", "a red kite in the sky"),
          ("play on the swings", "run on the grass", "feed the ducks", "play tag")),
    Place("the beach",
          ("under the sand", "behind a rock", "near the water", "by an old boat", "next to a towel"),
          ("big waves", "white shells", "a little red crab", "a boat far away"),
          ("build a sandcastle", "look for shells", "splash in the waves", "dig a big hole")),
    Place("the forest",
          ("under a log", "behind a bush", "in a pile of leaves", "near a mossy rock", "by a tall pine tree"),
          ("a deer between the trees", "tiny mushrooms", "a squirrel with a nut", "a woodpecker"),
          ("walk on the path", "look for pine cones", "build a little hut", "listen to the birds")),
    Place("the garden",
          ("under a flower pot", "behind the roses", "in the vegetable bed", "by the gate", "next to the watering can"),
          ("bright flowers", "a fat bumblebee", "red tomatoes", "a snail on a leaf"),
          ("water the plants", "pick some beans", "plant seeds", "chase butterflies")),
    Place("the market",
          ("under a table", "behind a box of apples", "near the bread stall", "by the flower stall", "next to a basket"),
          ("piles of fruit", "a man selling fish", "a woman selling cheese", "baskets of eggs"),
          ("buy some fruit", "look at the stalls", "try some cheese", "buy fresh bread")),
    Place("the school",
          ("under a desk", "behind the bookshelf", "in the cloakroom", "by the window", "near the teacher's chair"),
          ("a big map on the wall", "rows of desks", "paintings by the children", "a fish tank"),
          ("read a story", "paint a picture", "sing songs", "play in the yard")),
    Place("the library",
          ("under a chair", "behind a shelf", "on the reading rug", "by the front desk", "between two big books"),
          ("tall shelves of books", "a quiet reading corner", "a globe", "a cat asleep by the door"),
          ("read books", "look at picture books", "listen to a story", "find a book about animals")),
    Place("the farm",
          ("in the hay", "behind the barn", "near the pig pen", "by the tractor", "under the water trough"),
          ("cows in the field", "pigs in the mud", "hens pecking at seeds", "a big red barn"),
          ("feed the hens", "collect eggs", "ride on the tractor", "brush the horse")),
    Place("the lake",
          ("under the dock", "behind the reeds", "near a canoe", "by a flat stone", "in the shallow water"),
          ("a family of swans", "fish jumping", "a little wooden boat", "dragonflies"),
          ("skip stones", "fish from the dock", "paddle a canoe", "watch the swans")),
    Place("the zoo",
          ("under a bench", "behind a sign", "near the gift shop", "by the lion house", "next to the ice cream cart"),
          ("a tall giraffe", "a sleepy lion", "monkeys swinging on ropes", "a big grey elephant"),
          ("see the animals", "watch the monkeys", "feed the goats", "ride the little train")),
    Place("the café",
          ("under the table", "behind the counter", "by the window seat", "near the door", "on a chair"),
          ("cakes in a glass case", "people drinking tea", "a big shiny coffee machine", "a plant in the corner"),
          ("drink hot chocolate", "eat a slice of cake", "watch the people go by", "share a muffin")),
    Place("the hill",
          ("behind a rock", "in the long grass", "under a small tree", "near the old fence", "by the top of the path"),
          ("the whole town below", "sheep far away", "clouds moving fast", "a windmill"),
          ("roll down the grass", "fly a kite", "have a picnic", "watch the clouds")),
]


@dataclass(frozen=True)
class Thing:
    """A toy or object a character can own, lose, share or play with."""

    name: str
    use: str  # what one does with it: "fly it ...", may contain "{poss}"

    def use_by(self, who: Character) -> str:
        return self.use.format(poss=who.poss)


THINGS = [
    Thing("kite", "fly it high in the sky"),
    Thing("ball", "kick it across the grass"),
    Thing("book", "read it before bed"),
    Thing("toy car", "race it along the floor"),
    Thing("drum", "play loud songs on it"),
    Thing("hat", "wear it every day"),
    Thing("doll", "take it everywhere"),
    Thing("toy boat", "sail it on the water"),
    Thing("teddy bear", "hug it at night"),
    Thing("yo-yo", "spin it up and down"),
    Thing("whistle", "blow it very loud"),
    Thing("scarf", "wrap it around {poss} neck"),
    Thing("robot", "make it walk and beep"),
    Thing("bucket", "fill it with sand"),
    Thing("marble", "roll it across the table"),
    Thing("umbrella", "open it when it rained"),
]


@dataclass(frozen=True)
class Food:
    """A countable food, so stories can do arithmetic with it."""

    singular: str
    plural: str


FOODS = [
    Food("apple", "apples"), Food("cookie", "cookies"), Food("orange", "oranges"),
    Food("plum", "plums"), Food("muffin", "muffins"), Food("cherry", "cherries"),
    Food("strawberry", "strawberries"), Food("banana", "bananas"), Food("pear", "pears"),
    Food("sandwich", "sandwiches"), Food("carrot", "carrots"), Food("egg", "eggs"),
    Food("pancake", "pancakes"), Food("peach", "peaches"), Food("lemon", "lemons"),
]
MEALS = ["soup", "bread and honey", "rice and beans", "warm pie", "pasta", "cake", "porridge", "fish and potatoes"]
SKILLS = [
    ("ride a bike", "fell over again and again"),
    ("swim", "sank and swallowed some water"),
    ("whistle", "could only make a little puff of air"),
    ("bake bread", "made bread as hard as a rock"),
    ("climb a tree", "slipped down the trunk"),
    ("jump rope", "kept tripping over the rope"),
    ("skip stones", "watched every stone sink with a plop"),
    ("tie shoes", "made a big knot every time"),
    ("paint a bird", "painted something that looked like a potato"),
    ("play the flute", "could only make a squeaky noise"),
]
FEARS = [
    ("the dark", "a night light", "The shadows on the wall were only {poss} coat and {poss} chair."),
    ("thunder", "a story about storms", "Thunder is only the sound of the sky, and it cannot hurt you."),
    ("big dogs", "a friendly old dog", "Most dogs are gentle if you are gentle with them."),
    ("deep water", "a swimming lesson", "The water was not so scary when {subj} learned to float."),
    ("the tall slide", "a slow first try", "The slide was fast, but it was fun, not scary."),
    ("bees", "a visit to a beekeeper", "Bees are busy with flowers and do not want to sting."),
]
BUILDS = [
    # (thing, where, accident, how it breaks, how to fix it)
    ("sandcastle", "at the beach", "a big wave rolled in", "washed away",
     "farther from the water"),
    ("tower of blocks", "in the living room", "the cat ran past", "fell down",
     "with the big blocks at the bottom"),
    ("snowman", "in the yard", "the sun came out", "began to melt",
     "in the shade of the house"),
    ("den of blankets", "under the table", "a chair tipped over", "fell in",
     "with books holding the blankets down"),
    ("bird house", "in the garden", "the glue was still wet", "came apart",
     "with little nails instead of glue"),
    ("paper boat", "by the stream", "it got too wet", "sank",
     "with a coat of wax on the paper"),
]
RECIPES = [
    # (dish, ingredients, steps)
    ("pancakes", ["flour", "eggs", "milk"],
     ["mixed everything in a big bowl", "poured the batter into a hot pan", "flipped each pancake"]),
    ("a fruit salad", ["apples", "bananas", "grapes"],
     ["washed the fruit", "cut it into small pieces", "put it all in a bowl"]),
    ("soup", ["carrots", "potatoes", "onions"],
     ["chopped the vegetables", "put them in a pot of water", "let the soup bubble for an hour"]),
    ("bread", ["flour", "water", "salt"],
     ["mixed the dough", "let it rise under a towel", "baked it in the oven"]),
    ("cookies", ["flour", "butter", "sugar"],
     ["mixed the dough", "made little balls", "baked them until they were golden"]),
    ("a sandwich", ["bread", "cheese", "tomatoes"],
     ["cut the bread", "put cheese and tomatoes on it", "cut it into two halves"]),
]
PLANTS = [
    # (seed, what grows, days to sprout)
    ("a sunflower seed", "a tall yellow sunflower", 7),
    ("a bean", "a green bean plant that climbed up a stick", 5),
    ("a tomato seed", "a plant with little red tomatoes", 10),
    ("a pumpkin seed", "a big orange pumpkin", 9),
    ("a tulip bulb", "a red tulip", 6),
]
SHOPPING = [
    "bread", "milk", "eggs", "butter", "cheese", "rice", "apples", "carrots",
    "honey", "tea", "soap", "potatoes", "onions", "beans", "flour", "jam",
]
PACKING = {
    "the beach": ["a towel", "a sun hat", "a bucket", "a spade", "a bottle of water", "a snack"],
    "the forest": ["boots", "a map", "a rain coat", "a bottle of water", "a snack", "a small torch"],
    "the hill": ["a kite", "a blanket", "a picnic basket", "a warm jumper", "a snack"],
    "the lake": ["a fishing rod", "a towel", "a life vest", "a bottle of water", "a snack"],
    "the farm": ["boots", "old clothes", "a basket for eggs", "a hat", "a snack"],
}

# fmt: on

# --------------------------------------------------------------------------- #
# Small grammar helpers.
# --------------------------------------------------------------------------- #


def article(word: str) -> str:
    """Return ``word`` with "a" or "an" in front of it."""
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


def capitalize(sentence: str) -> str:
    """Upper-case the first character only (``str.capitalize`` lowers the rest)."""
    return sentence[:1].upper() + sentence[1:]


def number(n: int, rng: random.Random) -> str:
    """Write a small number as a word or as digits, at random."""
    if n < len(NUMBER_WORDS) and rng.random() < 0.6:
        return NUMBER_WORDS[n]
    return str(n)


def count(n: int, food: Food, rng: random.Random) -> str:
    """``"three apples"``, ``"1 apple"``... with the right plural."""
    return f"{number(n, rng)} {food.singular if n == 1 else food.plural}"


def join_list(items: list[str]) -> str:
    """``["a", "b", "c"]`` -> ``"a, b and c"``."""
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


@dataclass(frozen=True)
class Character:
    """A person in a story, with the pronouns every sentence must agree with."""

    name: str
    kind: str  # "girl" or "boy"
    subj: str
    obj: str
    poss: str

    @property
    def Subj(self) -> str:  # capitalised pronoun, for the start of a sentence
        return capitalize(self.subj)


def make_character(rng: random.Random, exclude: tuple[str, ...] = ()) -> Character:
    """Draw a random girl or boy whose name is not in ``exclude``."""
    while True:
        if rng.random() < 0.5:
            who = Character(rng.choice(GIRL_NAMES), "girl", "she", "her", "her")
        else:
            who = Character(rng.choice(BOY_NAMES), "boy", "he", "him", "his")
        if who.name not in exclude:
            return who


@dataclass(frozen=True)
class Cast:
    """Everything that stays fixed across the episodes of one story."""

    hero: Character
    friend: Character
    relative: str
    place: Place
    thing: Thing
    color: str
    pet: Animal
    pet_name: str


def make_cast(rng: random.Random) -> Cast:
    hero = make_character(rng)
    pet_kind = rng.choice(PETS)
    pet = next(a for a in ANIMALS if a.name == pet_kind)
    return Cast(
        hero=hero,
        friend=make_character(rng, exclude=(hero.name,)),
        relative=rng.choice(RELATIVES),
        place=rng.choice(PLACES),
        thing=rng.choice(THINGS),
        color=rng.choice(COLORS),
        pet=pet,
        pet_name=rng.choice(PET_NAMES),
    )


# --------------------------------------------------------------------------- #
# Story episodes. Each returns (paragraph, lesson) for the same Cast.
# --------------------------------------------------------------------------- #

Episode = Callable[[Cast, random.Random], tuple[str, str]]


def episode_lost_thing(c: Cast, rng: random.Random) -> tuple[str, str]:
    h, f, p = c.hero, c.friend, c.place
    s1, s2, s3 = rng.sample(p.spots, 3)
    lines = [
        rng.choice(
            [
                f"{h.name} took {h.poss} {c.color} {c.thing.name} to {p.name} with {f.name}.",
                f"One day, {h.name} and {f.name} went to {p.name}, and {h.name} brought {h.poss} {c.thing.name}.",
                f"{h.name} carried {h.poss} {c.thing.name} all the way to {p.name} to meet {f.name}.",
            ]
        ),
        rng.choice(
            [
                f"They wanted to {rng.choice(p.activities)}.",
                f"{h.Subj} and {f.name} played there all afternoon.",
                "It was a fine day, and there was a lot to do.",
            ]
        ),
        rng.choice(
            [
                f"When it was time to go home, the {c.thing.name} was gone!",
                f"But when {h.subj} looked down, {h.poss} {c.thing.name} was not there!",
                f"Later, {h.name} could not find {h.poss} {c.thing.name} anywhere.",
            ]
        ),
        f"{h.name} felt {rng.choice(FEELINGS_BAD)}.",
        f"{h.Subj} looked {s1}, but it was not there.",
        f"{h.Subj} looked {s2}, but it was not there either.",
        rng.choice(
            [
                f'Then {f.name} shouted, "Look! It is {s3}!"',
                f"Then {f.name} found it {s3}.",
                f"At last, {f.name} saw something {c.color} {s3}. It was the {c.thing.name}!",
            ]
        ),
        rng.choice(
            [
                f'"Thank you, {f.name}!" said {h.name}, and {h.subj} gave {f.obj} a big hug.',
                f"{h.name} was so {rng.choice(FEELINGS_GOOD)}. {h.Subj} thanked {f.name} again and again.",
                f"{h.name} held the {c.thing.name} tight all the way home.",
            ]
        ),
    ]
    return " ".join(lines), "good friends help you look for lost things"


def episode_share_food(c: Cast, rng: random.Random) -> tuple[str, str]:
    h, f = c.hero, c.friend
    food = rng.choice(FOODS)
    total = rng.randint(3, 12)
    given = rng.randint(1, total - 1)
    left = total - given
    lines = [
        rng.choice(
            [
                f"{h.name}'s {c.relative} gave {h.obj} {count(total, food, rng)}.",
                f"{h.name} picked {count(total, food, rng)} and put them in a basket.",
                f"In {h.poss} bag, {h.name} had {count(total, food, rng)}.",
            ]
        ),
        f"At {c.place.name}, {h.subj} met {f.name}.",
        rng.choice(
            [
                f"{f.name} looked hungry and had no {food.plural} at all.",
                f"{f.name} had forgotten {f.poss} lunch at home.",
                f'{f.name} said, "I am so hungry!"',
            ]
        ),
        f"{h.name} gave {count(given, food, rng)} to {f.name}.",
        rng.choice(
            [
                f"Now {h.name} had {count(left, food, rng)}, and {f.name} had {count(given, food, rng)}.",
                f"{total} take away {given} is {left}, so {h.name} had {count(left, food, rng)} left.",
                f"{h.name} counted what was left: {count(left, food, rng)}.",
            ]
        ),
        rng.choice(
            [
                "They sat down and ate together.",
                f'"Thank you!" said {f.name}. "Sharing makes food taste better."',
                "They ate in the sun and talked and laughed.",
            ]
        ),
    ]
    return " ".join(lines), "sharing makes everyone happy"


def episode_weather(c: Cast, rng: random.Random) -> tuple[str, str]:
    h, f, p = c.hero, c.friend, c.place
    activity = rng.choice(p.activities)
    kind = rng.choice(["rain", "wind", "snow"])
    lines = [
        rng.choice(
            [
                f"It was a sunny morning, so {h.name} and {f.name} went to {p.name}.",
                f"The sky was blue when {h.name} and {f.name} set off for {p.name}.",
            ]
        ),
        f"They wanted to {activity}.",
    ]
    if kind == "rain":
        lines += [
            "But soon, dark clouds came and it began to rain.",
            f"They ran to hide {rng.choice(p.spots)} and waited.",
            "The rain went drip, drip, drip.",
            "When the rain stopped, they saw a rainbow over the trees.",
            f'"Red, orange, yellow, green, blue and purple!" said {f.name}.',
        ]
    elif kind == "wind":
        lines += [
            "But then a strong wind began to blow.",
            f"The wind took {h.name}'s hat and carried it far away.",
            f"{h.name} and {f.name} ran after the hat.",
            f"At last it landed {rng.choice(p.spots)}, and {h.name} put it back on {h.poss} head.",
        ]
    else:
        lines += [
            "But the air grew cold, and little white flakes began to fall.",
            "It was snow!",
            f"Soon {p.name} was all white.",
            f"{h.name} and {f.name} made snow angels and threw snowballs until their hands were cold.",
        ]
    lines.append(
        rng.choice(
            [
                f"Then they went home and had {rng.choice(MEALS)} for dinner.",
                f"They did not {activity} that day, but they had fun anyway.",
                f'{h.name} said, "That was a good day after all."',
            ]
        )
    )
    return " ".join(lines), "a change of plan can still be fun"


def episode_learn_skill(c: Cast, rng: random.Random) -> tuple[str, str]:
    h, f = c.hero, c.friend
    skill, failure = rng.choice(SKILLS)
    days = rng.randint(2, 6)
    lines = [
        f"{h.name} wanted to learn to {skill}, but {h.subj} did not know how.",
        f"{h.Subj} tried once, but {h.subj} {failure}.",
        rng.choice(
            [
                f'"It is too hard," said {h.name}.',
                f"{h.name} felt {rng.choice(FEELINGS_BAD)} and wanted to give up.",
            ]
        ),
        rng.choice(
            [
                f'Then {h.poss} {c.relative} said, "Let me show you. We will go slowly."',
                f'Then {f.name} said, "I can help you. I learned it last year."',
            ]
        ),
        f"Every day, {h.name} practiced a little more.",
        f"On the {ORDINALS[days - 1]} day, {h.subj} tried one more time.",
        f"This time, {h.name} could {skill}!",
        f"{h.Subj} felt very {rng.choice(['proud', 'happy', 'excited'])}.",
    ]
    return " ".join(lines), "practice makes hard things easy"


def episode_help_animal(c: Cast, rng: random.Random) -> tuple[str, str]:
    h, p = c.hero, c.place
    animal = rng.choice([a for a in ANIMALS if a.legs in (2, 4) and a.name != "lion"])
    problem = rng.choice(["hungry", "lost", "cold"])
    lines = [
        rng.choice(
            [
                f"On the way to {p.name}, {h.name} heard a little sound.",
                f"At {p.name}, {h.name} heard something {rng.choice(p.spots)}.",
            ]
        ),
        f'"{capitalize(animal.sound)}, {animal.sound}," it went.',
        f"It was a little {animal.name}, and it looked {problem}.",
    ]
    if problem == "hungry":
        lines += [
            f"{h.name} knew that {animal.plural} eat {animal.food}.",
            f"So {h.subj} found some {animal.food} and gave it to the {animal.name}.",
            f"The {animal.name} ate it all up.",
        ]
    elif problem == "lost":
        lines += [
            f"{h.name} knew that {animal.plural} live {animal.home}.",
            f"So {h.subj} carried the {animal.name} gently all the way home, {animal.home}.",
            f"Its mother was waiting there, and the two {animal.plural} were together again.",
        ]
    else:
        lines += [
            f"{h.name} wrapped it in {h.poss} {rng.choice(COLORS)} scarf to keep it warm.",
            f"Soon the {animal.name} stopped shaking.",
            f"Then {h.name} took it back to where it lives, {animal.home}.",
        ]
    lines.append(f'"{capitalize(animal.sound)}!" said the {animal.name}, as if to say thank you.')
    return " ".join(lines), "we should be kind to animals"


def episode_build(c: Cast, rng: random.Random) -> tuple[str, str]:
    h, f = c.hero, c.friend
    thing, where, accident, broke, fix = rng.choice(BUILDS)
    lines = [
        f"{h.name} and {f.name} built {article(thing)} {where}.",
        rng.choice(
            [
                "It was very tall, and they were proud of it.",
                "It took them all morning.",
                "It was the best one they had ever made.",
            ]
        ),
        f"Then {accident}, and the {thing} {broke}.",
        f"{h.name} was {rng.choice(FEELINGS_BAD)}.",
        rng.choice(
            [
                f'"We can build it again," said {f.name}. "And this time it will be even better."',
                f'{f.name} put a hand on {h.poss} shoulder. "Let us try again," {f.subj} said.',
            ]
        ),
        f"This time they built it {fix}.",
        rng.choice(
            [
                "It stood strong until the end of the day.",
                f"It did not fall, and {h.name} took a picture of it.",
            ]
        ),
    ]
    return " ".join(lines), "if something breaks, you can try again"


def episode_fear(c: Cast, rng: random.Random) -> tuple[str, str]:
    h = c.hero
    fear, helper, truth = rng.choice(FEARS)
    truth = truth.format(poss=h.poss, subj=h.subj)
    lines = [
        f"{h.name} was afraid of {fear}.",
        rng.choice(
            [
                f"Whenever {h.subj} thought about {fear}, {h.poss} tummy felt funny.",
                f"{h.Subj} did not tell anyone, not even {h.poss} {c.relative}.",
            ]
        ),
        f"One day, {h.poss} {c.relative} noticed and asked what was wrong.",
        f'"I am scared of {fear}," said {h.name}.',
        f"So {h.poss} {c.relative} helped {h.obj} with {helper}.",
        truth,
        f"After that, {h.name} was not afraid of {fear} anymore.",
    ]
    return " ".join(lines), "being brave is easier with help"


def episode_take_turns(c: Cast, rng: random.Random) -> tuple[str, str]:
    h, f = c.hero, c.friend
    lines = [
        f"{h.name} and {f.name} both wanted to play with the {c.color} {c.thing.name}.",
        f'"It is mine!" said {h.name}. "No, it is my turn!" said {f.name}.',
        "They pulled and pulled, and nobody had any fun.",
        rng.choice(
            [
                f'Then {h.poss} {c.relative} said, "Why not take turns?"',
                f'Then {h.name} had an idea. "Let us take turns," {h.subj} said.',
            ]
        ),
        f"First {h.name} got to {c.thing.use_by(h)}.",
        f"Then it was {f.name}'s turn, and {f.subj} got to {c.thing.use_by(f)}.",
        "Taking turns was much more fun than fighting.",
    ]
    return " ".join(lines), "taking turns is better than fighting"


def episode_trip(c: Cast, rng: random.Random) -> tuple[str, str]:
    h, p = c.hero, c.place
    sights = rng.sample(p.sights, 3)
    lines = [
        rng.choice(
            [
                f"On {rng.choice(DAYS)}, {h.name} went to {p.name} with {h.poss} {c.relative}.",
                f"{h.name}'s {c.relative} took {h.obj} to {p.name} for the day.",
            ]
        ),
        f"They saw {join_list(sights)}.",
        f"{h.name} liked {sights[rng.randrange(3)]} best.",
        f"Then they decided to {rng.choice(p.activities)}.",
        rng.choice(
            [
                f"For lunch they had {rng.choice(MEALS)}.",
                f"When they got hungry, they ate {rng.choice(FOODS).plural} from a bag.",
            ]
        ),
        f"By the evening, {h.name} was very tired, and {h.subj} fell asleep on the way home.",
    ]
    return " ".join(lines), "there is always something new to see"


def episode_birthday(c: Cast, rng: random.Random) -> tuple[str, str]:
    h, f = c.hero, c.friend
    age = rng.randint(4, 9)
    guests = rng.randint(2, 6)
    gift = rng.choice([t for t in THINGS if t != c.thing])
    lines = [
        f"Today was {h.name}'s birthday.",
        f"Yesterday {h.subj} was {NUMBER_WORDS[age]}, and today {h.subj} was {NUMBER_WORDS[age + 1]}!",
        f"{h.poss.capitalize()} {c.relative} made a cake with {NUMBER_WORDS[age + 1]} candles on it.",
        f"{h.name} invited {NUMBER_WORDS[guests]} friends, and {f.name} came first.",
        f"{f.name} gave {h.obj} {article(gift.name)}.",
        f'"Now I can {gift.use_by(h)}!" said {h.name}.',
        f"{h.name} took a deep breath and blew out all the candles.",
        f"The cake was cut into {NUMBER_WORDS[guests + 1]} pieces: one for each friend and one for {h.name}.",
    ]
    return " ".join(lines), "friends make every day special"


def episode_cooking(c: Cast, rng: random.Random) -> tuple[str, str]:
    h = c.hero
    dish, ingredients, steps = rng.choice(RECIPES)
    lines = [
        rng.choice(
            [
                f"One rainy afternoon, {h.name} and {h.poss} {c.relative} made {dish}.",
                f'{h.name} asked {h.poss} {c.relative}, "Can we make {dish}?" "Yes," came the answer.',
            ]
        ),
        f"They needed {join_list(ingredients)}.",
        f"First they {steps[0]}.",
        f"Then they {steps[1]}.",
        f"At last they {steps[2]}.",
        rng.choice(
            [
                "The kitchen was a mess, but it smelled wonderful.",
                f"{h.name} licked the spoon.",
                "Some flour ended up on the floor, and some on the cat.",
            ]
        ),
        f"{capitalize(dish)} {'were' if dish.endswith('s') else 'was'} {rng.choice(['delicious', 'very good', 'yummy'])}.",
    ]
    return " ".join(lines), "cooking together is fun"


def episode_garden(c: Cast, rng: random.Random) -> tuple[str, str]:
    h = c.hero
    seed, grown, days = rng.choice(PLANTS)
    lines = [
        f"{h.name} planted {seed} in a small pot.",
        f"{h.Subj} gave it water every morning and put it in the sun.",
        "For a few days, nothing happened.",
        rng.choice(
            [
                f'"Is it ever going to grow?" asked {h.name}.',
                f"{h.name} was {rng.choice(['worried', 'impatient'])}.",
            ]
        ),
        f"Then, after {NUMBER_WORDS[days]} days, a tiny green shoot came up.",
        f"{h.name} kept watering it, and by the end of the summer it was {grown}.",
    ]
    return " ".join(lines), "good things take time"


EPISODES: list[Episode] = [
    episode_lost_thing,
    episode_share_food,
    episode_weather,
    episode_learn_skill,
    episode_help_animal,
    episode_build,
    episode_fear,
    episode_take_turns,
    episode_trip,
    episode_birthday,
    episode_cooking,
    episode_garden,
]


def story_intro(c: Cast, rng: random.Random) -> str:
    h = c.hero
    first = rng.choice(
        [
            f"Once upon a time, there was {article(rng.choice(HERO_ADJECTIVES))} {h.kind} named {h.name}.",
            f"{h.name} was {article(rng.choice(HERO_ADJECTIVES))} {h.kind}.",
            f"There once was a little {h.kind} called {h.name}.",
        ]
    )
    more = [
        f"{h.Subj} lived {rng.choice(HOMES)} with {h.poss} {c.relative} and {h.poss} {c.pet.name}, {c.pet_name}.",
        f"{h.Subj} had {article(c.color)} {c.thing.name} and loved to {c.thing.use_by(c.hero)}.",
        f"{h.poss.capitalize()} best friend was {c.friend.name}.",
    ]
    return " ".join([first] + rng.sample(more, rng.randint(1, 3)))


def story_pet_line(c: Cast, rng: random.Random) -> str:
    """An optional sentence that reuses the pet and its fixed facts."""
    return rng.choice(
        [
            f"{c.pet_name} the {c.pet.name} came too.",
            f'At home, {c.pet_name} the {c.pet.name} was waiting, and {c.pet_name} said "{c.pet.sound}!"',
            f"{c.hero.name} gave {c.pet_name} some {c.pet.food}, because every {c.pet.name} likes {c.pet.food}.",
        ]
    )


def make_story(rng: random.Random) -> str:
    """A story: an intro plus one to four episodes with the same cast."""
    c = make_cast(rng)
    n_episodes = rng.choices([1, 2, 3, 4], weights=[12, 6, 3, 1])[0]
    episodes = rng.sample(EPISODES, n_episodes)
    paragraphs: list[str] = []
    lessons: list[str] = []
    for i, episode in enumerate(episodes):
        text, lesson = episode(c, rng)
        lessons.append(lesson)
        if i > 0:
            text = rng.choice(TRANSITIONS) + " " + text
        if rng.random() < 0.25:
            text += " " + story_pet_line(c, rng)
        paragraphs.append(text)
    intro = story_intro(c, rng)
    if n_episodes == 1 and rng.random() < 0.5:
        paragraphs[0] = intro + " " + paragraphs[0]
    else:
        paragraphs.insert(0, intro)
    ending = rng.choice(ENDINGS).format(
        name=c.hero.name, Subj=c.hero.Subj, subj=c.hero.subj, poss=c.hero.poss, relative=c.relative
    )
    if rng.random() < 0.5:
        ending = f"{c.hero.name} learned that {rng.choice(lessons)}. " + ending
    paragraphs.append(ending)
    return "\n\n".join(paragraphs)


def make_tiny_story(rng: random.Random) -> str:
    """Two to four sentences about one character and one animal."""
    h = make_character(rng)
    a = rng.choice(ANIMALS)
    lines = [
        f"{h.name} saw {article(a.name)} {a.home}.",
        rng.choice(
            [
                f'The {a.name} said "{a.sound}".',
                f"The {a.name} was eating {a.food}.",
                f"{h.name} knew that {article(a.name)} {a.trait}.",
            ]
        ),
    ]
    lines += rng.sample(
        [
            f"{h.name} laughed.",
            f"{h.Subj} waved, and then {h.subj} went home.",
            f"{h.Subj} told {h.poss} {rng.choice(RELATIVES)} about it at dinner.",
            f"{h.Subj} drew a picture of the {a.name}.",
        ],
        rng.randint(0, 2),
    )
    return " ".join(lines)


# --------------------------------------------------------------------------- #
# Non-story documents.
# --------------------------------------------------------------------------- #


def arithmetic_fact(rng: random.Random) -> str:
    op = rng.choice(["plus", "minus", "times"])
    if op == "plus":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return rng.choice([f"{a} plus {b} is {a + b}.", f"{a} + {b} = {a + b}"])
    if op == "minus":
        a = rng.randint(0, 30)
        b = rng.randint(0, a)
        return rng.choice([f"{a} minus {b} is {a - b}.", f"{a} - {b} = {a - b}"])
    a, b = rng.randint(0, 10), rng.randint(0, 10)
    return rng.choice([f"{a} times {b} is {a * b}.", f"{a} x {b} = {a * b}"])


def word_problem(rng: random.Random) -> str:
    who = make_character(rng)
    food = rng.choice(FOODS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if rng.random() < 0.5:
        return (
            f"{who.name} has {count(a, food, rng)}. {who.Subj} gets {number(b, rng)} more. "
            f"How many {food.plural} does {who.name} have now? {who.Subj} has {count(a + b, food, rng)}."
        )
    big, small = max(a, b), min(a, b)
    return (
        f"{who.name} has {count(big, food, rng)}. {who.Subj} eats {number(small, rng)}. "
        f"How many {food.plural} are left? There {'is' if big - small == 1 else 'are'} "
        f"{count(big - small, food, rng)} left."
    )


def make_arithmetic(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        return "\n".join(arithmetic_fact(rng) for _ in range(rng.randint(4, 12)))
    if kind < 0.7:
        return "\n\n".join(word_problem(rng) for _ in range(rng.randint(1, 4)))
    n = rng.randint(2, 10)
    title = rng.choice([f"The {n} times table", f"Times table for {n}"])
    return title + ":\n" + "\n".join(f"{i} x {n} = {i * n}" for i in range(1, 11))


def animal_sentences(a: Animal, rng: random.Random) -> list[str]:
    legs = "no legs" if a.legs == 0 else f"{NUMBER_WORDS[a.legs]} legs"
    one = capitalize(article(a.name))  # "A cat", "An owl"
    facts = [
        f'{one} says "{a.sound}".',
        f"{capitalize(a.plural)} eat {a.food}.",
        f"{one} lives {a.home}.",
        f"{one} has {legs}.",
        f"{one} {a.trait}.",
    ]
    rng.shuffle(facts)
    return facts


def make_animal_facts(rng: random.Random) -> str:
    if rng.random() < 0.5:
        a = rng.choice(ANIMALS)
        title = rng.choice([f"All about {a.plural}", f"Facts about the {a.name}", f"The {a.name}"])
        return f"{title}\n\n{capitalize(article(a.name))} is an animal. " + " ".join(animal_sentences(a, rng))
    chosen = rng.sample(ANIMALS, rng.randint(3, 6))
    lines = [rng.choice(["Animals and their sounds:", "What animals say:", "Animal sounds"])]
    lines += [f"The {a.name} says {a.sound}." for a in chosen]
    if rng.random() < 0.5:
        lines.append("")
        lines.append("What do they eat?")
        lines += [f"{capitalize(a.plural)} eat {a.food}." for a in chosen]
    return "\n".join(lines)


def make_questions(rng: random.Random) -> str:
    pairs: list[tuple[str, str]] = []
    for _ in range(rng.randint(3, 7)):
        a = rng.choice(ANIMALS)
        one = article(a.name)
        kind = rng.randrange(5)
        if kind == 0:
            pairs.append((f"What does {one} say?", f'{capitalize(one)} says "{a.sound}".'))
        elif kind == 1:
            pairs.append((f"What do {a.plural} eat?", f"{capitalize(a.plural)} eat {a.food}."))
        elif kind == 2:
            pairs.append((f"Where does {one} live?", f"{capitalize(one)} lives {a.home}."))
        elif kind == 3:
            legs = "no legs" if a.legs == 0 else f"{a.legs} legs"
            pairs.append((f"How many legs does {one} have?", f"{capitalize(one)} has {legs}."))
        else:
            i = rng.randrange(7)
            pairs.append((f"What day comes after {DAYS[i]}?", f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."))
    return "\n".join(f"Q: {q}\nA: {a}" for q, a in pairs)


def make_sequence(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        start = rng.randrange(7)
        days = [DAYS[(start + i) % 7] for i in range(7)]
        return f"The days of the week, starting on {days[0]}: " + ", ".join(days) + "."
    if kind == 1:
        return "There are twelve months in a year: " + join_list(MONTHS) + "."
    if kind == 2:
        lo = rng.randint(0, 10)
        hi = lo + rng.randint(5, 10)
        nums = [NUMBER_WORDS[i] for i in range(lo, min(hi, 20) + 1)]
        if rng.random() < 0.5:
            return "Let us count! " + ", ".join(nums).capitalize() + "."
        return "Counting down: " + ", ".join(reversed(nums)).capitalize() + ". Blast off!"
    if kind == 3:
        step = rng.choice([2, 3, 5, 10])
        return f"Counting by {step}s: " + ", ".join(str(step * i) for i in range(1, 11)) + "."
    season = rng.choice(list(SEASONS))
    return f"There are four seasons: spring, summer, autumn and winter. In {season}, {SEASONS[season]}."


def make_list(rng: random.Random) -> str:
    who = make_character(rng)
    if rng.random() < 0.5:
        items = rng.sample(SHOPPING, rng.randint(3, 8))
        lines = [rng.choice(["Shopping list:", f"{who.name}'s shopping list", "Things to buy:"])]
        lines += [f"- {item}" for item in items]
        return "\n".join(lines)
    place = rng.choice(list(PACKING))
    items = rng.sample(PACKING[place], rng.randint(3, len(PACKING[place])))
    lines = [f"{who.name} is going to {place}. {who.Subj} packs:"]
    lines += [f"{i}. {item}" for i, item in enumerate(items, start=1)]
    return "\n".join(lines)


def make_dialogue(rng: random.Random) -> str:
    a = make_character(rng)
    b = make_character(rng, exclude=(a.name,))
    place = rng.choice(PLACES)
    activity = rng.choice(place.activities)
    day = rng.choice(DAYS)
    lines = [
        f"{a.name}: Hello, {b.name}! Where are you going?",
        f"{b.name}: I am going to {place.name}. I want to {activity}.",
        f"{a.name}: Can I come with you?",
        rng.choice(
            [
                f"{b.name}: Yes, of course! It is more fun with a friend.",
                f"{b.name}: Not today, sorry. But we can go together on {day}.",
            ]
        ),
    ]
    if lines[-1].endswith("friend."):
        lines += [
            f"{a.name}: What will we see there?",
            f"{b.name}: Maybe {rng.choice(place.sights)}.",
            f"{a.name}: Let us go!",
        ]
    else:
        lines += [f"{a.name}: Okay. See you on {day}!", f"{b.name}: Goodbye, {a.name}!"]
    return "\n".join(lines)


def make_letter(rng: random.Random) -> str:
    who = make_character(rng)
    to = rng.choice(["Grandma", "Grandpa", "Aunt Rosa", "Uncle Ben"] + [n for n in BOY_NAMES[:5]])
    place = rng.choice(PLACES)
    sights = rng.sample(place.sights, 2)
    food = rng.choice(FOODS)
    body = (
        f"Today I went to {place.name} with {rng.choice(['Mom', 'Dad', 'my class', 'my friends'])}. "
        f"We saw {sights[0]} and {sights[1]}. We got to {rng.choice(place.activities)}. "
        f"After that we ate {food.plural}. I ate {count(rng.randint(2, 5), food, rng)}!"
    )
    closing = rng.choice(["Love,", "See you soon,", "Hugs,", "Your friend,"])
    return f"Dear {to},\n\n{body}\n\n{rng.choice(['I miss you.', 'I hope you are well.', 'Please write back soon.'])}\n\n{closing}\n{who.name}"


DOCUMENT_KINDS: list[tuple[Callable[[random.Random], str], int]] = [
    (make_story, 35),
    (make_tiny_story, 15),
    (make_arithmetic, 10),
    (make_animal_facts, 7),
    (make_questions, 7),
    (make_sequence, 5),
    (make_list, 5),
    (make_dialogue, 6),
    (make_letter, 5),
]


def generate(seed: int, target_bytes: int, exclude: frozenset[str] = frozenset()) -> list[str]:
    """Draw documents until their JSONL encoding reaches ``target_bytes``, skipping those in ``exclude``."""
    rng = random.Random(seed)
    makers = [maker for maker, _ in DOCUMENT_KINDS]
    weights = [weight for _, weight in DOCUMENT_KINDS]
    docs: list[str] = []
    size = 0
    while size < target_bytes:
        text = rng.choices(makers, weights=weights)[0](rng)
        if text in exclude:
            continue
        docs.append(text)
        size += len(json.dumps({"text": text}, ensure_ascii=False).encode("utf-8")) + 1
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("assets/corpus/stories.jsonl"))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--target-mb", type=float, default=2.5, help="output size in MB (10^6 bytes)")
    parser.add_argument("--exclude", type=Path, help="a corpus whose documents to leave out (a held-out split)")
    args = parser.parse_args()

    exclude = (
        frozenset(json.loads(line)["text"] for line in args.exclude.open(encoding="utf-8"))
        if args.exclude
        else frozenset()
    )
    docs = generate(args.seed, int(args.target_mb * 1_000_000), exclude)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8", newline="\n") as f:
        for text in docs:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")

    words = {w.strip(".,!?:;\"'()").lower() for d in docs for w in d.split()}
    print(f"wrote {len(docs)} documents, {args.out.stat().st_size:,} bytes, {len(words)} distinct words -> {args.out}")


if __name__ == "__main__":
    main()
