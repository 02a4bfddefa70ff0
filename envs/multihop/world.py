"""A procedurally generated encyclopedia and the multi-hop questions asked about it.

:func:`generate_world` builds, deterministically from ``(seed, size)``, a small fictional
world: countries, cities, universities, companies (film studios among them), people and
films, linked by functional relations (a film has one director, a person one birthplace,
a city one country ...). Every entity gets one encyclopedia passage that states its
attributes and names the entities it links to, and nothing about those entities, so a
question about a chain of links needs one passage per link: the hops are real.

:func:`make_question` turns ``(world, split, index)`` into a question with its answer and
the exact chain of passages that answers it:

* **bridge** questions of 2-4 hops follow a relation path from an entity named in the
  question ("In what year was the founder of the studio that produced *The Amber
  Lantern* born?");
* **comparison** questions of 2 or 4 hops compare an attribute of two entities, directly
  or through a relation ("Whose director was born first, *X* or *Y*?"), or ask whether two
  entities share a place (yes/no).

Names are built from invented words that are unique across the world, so searching an
entity's name finds its passage; :class:`QuestionGenerator` additionally checks, when given
an index, that every step's query ranks the needed passage first, and draws again if not.

Questions are split by the entity they start from (a hash of its name), so validation and
test questions ask about entities no training question starts from.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

DEFAULT_WORLD_SIZE = 12_000
MIN_WORLD_SIZE = 200

SPLIT_CODES = {"train": 0, "validation": 1, "test": 2}
KINDS = ("country", "city", "university", "company", "person", "film")

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "tr",
           "v", "w", "z", "th", "sh"]
_VOWELS = ["a", "a", "e", "e", "i", "o", "o", "u", "ai", "ei"]
_CODAS = ["", "", "", "", "n", "n", "r", "r", "l", "s", "m", "nd", "rn", "st", "th"]

_FIRST_NAMES = (
    "Ada Alden Amara Anselm Ari Astrid Beatrix Benedikt Bram Calla Cassius Cora Dario Delphine Desmond Edda "
    "Elias Elin Emeric Esme Ezra Fenna Florian Freya Gideon Greta Hale Hana Idris Ilse Imogen Ines Ivo Jalen "
    "Jonah Juno Kaia Kasimir Kenji Lark Leona Linus Liora Lucan Mabel Magnus Mara Matteo Milo Mira Nadia Nico "
    "Noor Odile Olan Oriel Otto Pavel Petra Quinn Rafe Rhea Rosalind Rowan Sabine Silas Soren Talia Tamsin "
    "Teodor Thea Tobias Ulla Valen Vera Viggo Wren Xavi Yara Yusuf Zadie Zora Anouk Basil Celia Dorian Elodie "
    "Felix Hedda Jasper Lotte Marek Nell Oskar Pia Rupert Saskia Tove Willa"
).split()
_ADJECTIVES = (
    "Amber Ashen Autumn Black Blue Broken Burning Crimson Crystal Dark Distant Electric Emerald Endless Fading "
    "Fallen Final Forgotten Frozen Gentle Gilded Glass Golden Hidden Hollow Iron Ivory Last Lonely Lost Lunar "
    "Midnight Northern Painted Pale Quiet Restless Scarlet Secret Shattered Silent Silver Sleeping Southern "
    "Stolen Summer Sunken Twisted Velvet Violet Wandering Wild Winter Wooden Yellow Bitter Hungry Little Savage"
).split()
_NOUNS = (
    "Anchor Archive Bell Bridge Canyon Carnival Castle Cipher Compass Crown Current Dawn Desert Dream Echo "
    "Empire Engine Feather Forest Fountain Garden Gate Harbor Horizon Island Journey Kingdom Labyrinth Lantern "
    "Letter Lighthouse Machine Meadow Mirror Mountain Orchard Orchestra Passage Pilgrim Prophet River Road "
    "Sailor Shadow Signal Sparrow Storm Stranger Summit Tide Tower Traveler Valley Voyage Wall Witness Wolf"
).split()
_CITY_SUFFIXES = ["", "", "port", "mouth", "ford", "ham", "burg", "vale", "wick", "stead", "haven", "field"]
_COUNTRY_SUFFIXES = ["ia", "land", "ora", "istan", "ea", "onia"]
_LANGUAGE_SUFFIXES = ["ian", "ish", "ese", "i"]
_CONTINENTS = ["Europe", "Asia", "Africa", "North America", "South America", "Oceania"]
_GENRES = ["drama", "comedy", "thriller", "science fiction", "horror", "romance", "adventure", "documentary",
           "animated", "war", "crime", "musical"]
_STUDIO_SUFFIXES = ["Pictures", "Studios", "Films", "Entertainment"]
_COMPANY_KINDS = [("Motors", "automotive"), ("Systems", "software"), ("Foods", "food"), ("Bank", "banking"),
                  ("Airlines", "airline"), ("Pharmaceuticals", "pharmaceutical"), ("Energy", "energy"),
                  ("Telecom", "telecommunications"), ("Textiles", "textile"), ("Shipping", "shipping"),
                  ("Robotics", "robotics"), ("Publishing", "publishing")]
_UNIVERSITY_FORMS = ["{} University", "University of {}", "{} Institute of Technology", "{} College"]
_OCCUPATIONS = ["novelist", "physicist", "architect", "engineer", "painter", "economist", "politician",
                "composer", "entrepreneur", "chemist", "journalist", "mathematician", "sculptor", "diplomat"]


@dataclass
class Entity:
    """One thing in the world: its kind, unique name, attributes and links (entity indices)."""

    kind: str
    name: str
    attrs: dict[str, Any] = field(default_factory=dict)
    links: dict[str, int] = field(default_factory=dict)
    text: str = ""


@dataclass
class World:
    """A generated world. Entity ``i`` owns passage ``i`` (id ``"w{seed}-{i}"``)."""

    seed: int
    size: int
    entities: list[Entity]
    by_kind: dict[str, list[int]]

    def passage_id(self, i: int) -> str:
        """The id of entity ``i``'s passage."""
        return f"w{self.seed}-{i}"

    def passages(self) -> list[dict[str, str]]:
        """All passages as ``{"id", "title", "text"}`` dicts, in entity order."""
        return [{"id": self.passage_id(i), "title": e.name, "text": e.text} for i, e in enumerate(self.entities)]


