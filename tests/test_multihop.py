"""MultiHopQA-v0: the generated world, its questions, scoring, fork, fuzzing and dataset loaders."""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from pathlib import Path

import gymnasium
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trace_gym
from trace_gym.env.base import EnvUnavailable
from trace_gym.envs.multihop import MultiHopQAEnv, WorldQuestions
from trace_gym.envs.multihop.answers import exact_match, f1_parts, f1_score, names_several, normalize_answer
from trace_gym.envs.multihop.loaders import DatasetUnavailableError, QADatasetSource
from trace_gym.envs.multihop.world import DEFAULT_WORLD_SIZE, entity_split, generate_world
from trace_gym.envs.multihop.worldindex import world_index

DATA = Path(__file__).parent / "data"
SMALL = 1500  # a small world for tests that do not need the default one


@pytest.fixture(scope="module")
def env():
    e = MultiHopQAEnv(seed=0)
    yield e
    e.close()


# ----------------------------------------------------------------------------- the world


def test_world_is_deterministic_by_seed_and_has_10k_unique_passages():
    a, b, c = generate_world(7, SMALL), generate_world(7, SMALL), generate_world(8, SMALL)
    assert [e.text for e in a.entities] == [e.text for e in b.entities]
    assert [e.text for e in a.entities] != [e.text for e in c.entities]
    w = generate_world(0, DEFAULT_WORLD_SIZE)
    assert len(w.passages()) >= 10_000
    names = [e.name for e in w.entities]
    assert len(set(names)) == len(names), "entity names (passage titles) must be unique"
    assert {e.kind for e in w.entities} == {"country", "city", "university", "company", "person", "film"}


def test_passages_state_links_but_not_the_linked_entities_facts():
    # A film's passage names its director but not the director's birthplace: a hop is needed.
    w = generate_world(0, SMALL)
    for f in w.by_kind["film"][:200]:
        film = w.entities[f]
        director = w.entities[film.links["director"]]
        birthplace = w.entities[director.links["birthplace"]].name
        assert director.name in film.text
        assert str(film.attrs["released"]) in film.text
        assert birthplace not in film.text


def test_questions_are_deterministic_and_cover_types_and_hops():
    src = WorldQuestions(0, SMALL)
    again = WorldQuestions(0, SMALL)
    tasks = [src.get(i, "train") for i in range(300)]
    assert tasks[:20] == [again._get(i, "train") for i in range(20)]
    seen = Counter((t.metadata["type"], t.metadata["hops"]) for t in tasks)
    assert {("bridge", 2), ("bridge", 3), ("bridge", 4), ("comparison", 2), ("comparison", 4)} <= set(seen)
    answers = Counter(t.ground_truth["answers"][0] for t in tasks)
    assert answers["yes"] > 10 and answers["no"] > 10
    assert all(len(t.metadata["steps"]) == t.metadata["hops"] for t in tasks)


def test_splits_start_from_disjoint_entities():
    src = WorldQuestions(0, SMALL)
    for split in ("train", "validation", "test"):
        for i in range(40):
            t = src.get(i, split)
            first = t.metadata["steps"][0]["title"]
            assert entity_split(first) == split


def test_bridge_answers_are_not_in_the_first_passage():
    # The answer of a bridge question sits only at the end of the chain.
    src = WorldQuestions(0, SMALL)
    idx = world_index(0, SMALL)
    texts = {p.id: p.text for p in idx.passages}
    checked = 0
    for i in range(200):
        t = src.get(i, "train")
        if t.metadata["type"] != "bridge":
            continue
        first = t.metadata["steps"][0]["passage_id"]
        assert normalize_answer(t.ground_truth["answers"][0]) not in normalize_answer(texts[first]), t.prompt
        checked += 1
    assert checked > 50


# ----------------------------------------------------------------------------- demonstrate

_TURN = re.compile(r"^<think>[^<>]+</think>\n<tool_call>\n(\{.*\})\n</tool_call>$", re.S)
_FINAL = re.compile(r"^<think>[^<>]+</think>\n<answer>([^<>]+)</answer>$", re.S)


