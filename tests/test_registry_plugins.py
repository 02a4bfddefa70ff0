"""Plug-ins by entry point: a third-party package, installed into a temporary directory (a
module plus a ``.dist-info`` with ``entry_points.txt``), registers an allocator, a
predictor, an advantage estimator, a policy backend and a ``trace-gym`` subcommand, and
trace-gym finds each by name without importing the package until the name is used. The
built-ins go through the same entry-point groups."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import trace_gym
from trace_gym.registry import PluginError, Registry, UnknownNameError, entry_points

PLUGIN = '''
"""A third-party trace-gym plug-in package."""

import numpy as np

import trace_gym
from trace_gym import Allocator, Generation, Policy, Predictor


class EveryOther(Allocator):
    """Gives k rollouts to every other prompt."""

    name = "acme-alloc"
    default_predictor = "acme-pred"
    advantage = "acme-adv"

    def __init__(self, k: int = 2):
        super().__init__()
        self.k = k

    def plan_roots(self, forest, budget, predictor):
        counts = np.zeros(forest.n_trees, dtype=np.int64)
        counts[::2] = self.k
        while counts.sum() > budget.trajectories:
            counts[np.flatnonzero(counts)[-1]] = 0
        if predictor is not None:
            forest.pred[forest.root_nodes] = predictor.predict(forest.histories(forest.root_nodes))
        return counts


class ConstantPredictor(Predictor):
    """Predicts the same probability for every history."""

    def __init__(self, p: float = 0.5):
        self.p = p

    def predict(self, histories):
        return np.full(len(histories), self.p)

    def update(self, histories, targets, weights=None):
        pass


def plus_one(forest, scale: float = 1.0):
    """``scale`` at every non-root node."""
    return np.where(forest.parent >= 0, float(scale), 0.0)


class EchoPolicy(Policy):
    """Repeats the last prompt token."""

    name = "acme-policy"

    def generate(self, prompts, params):
        return [Generation(token_ids=list(p[-1:]), logprobs=[0.0] * len(p[-1:]), text="echo") for p in prompts]


def hello_command(subparsers):
    """say hello (an acme command)"""
    parser = subparsers.add_parser("acme-hello", help="say hello (an acme command)")
    parser.add_argument("--name", default="world")
    parser.set_defaults(func=lambda args: print(f"hello {args.name}") or 0)
    return parser
'''

ENTRY_POINTS = '''
[trace_gym.allocators]
acme-alloc = acme_plugins:EveryOther
acme-broken = acme_plugins_missing:Nope

[trace_gym.predictors]
acme-pred = acme_plugins:ConstantPredictor

[trace_gym.advantages]
acme-adv = acme_plugins:plus_one

[trace_gym.policies]
acme-policy = acme_plugins:EchoPolicy

[trace_gym.commands]
acme-hello = acme_plugins:hello_command
'''

WIDGETS = '''
def triple(x=1):
    return 3 * x


def shadowed():
    return "entry point"
'''

CHECK = r'''
import sys
import numpy as np
import trace_gym
from trace_gym.registry import PluginError
from trace_gym.allocation.allocator import ALLOCATORS, add_candidates
from trace_gym.predictors.base import PREDICTORS
from trace_gym.policies.base import POLICIES
from trace_gym.forest.advantages import ADVANTAGES

# listed by name, nothing imported yet
assert "acme-alloc" in ALLOCATORS.names() and "acme-alloc" in ALLOCATORS
assert "acme-pred" in PREDICTORS.names() and "acme-adv" in ADVANTAGES.names() and "acme-policy" in POLICIES.names()
assert "acme_plugins" not in sys.modules
import trace_gym.allocators, trace_gym.predictors, trace_gym.policies
assert "acme-alloc" in trace_gym.allocators.names() and "acme-pred" in trace_gym.predictors.names()
assert "acme-policy" in trace_gym.policies.names()

alloc = trace_gym.make_allocator("acme-alloc", k=3)
assert isinstance(alloc, trace_gym.Allocator) and alloc.k == 3 and "acme_plugins" in sys.modules
pred = trace_gym.make_predictor("acme-pred", p=0.25)
assert isinstance(pred, trace_gym.Predictor)
policy = trace_gym.make_policy("acme-policy")
assert isinstance(policy, trace_gym.Policy)
gen = policy.generate([[1, 2, 3]], trace_gym.SamplingParams())
assert gen[0].token_ids == [3]

# the allocator runs under the one driver, with the plug-in predictor and advantage
forest = trace_gym.Forest()
add_candidates(forest, [trace_gym.History(task_id=f"t{i}", prompt=f"p{i}") for i in range(6)])

def rollout(forest, origins):
    for j, o in enumerate(origins):
        t = forest.start_trajectory(int(o))
        forest.add_node(t, text="a", n_tokens=1)
        forest.add_node(t, text="b", n_tokens=1, terminal=True, reward=float(j % 2))

spend = trace_gym.allocate_step(forest, alloc, trace_gym.Budget(trajectories=8), pred, rollout)
assert spend.trajectories == 6 and spend.prompts == 2, spend
assert np.allclose(forest.pred[forest.root_nodes], 0.25)
adv = forest.advantages(alloc.advantage)
assert adv.shape == (len(forest),) and adv[forest.root_nodes].sum() == 0 and adv[forest.parent >= 0].min() == 1.0
assert forest.advantages("acme-adv:scale=2")[-1] == 2.0

# a broken plug-in names its entry point; unknown names suggest close ones
try:
    trace_gym.make_allocator("acme-broken")
except PluginError as exc:
    assert isinstance(exc, ImportError)
    assert "acme-broken = 'acme_plugins_missing:Nope'" in str(exc) and "acme-plugins" in str(exc), str(exc)
else:
    raise AssertionError("a broken entry point loaded")
try:
    trace_gym.make_allocator("acme-aloc")
except KeyError as exc:
    assert "did you mean 'acme-alloc'" in str(exc), str(exc)

# built-ins come through the same groups
assert {"grpo", "trace", "uniform", "dapo", "pcl", "knapsack", "oracle"} <= set(ALLOCATORS.names())
assert {"beta", "hashed", "lm", "oracle"} <= set(PREDICTORS.names())
assert type(trace_gym.make_allocator("grpo")).__module__ == "trace_gym.allocators.grpo"
assert "torch" not in sys.modules  # nothing loaded the lm predictor or the hf policy
print("ok")
'''


@pytest.fixture
def acme(tmp_path: Path) -> Path:
    """A third-party distribution ``acme-plugins`` installed into ``tmp_path``."""
    (tmp_path / "acme_plugins.py").write_text(textwrap.dedent(PLUGIN))
    _dist_info(tmp_path, "acme-plugins", ENTRY_POINTS)
    return tmp_path


def _dist_info(site: Path, name: str, entry_points: str) -> None:
    dist = site / f"{name.replace('-', '_')}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points))


def _run(args: list[str], site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env, cwd=site)


def test_third_party_components_register_by_entry_point(acme):
    proc = _run(["-c", CHECK], acme)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


CLI = "import sys; from trace_gym.cli import main; sys.exit(main(sys.argv[1:]))"


def test_third_party_command(acme):
    proc = _run(["-c", CLI, "acme-hello", "--name", "acme"], acme)
    assert proc.returncode == 0 and proc.stdout.strip() == "hello acme", proc.stdout + proc.stderr
    proc = _run(["-c", CLI, "--help"], acme)
    assert proc.returncode == 0, proc.stderr
    for command in ("acme-hello", "train", "eval", "bench", "leaderboard", "envs", "serve-retriever"):
        assert command in proc.stdout
    assert "say hello (an acme command)" in proc.stdout


def test_registry_entry_points_in_process(tmp_path, monkeypatch):
    (tmp_path / "acme_widgets.py").write_text(textwrap.dedent(WIDGETS))
    _dist_info(tmp_path, "acme-widgets", "[acme.widgets]\ntriple = acme_widgets:triple\nshadowed = acme_widgets:shadowed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry = Registry("widget", group="acme.widgets")
    assert reg.refresh() == ["shadowed", "triple"]  # read fresh: this package was installed after start-up
    assert "acme_widgets" not in sys.modules
    try:
        # a different object under a name an entry point provides is a conflict ...
        with pytest.raises(ValueError, match="already provided by entry point shadowed"):
            reg.register("shadowed", lambda: "decorator")
        # ... unless replaced on purpose
        reg.register("shadowed", lambda: "decorator", overwrite=True)
        assert reg.make("shadowed") == "decorator"
        assert reg.make("triple", x=2) == 6 and "acme_widgets" in sys.modules
        # the module an entry point names may register its own target with the decorator
        import acme_widgets

        assert reg.register("triple", acme_widgets.triple) is acme_widgets.triple
        with pytest.raises(UnknownNameError, match="did you mean 'triple'"):
            reg.get("tripel")
        assert reg.parse("triple:x=4") == ("triple", {"x": 4})
    finally:
        sys.modules.pop("acme_widgets", None)
        monkeypatch.undo()
        entry_points("acme.widgets", fresh=True)  # forget the temporary distribution


def test_builtins_are_entry_points_not_imports():
    code = ("import sys, trace_gym\n"
            "from trace_gym.allocation.allocator import ALLOCATORS\n"
            "from trace_gym.predictors.base import PREDICTORS\n"
            "assert ALLOCATORS.entry_point('trace').value == 'trace_gym.allocators.trace:TraceAllocator'\n"
            "assert PREDICTORS.entry_point('lm').value == 'trace_gym.predictors.lm:LMPredictor'\n"
            "builtins = ('trace_gym.allocators', 'trace_gym.predictors.hashed', 'trace_gym.predictors.lm')\n"
            "assert not [m for m in sys.modules if m.startswith(builtins)]\n"
            "a = trace_gym.make_allocator('oracle')\n"
            "mods = sorted(m for m in sys.modules if m.startswith('trace_gym.allocators.'))\n"
            "assert 'trace_gym.allocators.oracle' in mods and not {'trace_gym.allocators.grpo', "
            "'trace_gym.allocators.dapo', 'trace_gym.allocators.pcl'} & set(mods), mods\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_public_decorators_register_in_process():
    import numpy as np

    @trace_gym.register_advantage("test-zero")
    def zero(forest):
        """All zeros."""
        return np.zeros(len(forest))

    from trace_gym.forest.advantages import ADVANTAGES

    try:
        f = trace_gym.Forest()
        f.add_root("t")
        assert f.advantages("test-zero").tolist() == [0.0]
        with pytest.raises(ValueError, match="already registered"):
            trace_gym.register_advantage("test-zero", lambda forest: np.ones(len(forest)))
        with pytest.raises(ValueError, match="unknown option 'bogus'"):
            f.advantages("test-zero:bogus=1")
    finally:
        ADVANTAGES._table.pop("test-zero", None)


def test_plugin_error_is_an_import_error_naming_the_module():
    err = PluginError("x", name="acme_missing")
    assert isinstance(err, ImportError) and err.name == "acme_missing"