# ----------------------------------------------------------------------------- generation

def _pseudo_words(rng: np.random.Generator, n: int, taken: set[str]) -> list[str]:
    """``n`` new capitalised invented words, none in ``taken`` (which is updated)."""
    out: list[str] = []
    reserved = {w.lower() for w in _ADJECTIVES + _NOUNS + _FIRST_NAMES}
    while len(out) < n:
        syllables = 2 if rng.random() < 0.9 else 3
        word = "".join(
            _ONSETS[rng.integers(len(_ONSETS))] + _VOWELS[rng.integers(len(_VOWELS))] + _CODAS[rng.integers(len(_CODAS))]
            for _ in range(syllables)
        )
        if len(word) < 5 or len(word) > 9 or word in taken or word in reserved:
            continue
        taken.add(word)
        out.append(word.capitalize())
    return out


def _counts(size: int) -> dict[str, int]:
    countries = max(6, round(size * 0.004))
    cities = max(2 * countries, round(size * 0.066))
    universities = max(4, round(size * 0.05))
    companies = max(8, round(size * 0.125))
    films = max(8, round(size * 0.333))
    people = size - countries - cities - universities - companies - films
    return {"country": countries, "city": cities, "university": universities, "company": companies,
            "person": people, "film": films}


def _pick(rng: np.random.Generator, options: list[str]) -> str:
    return options[int(rng.integers(len(options)))]