def test_demonstrate_earns_reward_1_on_100_tasks_with_retrievable_steps(env):
    index = world_index(0, DEFAULT_WORLD_SIZE)
    for i in range(100):
        task = env.tasks().get(i, "train")
        env.reset(options={"task": task})
        turns = env.demonstrate(task)
        assert len(turns) <= env.max_turns
        steps = task.metadata["steps"]
        assert len(turns) == len(steps) + 1
        for turn, step in zip(turns, steps):
            m = _TURN.match(turn)
            assert m, turn
            call = json.loads(m.group(1))
            assert call == {"name": "search", "arguments": {"query": step["query"]}}
            # the needed passage is in the top k for the demonstration's own query
            assert step["passage_id"] in [p.id for p, _ in index.search(step["query"], env.topk)]
        assert _FINAL.match(turns[-1]), turns[-1]
        for turn in turns:
            obs, reward, terminated, truncated, info = env.step(turn)
        assert terminated and not truncated
        assert reward == 1.0, (task.prompt, env.render())
        assert info["em"] == 1.0 and info["support_recall"] == 1.0


def test_demonstrate_on_validation_and_test_splits(env):
    for split in ("validation", "test"):
        e = MultiHopQAEnv(split=split)
        for i in range(10):
            task = e.tasks().get(i, split)
            e.reset(options={"task": task})
            for turn in e.demonstrate(task):
                _, reward, *_ = e.step(turn)
            assert reward == 1.0


# ----------------------------------------------------------------------------- scoring

# (prediction, gold, EM, F1) worked out by hand from the official SQuAD v1.1 / HotpotQA scripts
SCORING_TABLE = [
    ("Arthur's Magazine", "Arthur's Magazine", 1.0, 1.0),
    ("arthurs magazine", "Arthur's Magazine", 1.0, 1.0),  # punctuation removed, not split on
    ("The Eiffel Tower", "Eiffel Tower", 1.0, 1.0),  # articles dropped
    ("  an   apple ", "Apple", 1.0, 1.0),  # whitespace collapsed
    ("A.B.C.", "abc", 1.0, 1.0),
    ("well-known", "well known", 0.0, 0.0),  # the hyphen is deleted: "wellknown" vs "well known"
    ("Theodore", "Theo", 0.0, 0.0),  # articles only as whole words
    ("Paris, France", "Paris", 0.0, 2 * (1 / 2 * 1) / (1 / 2 + 1)),
    ("New York City", "New York", 0.0, 2 * (2 / 3) / (2 / 3 + 1)),
    ("the the the", "the", 1.0, 0.0),  # both normalise to "": EM 1, F1 0 (no common tokens)
    ("1987", "1987", 1.0, 1.0),
    ("in 1987", "1987", 0.0, 2 * 0.5 / 1.5),
    ("yes", "Yes.", 1.0, 1.0),
    ("yes", "no", 0.0, 0.0),
    ("no", "no answer", 0.0, 0.0),  # yes/no/noanswer must match exactly
    ("yes it is", "yes", 0.0, 0.0),  # gold "yes": anything else scores 0 under HotpotQA's rule
    ("Chief of Protocol", "chief of protocol", 1.0, 1.0),
    ("Protocol Chief", "Chief of Protocol", 0.0, 2 * 1 * (2 / 3) / (1 + 2 / 3)),
    ("Élan Vital", "élan vital", 1.0, 1.0),  # non-ASCII letters kept, case folded
    ("", "Paris", 0.0, 0.0),
]


@pytest.mark.parametrize("prediction,gold,em,f1", SCORING_TABLE)
def test_em_f1_match_the_official_scripts(prediction, gold, em, f1):
    assert exact_match(prediction, gold) == em
    assert f1_score(prediction, gold) == pytest.approx(f1)


def test_normalize_answer_steps():
    assert normalize_answer("The  Quick, Brown Fox!") == "quick brown fox"
    assert normalize_answer("An apple a day") == "apple day"
    p, r = f1_parts("red green blue", "red green")[1:]
    assert (p, r) == (pytest.approx(2 / 3), 1.0)


def _comparison_task(src, want_yes_no=False):
    for i in range(200):
        t = src.get(i, "train")
        cands = t.ground_truth["candidates"]
        if t.metadata["type"] == "comparison" and (cands == ["yes", "no"]) == want_yes_no:
            return t
    raise AssertionError("no comparison task found")


def test_reward_hacking_gets_nothing(env):
    src = env.tasks()
    t = _comparison_task(src)
    a, b = t.ground_truth["candidates"]
    gold = t.ground_truth["answers"][0]
    f1_env = MultiHopQAEnv(reward="f1")
    for hedge in (f"{a} or {b}", f"{b} or {a}", f"{a}, {b}", f"either {a} or {b}"):
        assert env.score(t, hedge) == 0.0
        assert f1_env.score(t, hedge) == 0.0
    assert env.score(t, gold) == 1.0 and f1_env.score(t, gold) == 1.0
    # yes/no questions: "yes or no" is neither
    yn = _comparison_task(src, want_yes_no=True)
    assert env.score(yn, "yes or no") == 0.0 and f1_env.score(yn, "yes or no") == 0.0
    # bridge questions: a long list of entity names scores 0 EM and a low F1
    bridge = next(src.get(i, "train") for i in range(100) if src.get(i, "train").metadata["type"] == "bridge"
                  and not src.get(i, "train").ground_truth["answers"][0].isdigit())
    names = [e.name for e in src.world.entities[:40]] + [bridge.ground_truth["answers"][0]]
    listing = ", ".join(names)
    assert env.score(bridge, listing) == 0.0
    assert f1_env.score(bridge, listing) < 0.1
    # "A or B" with one right single-token answer: EM 0, F1 at most one half
    years = next(src.get(i, "train") for i in range(300) if src.get(i, "train").ground_truth["answers"][0].isdigit())
    y = years.ground_truth["answers"][0]
    assert env.score(years, f"{y} or {int(y) + 1}") == 0.0
    assert f1_env.score(years, f"{y} or {int(y) + 1}") <= 0.5
    f1_env.close()


def test_names_several():
    assert names_several("The Amber Lantern or Tide of Vos", ["The Amber Lantern", "Tide of Vos"])
    assert not names_several("The Amber Lantern", ["The Amber Lantern", "Tide of Vos"])
    assert not names_several("Amber", ["The Amber Lantern", "Tide of Vos"])


# ----------------------------------------------------------------------------- env API


def test_registry_and_check_env():
    e = trace_gym.make("trace_gym/MultiHopQA-v0", seed=1)
    assert isinstance(e, MultiHopQAEnv) and e.max_turns == 6
    g = gymnasium.make("trace_gym/MultiHopQA-v0", disable_env_checker=True)
    assert isinstance(g.unwrapped, MultiHopQAEnv)
    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no checker warning either
        check_env(e, skip_render_check=True)
    obs, info = e.reset(seed=3)
    assert info["tools"][0]["function"]["name"] == "search"
    assert info["tools"][0]["function"]["parameters"]["required"] == ["query"]
    assert e.observation_space.contains(obs)


def test_search_pages_with_a_cursor_and_bad_queries_are_error_observations():
    env = MultiHopQAEnv(max_turns=10)
    task = env.tasks().get(0, "train")
    env.reset(options={"task": task})
    call = lambda query: f'<tool_call>{{"name": "search", "arguments": {{"query": {json.dumps(query)}}}}}</tool_call>'  # noqa: E731
    env.step(call(task.metadata["steps"][0]["query"]))
    first, *_ = env.step(call("Film  director"))
    second, *_ = env.step(call("film director"))
    titles = lambda obs: re.findall(r"Doc \d+\(Title: ([^)]*)\)", obs)  # noqa: E731
    assert len(titles(first)) == 3 and len(titles(second)) == 3
    assert not set(titles(first)) & set(titles(second)), "a repeated query pages on"
    assert env.state.tool_state["cursor"]["film director"] == 2
    assert env.state.tool_state["queries"] == [task.metadata["steps"][0]["query"], "Film director", "film director"]
    obs, reward, term, trunc, info = env.step(call("   "))
    assert obs.startswith("Error") and "empty" in obs and reward == 0.0 and not term
    obs, *_ = env.step(call("x" * 10_000))
    assert obs.startswith("Error") and "characters" in obs
    obs, *_ = env.step('<tool_call>{"name": "search", "arguments": {"query": 42}}</tool_call>')
    assert obs.startswith("Error") and "query" in obs
    obs, reward, term, trunc, info = env.step("<answer>I do not know</answer>")
    assert term and reward == 0.0 and info["em"] == 0.0 and 0 < info["support_recall"] <= 1


def test_episode_truncates_at_max_turns():
    e = MultiHopQAEnv(max_turns=2)
    e.reset(seed=0)
    e.step('<tool_call>{"name": "search", "arguments": {"query": "film"}}</tool_call>')
    *_, term, trunc, _ = e.step('<tool_call>{"name": "search", "arguments": {"query": "film"}}</tool_call>')
    assert trunc and not term


# ----------------------------------------------------------------------------- fork