def generate_world(seed: int = 0, size: int = DEFAULT_WORLD_SIZE) -> World:
    """Generate the world of ``seed`` with ``size`` passages (deterministic in both)."""
    if size < MIN_WORLD_SIZE:
        raise ValueError(f"world size must be at least {MIN_WORLD_SIZE} passages, got {size}")
    rng = np.random.default_rng([int(seed), int(size), 0x57041D])
    counts = _counts(size)
    taken: set[str] = set()
    entities: list[Entity] = []
    by_kind: dict[str, list[int]] = {k: [] for k in KINDS}

    def add(e: Entity) -> int:
        by_kind[e.kind].append(len(entities))
        entities.append(e)
        return len(entities) - 1

    # Countries and their cities; each country's first city is its capital.
    for stem in _pseudo_words(rng, counts["country"], taken):
        add(Entity("country", stem + _pick(rng, _COUNTRY_SUFFIXES),
                   {"continent": _pick(rng, _CONTINENTS), "language": stem + _pick(rng, _LANGUAGE_SUFFIXES)}))
    countries = by_kind["country"]
    city_names = _pseudo_words(rng, counts["city"], taken)
    for j, stem in enumerate(city_names):
        country = countries[j] if j < len(countries) else countries[int(rng.integers(len(countries)))]
        name = stem + _pick(rng, _CITY_SUFFIXES)
        name = name[:1] + name[1:].lower()
        add(Entity("city", name, {"founded": int(rng.integers(800, 1900)), "population": int(rng.integers(20, 2500)) * 1000},
                   {"country": country}))
    cities = by_kind["city"]
    for j, c in enumerate(countries):
        entities[c].links["capital"] = cities[j]

    for stem in _pseudo_words(rng, counts["university"], taken):
        add(Entity("university", _pick(rng, _UNIVERSITY_FORMS).format(stem),
                   {"founded": int(rng.integers(1500, 1960))}, {"location": cities[int(rng.integers(len(cities)))]}))
    universities = by_kind["university"]

    # People: names are a common first name and an invented surname; roughly one in ten
    # directs films and one in six acts in them.
    n_people = counts["person"]
    surnames = _pseudo_words(rng, max(1, (n_people * 2) // 3), taken)
    used_names: set[str] = set()
    for _ in range(n_people):
        while True:
            name = f"{_pick(rng, _FIRST_NAMES)} {_pick(rng, surnames)}"
            if name not in used_names:
                used_names.add(name)
                break
        u = float(rng.random())
        occupation = "film director" if u < 0.10 else "actor" if u < 0.25 else _pick(rng, _OCCUPATIONS)
        add(Entity("person", name, {"born": int(rng.integers(1900, 1991)), "occupation": occupation},
                   {"birthplace": cities[int(rng.integers(len(cities)))],
                    "alma_mater": universities[int(rng.integers(len(universities)))]}))
    people = by_kind["person"]
    directors = [p for p in people if entities[p].attrs["occupation"] == "film director"] or people
    actors = [p for p in people if entities[p].attrs["occupation"] == "actor"] or people

    n_companies = counts["company"]
    n_studios = max(2, n_companies // 4)
    for j, stem in enumerate(_pseudo_words(rng, n_companies, taken)):
        founder = people[int(rng.integers(len(people)))]
        born = entities[founder].attrs["born"]
        founded = born + int(rng.integers(22, 1 + min(60, 2022 - born)))
        if j < n_studios:
            name, industry = f"{stem} {_pick(rng, _STUDIO_SUFFIXES)}", "film studio"
        else:
            suffix, industry = _COMPANY_KINDS[int(rng.integers(len(_COMPANY_KINDS)))]
            name = f"{stem} {suffix}"
        add(Entity("company", name, {"founded": founded, "industry": industry},
                   {"founder": founder, "headquarters": cities[int(rng.integers(len(cities)))]}))
    studios = by_kind["company"][:n_studios]
    studio_years = np.array([entities[s].attrs["founded"] for s in studios])

    n_films = counts["film"]
    title_words = _pseudo_words(rng, n_films, taken)
    used_titles: set[str] = set()
    for j in range(n_films):
        while True:
            if rng.random() < 0.5:
                title = f"The {_pick(rng, _ADJECTIVES)} {_pick(rng, _NOUNS)}"
            else:
                title = f"{_pick(rng, _NOUNS)} of {title_words[j]}"
            if title not in used_titles:
                used_titles.add(title)
                break
        director = directors[int(rng.integers(len(directors)))]
        star = actors[int(rng.integers(len(actors)))]
        while star == director:
            star = actors[int(rng.integers(len(actors)))]
        oldest_start = max(entities[director].attrs["born"], entities[star].attrs["born"])
        year = min(2024, oldest_start + int(rng.integers(20, 46)))
        eligible = np.flatnonzero(studio_years < year)
        studio = studios[int(eligible[rng.integers(len(eligible))])] if len(eligible) else studios[int(np.argmin(studio_years))]
        add(Entity("film", title, {"released": year, "genre": _pick(rng, _GENRES)},
                   {"director": director, "star": star, "studio": studio}))

    for e in entities:
        e.text = _describe(e, entities, rng)
    return World(seed=int(seed), size=int(size), entities=entities, by_kind=by_kind)


def _describe(e: Entity, ents: list[Entity], rng: np.random.Generator) -> str:
    """The passage of ``e``: its attributes and the names of what it links to, nothing more."""
    n = lambda key: ents[e.links[key]].name  # noqa: E731
    a = dict(e.attrs)
    if e.kind == "company":
        a["industry"] = "film studio" if a["industry"] == "film studio" else a["industry"] + " company"
    if e.kind == "person":
        a["occupation"] = ("an " if a["occupation"][0] in "aeiou" else "a ") + a["occupation"]
    if e.kind == "film":
        a["a_genre"] = ("an " if a["genre"][0] in "aeiou" else "a ") + a["genre"]
    v = int(rng.integers(2))
    if e.kind == "country":
        return (f"{e.name} is a country in {a['continent']}. Its capital is {n('capital')}, and its official language is "
                f"{a['language']}." if v else
                f"{e.name} is a sovereign state located in {a['continent']}. The official language of {e.name} is "
                f"{a['language']} and the capital city is {n('capital')}.")
    if e.kind == "city":
        pop = f"{a['population']:,}"
        return (f"{e.name} is a city in {n('country')}. It was founded in {a['founded']} and has a population of about {pop}."
                if v else f"{e.name} is a city located in {n('country')}. Founded in {a['founded']}, {e.name} is home to "
                f"roughly {pop} people.")
    if e.kind == "university":
        return (f"{e.name} is a public research university in {n('location')}. It was founded in {a['founded']}."
                if v else f"{e.name} was founded in {a['founded']}. The university is located in {n('location')}.")
    if e.kind == "company":
        return (f"{e.name} is a {a['industry']} founded in {a['founded']} by {n('founder')}. It is headquartered in "
                f"{n('headquarters')}." if v else f"{e.name} is a {a['industry']} headquartered in "
                f"{n('headquarters')}. It was founded by {n('founder')} in {a['founded']}.")
    if e.kind == "person":
        surname = e.name.split()[-1]
        return (f"{e.name} (born {a['born']}) is {a['occupation']}. {surname} was born in {n('birthplace')} and studied at "
                f"{n('alma_mater')}." if v else f"{e.name} is {a['occupation']}, born in {a['born']} in {n('birthplace')}. "
                f"{e.name} graduated from {n('alma_mater')}.")
    if e.kind == "film":
        return (f"{e.name} is a {a['released']} {a['genre']} film directed by {n('director')}. It stars {n('star')} in the lead "
                f"role and was produced by {n('studio')}." if v else f"{e.name} is {a['a_genre']} film released in "
                f"{a['released']}. It was directed by {n('director')}, produced by {n('studio')}, and stars {n('star')}.")
    raise ValueError(f"unknown entity kind {e.kind!r}")


# ----------------------------------------------------------------------------- questions

# relation: (source kind, target kind, noun phrase around {x}, question asking for the target,
#            what to look for, fact sentence)
RELATIONS: dict[str, tuple[str, str, str, str, str, str]] = {
    "director": ("film", "person", "the director of {x}", "Who directed {x}?", "who directed {x}", "{x} was directed by {y}"),
    "star": ("film", "person", "the lead actor of {x}", "Who played the lead role in {x}?", "who starred in {x}",
             "{x} stars {y} in the lead role"),
    "studio": ("film", "company", "the studio that produced {x}", "Which studio produced {x}?", "which studio produced {x}",
               "{x} was produced by {y}"),
    "birthplace": ("person", "city", "the birthplace of {x}", "Where was {x} born?", "where {x} was born",
                   "{x} was born in {y}"),
    "alma_mater": ("person", "university", "the university attended by {x}", "Which university did {x} attend?",
                   "where {x} studied", "{x} studied at {y}"),
    "founder": ("company", "person", "the founder of {x}", "Who founded {x}?", "who founded {x}", "{x} was founded by {y}"),
    "headquarters": ("company", "city", "the city where {x} is headquartered", "In which city is {x} headquartered?",
                     "where {x} is headquartered", "{x} is headquartered in {y}"),
    "location": ("university", "city", "the city where {x} is located", "In which city is {x} located?",
                 "where {x} is located", "{x} is located in {y}"),
    "country": ("city", "country", "the country containing {x}", "In which country is {x}?", "which country {x} is in",
                "{x} is in {y}"),
    "capital": ("country", "city", "the capital of {x}", "What is the capital of {x}?", "the capital of {x}",
                "the capital of {x} is {y}"),
}
# attribute: (kind, question around {x}, what to look for, fact sentence)
ATTRIBUTES: dict[str, tuple[str, str, str, str]] = {
    "released": ("film", "In what year was {x} released?", "when {x} was released", "{x} was released in {y}"),
    "born": ("person", "In what year was {x} born?", "when {x} was born", "{x} was born in {y}"),
    "founded": ("company", "In what year was {x} founded?", "when {x} was founded", "{x} was founded in {y}"),
    "founded_u": ("university", "In what year was {x} founded?", "when {x} was founded", "{x} was founded in {y}"),
    "founded_c": ("city", "In what year was {x} founded?", "when {x} was founded", "{x} was founded in {y}"),
    "continent": ("country", "On which continent is {x}?", "which continent {x} is on", "{x} is in {y}"),
    "language": ("country", "What is the official language of {x}?", "the official language of {x}",
                 "the official language of {x} is {y}"),
}
_ATTR_KEY = {"founded_u": "founded", "founded_c": "founded"}
# comparisons of a year: (kind, question, which wins: "min"/"max", attribute)
_YEAR_COMPARISONS = [
    ("film", "Which film was released first, {a} or {b}?", "min", "released"),
    ("film", "Which film came out more recently, {a} or {b}?", "max", "released"),
    ("person", "Who was born first, {a} or {b}?", "min", "born"),
    ("person", "Who is younger, {a} or {b}?", "max", "born"),
    ("company", "Which company was founded earlier, {a} or {b}?", "min", "founded"),
    ("university", "Which university is older, {a} or {b}?", "min", "founded_u"),
]
# comparisons through a relation: (kind, relation, question, min/max, attribute of the target)
_LINKED_COMPARISONS = [
    ("film", "director", "Whose director was born first, {a} or {b}?", "min", "born"),
    ("film", "star", "Which film's lead actor is older, {a} or {b}?", "min", "born"),
    ("film", "studio", "Which film was produced by the older studio, {a} or {b}?", "min", "founded"),
    ("company", "founder", "Which company's founder was born later, {a} or {b}?", "max", "born"),
]
# yes/no: same value of a relation. (kind, relation, question)
_SAME_DIRECT = [
    ("city", "country", "Are {a} and {b} located in the same country?"),
    ("person", "birthplace", "Were {a} and {b} born in the same city?"),
    ("company", "headquarters", "Are {a} and {b} headquartered in the same city?"),
    ("person", "alma_mater", "Did {a} and {b} attend the same university?"),
]
_SAME_LINKED = [
    ("film", "director", "birthplace", "Were the directors of {a} and {b} born in the same city?"),
    ("film", "studio", "headquarters", "Were {a} and {b} produced by studios headquartered in the same city?"),
    ("company", "founder", "birthplace", "Were the founders of {a} and {b} born in the same city?"),
]


def entity_split(name: str) -> str:
    """The split whose questions may start from the entity called ``name`` (about 80/10/10)."""
    bucket = zlib.crc32(name.encode()) % 10
    return "test" if bucket == 0 else "validation" if bucket == 1 else "train"


class QuestionError(Exception):
    """A draw that cannot make a valid question (drawn again by the generator)."""


@dataclass
class Step:
    """One search the question needs: the query, the passage it must find, and what it reads there."""

    query: str
    passage: int
    need: str
    fact: str


@dataclass
class Question:
    """A question with its answer, type, hop count and solving chain."""

    text: str
    answer: str
    kind: str
    hops: int
    steps: list[Step]
    candidates: list[str] = field(default_factory=list)
    template: str = ""


class QuestionGenerator:
    """Draws questions about a world, by (split, index), deterministically.

    ``check`` (optional) is ``check(query, passage) -> bool``, typically "the index ranks
    ``passage`` first for ``query``"; draws whose steps fail it are discarded, so every
    question is answerable from the passages its own queries retrieve.
    """

    MAX_DRAWS = 64

    def __init__(self, world: World, check: Callable[[str, int], bool] | None = None):
        self.world = world
        self.check = check
        ents = world.entities
        self.anchors: dict[str, dict[str, list[int]]] = {s: {k: [] for k in KINDS} for s in SPLIT_CODES}
        for i, e in enumerate(ents):
            self.anchors[entity_split(e.name)][e.kind].append(i)
        # entities of a kind sharing a link target, for "yes" answers of same-place questions
        self.sharing: dict[tuple[str, str], dict[int, list[int]]] = {}
        for kind, rel, *_ in _SAME_DIRECT:
            groups: dict[int, list[int]] = {}
            for i in world.by_kind[kind]:
                groups.setdefault(ents[i].links[rel], []).append(i)
            self.sharing[(kind, rel)] = groups

    # -- helpers
    def _name(self, i: int) -> str:
        return self.world.entities[i].name

    def _attr(self, i: int, attr: str) -> Any:
        return self.world.entities[i].attrs[_ATTR_KEY.get(attr, attr)]

    def _anchor(self, rng: np.random.Generator, split: str, kind: str) -> int:
        pool = self.anchors[split][kind] or self.world.by_kind[kind]
        return pool[int(rng.integers(len(pool)))]

    def _link_step(self, src: int, rel: str) -> tuple[int, Step]:
        dst = self.world.entities[src].links[rel]
        need, fact = RELATIONS[rel][4:]
        x = self._name(src)
        return dst, Step(query=x, passage=src, need=need.format(x=x), fact=fact.format(x=x, y=self._name(dst)))

    def _attr_step(self, src: int, attr: str) -> Step:
        _, _, need, fact = ATTRIBUTES[attr]
        x = self._name(src)
        return Step(query=x, passage=src, need=need.format(x=x), fact=fact.format(x=x, y=self._attr(src, attr)))

    # -- question kinds
    def _bridge(self, rng: np.random.Generator, split: str, hops: int) -> Question:
        # a path of relations ending either in an attribute (hops-1 links) or an entity (hops links)
        entity_answer = bool(rng.random() < 0.4)
        n_links = hops if entity_answer else hops - 1
        path: list[str] = []
        kind = _pick(rng, ["film", "film", "company", "person", "university", "city"])
        for _ in range(n_links):
            options = [r for r, spec in RELATIONS.items() if spec[0] == kind]
            if not options:
                raise QuestionError("dead end")
            rel = _pick(rng, options)
            path.append(rel)
            kind = RELATIONS[rel][1]
        attr = None
        if not entity_answer:
            attrs = [a for a, spec in ATTRIBUTES.items() if spec[0] == kind]
            attr = _pick(rng, attrs)
        start_kind = RELATIONS[path[0]][0] if path else ATTRIBUTES[attr][0]  # type: ignore[index]
        cur = self._anchor(rng, split, start_kind)
        visited = [cur]
        steps: list[Step] = []
        phrase = self._name(cur)
        for j, rel in enumerate(path):
            cur, step = self._link_step(cur, rel)
            if cur in visited:
                raise QuestionError("the path revisits an entity")
            visited.append(cur)
            steps.append(step)
            if attr is None and j == len(path) - 1:
                text = RELATIONS[rel][3].format(x=phrase)
            else:
                phrase = RELATIONS[rel][2].format(x=phrase)
        if attr is None:
            answer = self._name(cur)
        else:
            steps.append(self._attr_step(cur, attr))
            text = ATTRIBUTES[attr][1].format(x=phrase)
            answer = str(self._attr(cur, attr))
        text = text[0].upper() + text[1:]
        return Question(text=text, answer=answer, kind="bridge", hops=len(steps), steps=steps,
                        template="/".join(path + ([attr] if attr else [])))

    def _pair(self, rng: np.random.Generator, split: str, kind: str) -> tuple[int, int]:
        a = self._anchor(rng, split, kind)
        b = self._anchor(rng, split, kind)
        if a == b:
            raise QuestionError("same entity twice")
        return a, b

    def _compare_years(self, rng: np.random.Generator, split: str, linked: bool) -> Question:
        if linked:
            kind, rel, template, pick, attr = _LINKED_COMPARISONS[int(rng.integers(len(_LINKED_COMPARISONS)))]
        else:
            kind, template, pick, attr = _YEAR_COMPARISONS[int(rng.integers(len(_YEAR_COMPARISONS)))]
            rel = None
        a, b = self._pair(rng, split, kind)
        steps: list[Step] = []
        values = []
        for x in (a, b):
            target = x
            if rel is not None:
                target, step = self._link_step(x, rel)
                steps.append(step)
            steps.append(self._attr_step(target, attr))
            values.append(self._attr(target, attr))
        if values[0] == values[1] or (rel is not None and steps[1].passage == steps[3].passage):
            raise QuestionError("a tie")
        first = (values[0] < values[1]) == (pick == "min")
        answer = self._name(a if first else b)
        return Question(text=template.format(a=self._name(a), b=self._name(b)), answer=answer, kind="comparison",
                        hops=len(steps), steps=steps, candidates=[self._name(a), self._name(b)],
                        template=f"{kind}/{rel or ''}/{attr}/{pick}")

    def _compare_same(self, rng: np.random.Generator, split: str, linked: bool) -> Question:
        want_yes = bool(rng.random() < 0.5)
        if linked:
            kind, rel, rel2, template = _SAME_LINKED[int(rng.integers(len(_SAME_LINKED)))]
            inner_kind = RELATIONS[rel][1]
            a = self._anchor(rng, split, kind)
            inner_a = self.world.entities[a].links[rel]
            if want_yes:
                group = self.sharing[(inner_kind, rel2)][self.world.entities[inner_a].links[rel2]]
                # another entity of ``kind`` whose linked entity shares the place
                cands = [j for j in self.anchors[split][kind] if self.world.entities[j].links[rel] in group
                         and self.world.entities[j].links[rel] != inner_a]
                if not cands:
                    raise QuestionError("no partner shares the place")
                b = cands[int(rng.integers(len(cands)))]
            else:
                b = self._anchor(rng, split, kind)
            steps = []
            places = []
            for x in (a, b):
                inner, s1 = self._link_step(x, rel)
                place, s2 = self._link_step(inner, rel2)
                steps += [s1, s2]
                places.append(place)
            if steps[1].passage == steps[3].passage or a == b:
                raise QuestionError("the same linked entity twice")
        else:
            kind, rel, template = _SAME_DIRECT[int(rng.integers(len(_SAME_DIRECT)))]
            a = self._anchor(rng, split, kind)
            if want_yes:
                group = [j for j in self.sharing[(kind, rel)][self.world.entities[a].links[rel]]
                         if j != a and entity_split(self._name(j)) == split]
                if not group:
                    raise QuestionError("no partner shares the place")
                b = group[int(rng.integers(len(group)))]
            else:
                b = self._anchor(rng, split, kind)
            if a == b:
                raise QuestionError("same entity twice")
            steps, places = [], []
            for x in (a, b):
                place, s = self._link_step(x, rel)
                steps.append(s)
                places.append(place)
        answer = "yes" if places[0] == places[1] else "no"
        return Question(text=template.format(a=self._name(a), b=self._name(b)), answer=answer, kind="comparison",
                        hops=len(steps), steps=steps, candidates=["yes", "no"],
                        template=f"same/{kind}/{rel}" + (f"/{rel2}" if linked else ""))

    def draw(self, rng: np.random.Generator, split: str) -> Question:
        """One question; draws again (up to :attr:`MAX_DRAWS` times) until it is valid and checked."""
        for _ in range(self.MAX_DRAWS):
            u = float(rng.random())
            try:
                if u < 0.6:
                    q = self._bridge(rng, split, hops=int(rng.integers(2, 5)))
                elif u < 0.8:
                    q = self._compare_years(rng, split, linked=bool(rng.random() < 0.5))
                else:
                    q = self._compare_same(rng, split, linked=bool(rng.random() < 0.5))
            except QuestionError:
                continue
            if not self._hops_are_needed(q):
                continue
            if self.check is None or all(self.check(s.query, s.passage) for s in q.steps):
                return q
        raise RuntimeError("could not draw a valid question; the world is too small")

    def _hops_are_needed(self, q: Question) -> bool:
        """A bridge answer must not already be written in a passage before the chain's last
        (a year can coincide by chance: a studio founded in a film's release year)."""
        if q.kind != "bridge":
            return True
        answer = f" {q.answer.lower()} "
        for s in q.steps[:-1]:
            text = " " + "".join(c if c.isalnum() else " " for c in self.world.entities[s.passage].text.lower()) + " "
            if answer in text:
                return False
        return True

    def question(self, split: str, index: int) -> Question:
        """The question at ``(split, index)`` (deterministic in the world seed, split and index)."""
        if split not in SPLIT_CODES:
            raise ValueError(f"unknown split {split!r}; expected one of {list(SPLIT_CODES)}")
        rng = np.random.default_rng([self.world.seed, self.world.size, SPLIT_CODES[split], int(index)])
        return self.draw(rng, split)