def _random_actions(rng: np.random.Generator, task, n: int) -> list[str]:
    steps = task.metadata["steps"]
    pool = [s["query"] for s in steps] + ["film", "university", steps[0]["query"]]
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.7:
            out.append(f'<tool_call>{{"name": "search", "arguments": {{"query": "{pool[rng.integers(len(pool))]}"}}}}</tool_call>')
        elif u < 0.85:
            out.append("<think>hmm</think> no tags")
        else:
            out.append(f"<answer>{rng.choice([task.ground_truth['answers'][0], 'nothing'])}</answer>")
    return out


def _play(env, actions):
    out = []
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        out.append((obs, r, term, trunc))
        if term or trunc:
            break
    return out


def test_snapshot_restore_at_every_turn_replays_identically(env):
    rng = np.random.default_rng(0)
    for i in range(15):
        task = env.tasks().get(i, "train")
        actions = _random_actions(rng, task, env.max_turns)
        env.reset(options={"task": task})
        snaps, trace = [], []
        for a in actions:
            snaps.append(env.snapshot())
            obs, r, term, trunc, _ = env.step(a)
            trace.append((obs, r, term, trunc))
            if term or trunc:
                break
        for t, snap in enumerate(snaps):
            restored = type(snap).from_bytes(snap.to_bytes())
            env.restore(restored)
            assert _play(env, actions[t:len(trace)]) == trace[t:]
            env.restore(snap, branch_id=5)
            assert _play(env, actions[t:len(trace)]) == trace[t:]  # the env draws nothing random


def test_restore_into_a_fresh_env_replays(env):
    task = env.tasks().get(3, "train")
    env.reset(options={"task": task})
    turns = env.demonstrate(task)
    env.step(turns[0])
    snap = env.snapshot()
    rest = _play(env, turns[1:])
    other = MultiHopQAEnv(seed=99)
    other.restore(snap)
    assert _play(other, turns[1:]) == rest
    assert rest[-1][1] == 1.0


# ----------------------------------------------------------------------------- fuzzing

_ADVERSARIAL = [
    "",
    "x" * (1 << 20),
    "<tool_call>{not json</tool_call>",
    '<tool_call>{"name": "search"}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": null}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": ["a", "b"]}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": "\\u0000\\ud800 \\ufffe"}}</tool_call>',
    '<tool_call>{"name": "lookup", "arguments": {"query": "x"}}</tool_call>',
    "<tool_call><answer>1</answer></tool_call>",
    "<answer><tool_call>{}</tool_call></answer>",
    "<answer>1</answer><answer>2</answer>",
    "<tool_call>" + '{"name": "search", "arguments": {"query": "a"}}' + "</tool_call>" * 3,
    "\ud83d\ude00 \u202e \x00 \x1b[31m",
    "<think>unclosed",
    "<tool_call>" * 1000,
]


@pytest.mark.parametrize("action", _ADVERSARIAL, ids=range(len(_ADVERSARIAL)))
def test_adversarial_actions_never_raise(env, action):
    env.reset(seed=1)
    obs, reward, term, trunc, info = env.step(action)
    assert isinstance(obs, str) and env.observation_space.contains(obs)
    assert reward in (0.0, 1.0)
    if not term:
        assert obs.startswith("Error") or "Doc 1" in obs or "No passages" in obs, obs[:200]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=300), wrap=st.sampled_from(["{}", "<tool_call>{}</tool_call>", "<answer>{}</answer>",
                                                          '<tool_call>{{"name": "search", "arguments": {{"query": {}}}}}</tool_call>']))
def test_fuzzed_actions_give_observations_not_exceptions(env, text, wrap):
    env.reset(seed=2)
    action = wrap.format(json.dumps(text) if "query" in wrap else text)
    obs, reward, term, trunc, info = env.step(action)
    assert env.observation_space.contains(obs)
    assert 0.0 <= reward <= 1.0


# ----------------------------------------------------------------------------- datasets


def _run_demo(e, task):
    e.reset(options={"task": task})
    for turn in e.demonstrate(task):
        obs, reward, term, trunc, info = e.step(turn)
    return reward, info


@pytest.mark.parametrize("name,path,n", [("hotpotqa", "hotpotqa_distractor_sample.json", 3),
                                         ("2wikimultihopqa", "2wikimultihopqa_sample.json", 2),
                                         ("musique", "musique_sample.jsonl", 2)])
@pytest.mark.parametrize("index", ["question", "global"])
def test_dataset_sources_from_local_files(name, path, n, index):
    e = MultiHopQAEnv(source=name, data_files=str(DATA / path), dataset_index=index, split="validation")
    src = e.tasks()
    assert src.size("validation") == n  # MuSiQue's unanswerable record is skipped
    for i in range(n):
        task = src.get(i, "validation")
        assert task.metadata["source"] == name and task.metadata["supporting"]
        assert task.metadata["question"] in task.prompt
        reward, info = _run_demo(e, task)
        assert reward == 1.0 and info["support_recall"] == 1.0, e.render()
        if index == "question":
            assert len(src.index_for(task)) == len(task.metadata["paragraphs"])
    if index == "global":
        total = {p["id"] for i in range(n) for p in src.get(i, "validation").metadata["paragraphs"]}
        assert len(src.index_for(src.get(0, "validation"))) == len(total)


def test_dataset_fields_are_read():
    hp = QADatasetSource("hotpotqa", data_files=DATA / "hotpotqa_distractor_sample.json")
    t = hp.get(2, "validation")
    assert t.ground_truth["answers"] == ["Chief of Protocol"]
    assert t.metadata["type"] == "bridge" and t.metadata["level"] == "hard"
    assert [s["title"] for s in t.metadata["steps"]] == ["Kiss and Tell (1945 film)", "Shirley Temple"]
    wk = QADatasetSource("2wikimultihopqa", data_files={"validation": DATA / "2wikimultihopqa_sample.json"})
    t = wk.get(0, "validation")
    assert t.metadata["evidences"][0] == ["Polish-Russian War", "director", "Xawery Zulawski"]
    assert t.metadata["type"] == "compositional"
    mq = QADatasetSource("musique", data_files=DATA / "musique_sample.jsonl")
    t = mq.get(1, "train")
    assert t.ground_truth["answers"] == ["Eugene, Oregon", "Eugene"]
    assert [s["title"] for s in t.metadata["steps"]] == ["The Blue Album", "Harbor Records", "Maya Oakes"]
    assert t.metadata["hops"] == 3
    e = MultiHopQAEnv(source="musique", data_files=DATA / "musique_sample.jsonl")
    assert e.score(t, "Eugene") == 1.0  # an alias


def test_hub_column_form_reads_like_the_json_release():
    rec = json.loads((DATA / "hotpotqa_distractor_sample.json").read_text())[0]
    hub = dict(rec, id=rec["_id"])
    del hub["_id"]
    hub["context"] = {"title": [c[0] for c in rec["context"]], "sentences": [c[1] for c in rec["context"]]}
    hub["supporting_facts"] = {"title": [s[0] for s in rec["supporting_facts"]], "sent_id": [s[1] for s in rec["supporting_facts"]]}
    from trace_gym.envs.multihop.loaders import _wiki_record

    assert _wiki_record(hub, "hotpotqa") == _wiki_record(rec, "hotpotqa")


@pytest.mark.parametrize("env_id,path", [("trace_gym/HotpotQA-v0", "hotpotqa_distractor_sample.json"),
                                         ("trace_gym/2WikiMultiHopQA-v0", "2wikimultihopqa_sample.json"),
                                         ("trace_gym/MuSiQue-v0", "musique_sample.jsonl")])
def test_registered_dataset_envs(monkeypatch, env_id, path):
    e = trace_gym.make(env_id, data_files=str(DATA / path), split="validation")
    assert e.env_id == env_id
    task = e.tasks().get(0, "validation")
    reward, _ = _run_demo(e, task)
    assert reward == 1.0
    snap = e.snapshot()
    assert snap.env_id == env_id
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EnvUnavailable, match="data_files"):  # offline without files: a clear error, at once
        trace_gym.make(env_id)


def test_dataset_errors_are_clear(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = QADatasetSource("hotpotqa")
    with pytest.raises(DatasetUnavailableError, match="data_files"):
        src.get(0, "validation")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "question": "q"}\n')
    with pytest.raises(ValueError, match="schema"):
        QADatasetSource("musique", data_files=bad).get(0, "train")
    with pytest.raises(FileNotFoundError):
        QADatasetSource("musique", data_files=tmp_path / "missing.jsonl").get(0, "train")
    with pytest.raises(ValueError, match="unknown source"):
        MultiHopQAEnv(source="nq")
    with pytest.raises(IndexError):
        QADatasetSource("musique", data_files=DATA / "musique_sample.jsonl").get(5, "train")
