"""``trace_gym/ToolCalls-v0``: procedural multi-turn function calling with a state-checked goal.

Each task is a small office world -- bank accounts, a shop inventory, a calendar and a few
files -- and a request to bring it into a goal state ("transfer half of Carol's balance to
Dave, then write Carol's new balance to carol.txt"). The policy sees the world only through
executable tools (``get_balance``, ``transfer``, ``find_item``, ``move_item``, ``list_events``,
``create_event``, ``write_file`` ...). The episode is judged on the world, not on the words:
reward is 1 when the final world state equals the goal state exactly, so a missing step, an
extra transfer or a wrong file content all score 0.

Difficulty is graded (``difficulty=1..4``; by default it cycles with the task index):

1. one request whose arguments are all in the prompt;
2. two requests, one of which needs a lookup first (find an item's SKU, read a balance);
3. three requests, one of which chains lookups across domains (report a balance to a file,
   move every item of a location, a purchase that changes stock and balances);
4. four requests over two user turns: after the agent's first ``<answer>`` the user's
   follow-up arrives as the next observation (``info["role"] == "user"``).

Tasks are deterministic in (seed, index, split) and need nothing beyond trace-gym's core.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable, ClassVar

import numpy as np

from trace_gym.env.base import AgentEnv, TurnResult
from trace_gym.env.react import ParsedTurn, format_answer, format_tool_call
from trace_gym.task import Split, Task
from trace_gym.env.tools import Tool, ToolError

DIFFICULTIES = (1, 2, 3, 4)
_SPLIT_CODE = {"train": 0, "validation": 1, "test": 2}
_PEOPLE = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy",
           "Mallory", "Niaj", "Olivia", "Peggy", "Rupert", "Sybil", "Trent", "Victor", "Walter", "Yara"]
_COLOURS = ["red", "blue", "green", "black", "white", "yellow", "silver", "orange", "purple", "grey"]
_THINGS = ["lamp", "mug", "chair", "notebook", "kettle", "clock", "backpack", "umbrella", "scarf", "stapler",
           "headphones", "vase", "blanket", "candle", "toaster"]
_LOCATIONS = ["front", "back", "attic", "cellar", "garage", "storeroom"]
_TITLES = ["Team sync", "Budget review", "Design critique", "Hiring panel", "Quarterly planning", "Vendor call",
           "Offsite prep", "Security audit", "Product demo", "Lunch and learn", "Retro", "Roadmap review"]
_PHRASES = ["buy more coffee", "call the landlord", "renew the domain", "book the venue", "water the plants",
            "send the invoices", "update the wiki", "order new badges"]
SHOP = "Shop"


# ----------------------------------------------------------------------------- world operations
# Pure functions on the world dict; the tools and the solver both go through them.


def _account(world: dict[str, Any], name: str) -> str:
    if name not in world["accounts"]:
        raise ToolError(f"no account named {name!r}")
    return name


def _item(world: dict[str, Any], sku: str) -> dict[str, Any]:
    if sku not in world["items"]:
        raise ToolError(f"no item with SKU {sku!r}")
    return world["items"][sku]


def _check_day_hour(day: int, hour: int) -> None:
    if not 1 <= day <= 7:
        raise ToolError(f"day must be between 1 and 7, got {day}")
    if not 8 <= hour <= 18:
        raise ToolError(f"hour must be between 8 and 18, got {hour}")


def op_transfer(world: dict[str, Any], source: str, target: str, amount: int) -> str:
    """Move ``amount`` dollars between two accounts."""
    _account(world, source), _account(world, target)
    if source == target:
        raise ToolError("source and target must differ")
    if amount <= 0:
        raise ToolError(f"amount must be positive, got {amount}")
    if world["accounts"][source] < amount:
        raise ToolError(f"insufficient funds: {source} has {world['accounts'][source]} dollars")
    world["accounts"][source] -= amount
    world["accounts"][target] += amount
    return f"Transferred {amount} dollars from {source} to {target}."


def op_move_item(world: dict[str, Any], sku: str, location: str) -> str:
    """Move an item to a location."""
    if location not in _LOCATIONS:
        raise ToolError(f"unknown location {location!r}; locations are {', '.join(_LOCATIONS)}")
    _item(world, sku)["location"] = location
    return f"Moved {sku} to the {location}."


def op_set_quantity(world: dict[str, Any], sku: str, quantity: int) -> str:
    """Set an item's stock."""
    if quantity < 0:
        raise ToolError(f"quantity cannot be negative, got {quantity}")
    _item(world, sku)["qty"] = quantity
    return f"Stock of {sku} is now {quantity}."


def op_create_event(world: dict[str, Any], title: str, day: int, hour: int, attendees: list[str]) -> str:
    """Add an event; returns its id."""
    _check_day_hour(day, hour)
    for person in attendees:
        _account(world, person)
    event_id = f"EV-{world['next_event']}"
    world["next_event"] += 1
    world["events"][event_id] = {"title": title, "day": day, "hour": hour, "attendees": list(attendees)}
    return event_id


def op_cancel_event(world: dict[str, Any], event_id: str) -> str:
    """Remove an event."""
    if event_id not in world["events"]:
        raise ToolError(f"no event with id {event_id!r}")
    del world["events"][event_id]
    return f"Cancelled {event_id}."


def op_reschedule_event(world: dict[str, Any], event_id: str, day: int, hour: int) -> str:
    """Move an event to another slot."""
    if event_id not in world["events"]:
        raise ToolError(f"no event with id {event_id!r}")
    _check_day_hour(day, hour)
    world["events"][event_id].update(day=day, hour=hour)
    return f"Rescheduled {event_id} to day {day} at {hour}:00."


def op_write_file(world: dict[str, Any], path: str, content: str) -> str:
    """Create or overwrite a file."""
    if not path or len(path) > 200:
        raise ToolError("path must be 1-200 characters")
    world["files"][path] = content
    return f"Wrote {len(content)} characters to {path}."


def canonical_state(world: dict[str, Any]) -> dict[str, Any]:
    """The part of the world a goal is about: balances, items, events (without their ids, which
    depend on how many events were created on the way) and files. JSON-compatible."""
    events = sorted([e["title"], e["day"], e["hour"], sorted(e["attendees"])] for e in world["events"].values())
    return json.loads(json.dumps({"accounts": world["accounts"], "items": world["items"], "events": events, "files": world["files"]}, sort_keys=True))


# ----------------------------------------------------------------------------- tools


def make_tools(get_world: Callable[[], dict[str, Any]]) -> list[Tool]:
    """The executable tools of a ToolCalls episode, acting on the world ``get_world()`` returns."""

    def list_accounts() -> dict[str, int]:
        """List every bank account with its balance in dollars."""
        return dict(get_world()["accounts"])

    def get_balance(account: str) -> int:
        """Get the balance of one account, in dollars.

        Args:
            account: The account holder's name, e.g. "Alice".
        """
        world = get_world()
        return world["accounts"][_account(world, account)]

    def transfer(source: str, target: str, amount: int) -> str:
        """Transfer money between two accounts.

        Args:
            source: Account to take the money from.
            target: Account to pay the money into.
            amount: Whole dollars to move; must be positive and covered by the source balance.
        """
        return op_transfer(get_world(), source, target, amount)

    def list_items(location: str | None = None) -> list[dict[str, Any]]:
        """List the shop's items, optionally only those stored at one location.

        Args:
            location: One of front, back, attic, cellar, garage, storeroom; omit for all items.
        """
        items = get_world()["items"]
        return [dict(sku=sku, **item) for sku, item in sorted(items.items()) if location is None or item["location"] == location]

    def find_item(name: str) -> dict[str, Any]:
        """Find an item by its name and return its SKU, stock, price and location.

        Args:
            name: The item's name, e.g. "red lamp".
        """
        for sku, item in sorted(get_world()["items"].items()):
            if item["name"].lower() == name.strip().lower():
                return dict(sku=sku, **item)
        raise ToolError(f"no item named {name!r}")

    def move_item(sku: str, location: str) -> str:
        """Move an item to another storage location.

        Args:
            sku: The item's SKU, e.g. "SKU-103".
            location: One of front, back, attic, cellar, garage, storeroom.
        """
        return op_move_item(get_world(), sku, location)

    def set_quantity(sku: str, quantity: int) -> str:
        """Set the stock count of an item.

        Args:
            sku: The item's SKU.
            quantity: The new number of units in stock (not negative).
        """
        return op_set_quantity(get_world(), sku, quantity)

    def list_events(day: int | None = None) -> list[dict[str, Any]]:
        """List calendar events, optionally only those of one day.

        Args:
            day: Day number 1-7; omit for every day.
        """
        events = get_world()["events"]
        return [dict(id=eid, **ev) for eid, ev in events.items() if day is None or ev["day"] == day]

    def create_event(title: str, day: int, hour: int, attendees: list[str]) -> str:
        """Create a calendar event and return its id.

        Args:
            title: The event's title.
            day: Day number 1-7.
            hour: Starting hour, 8-18.
            attendees: Names of the people attending.
        """
        return op_create_event(get_world(), title, day, hour, attendees)

    def cancel_event(event_id: str) -> str:
        """Cancel (delete) a calendar event.

        Args:
            event_id: The event's id, e.g. "EV-2".
        """
        return op_cancel_event(get_world(), event_id)

    def reschedule_event(event_id: str, day: int, hour: int) -> str:
        """Move a calendar event to another day and hour.

        Args:
            event_id: The event's id.
            day: New day number 1-7.
            hour: New starting hour, 8-18.
        """
        return op_reschedule_event(get_world(), event_id, day, hour)

    def list_files() -> list[str]:
        """List the paths of all files."""
        return sorted(get_world()["files"])

    def read_file(path: str) -> str:
        """Read a file's content.

        Args:
            path: The file's path.
        """
        files = get_world()["files"]
        if path not in files:
            raise ToolError(f"no file {path!r}")
        return files[path]

    def write_file(path: str, content: str) -> str:
        """Create or overwrite a file.

        Args:
            path: The file's path.
            content: The complete new content.
        """
        return op_write_file(get_world(), path, content)

    fns = [list_accounts, get_balance, transfer, list_items, find_item, move_item, set_quantity, list_events,
           create_event, cancel_event, reschedule_event, list_files, read_file, write_file]
    return [Tool.from_function(f) for f in fns]


# ----------------------------------------------------------------------------- task generation and solver

Call = tuple[str, dict[str, Any]]


def _pick(rng: np.random.Generator, seq: list[Any]) -> Any:
    return seq[int(rng.integers(len(seq)))]


def _new_world(rng: np.random.Generator) -> dict[str, Any]:
    people = [str(p) for p in rng.choice(_PEOPLE, size=int(rng.integers(4, 7)), replace=False)]
    accounts = {p: int(rng.integers(20, 400)) for p in people}
    accounts[SHOP] = int(rng.integers(100, 1000))
    n_items, names = int(rng.integers(5, 9)), set()
    while len(names) < n_items:
        names.add(f"{_pick(rng, _COLOURS)} {_pick(rng, _THINGS)}")
    skus = rng.choice(np.arange(100, 1000), size=len(names), replace=False)
    items = {f"SKU-{int(s)}": {"name": n, "qty": int(rng.integers(1, 40)), "price": int(rng.integers(2, 60)),
                               "location": _pick(rng, _LOCATIONS)} for s, n in zip(skus, sorted(names))}
    titles = [str(t) for t in rng.choice(_TITLES, size=int(rng.integers(2, 5)), replace=False)]
    events = {}
    for i, title in enumerate(titles, start=1):
        attendees = [str(p) for p in rng.choice(people, size=int(rng.integers(1, 4)), replace=False)]
        events[f"EV-{i}"] = {"title": title, "day": int(rng.integers(1, 7)), "hour": int(rng.integers(8, 18)), "attendees": attendees}
    files = {"notes.txt": _pick(rng, _PHRASES)}
    return {"accounts": accounts, "items": items, "events": events, "files": files, "next_event": len(events) + 1}


def _find_sku(world: dict[str, Any], name: str) -> str:
    return next(sku for sku, it in sorted(world["items"].items()) if it["name"] == name)


def _find_event(world: dict[str, Any], title: str) -> str:
    return next(eid for eid, ev in world["events"].items() if ev["title"] == title)


def _people(world: dict[str, Any]) -> list[str]:
    return [p for p in world["accounts"] if p != SHOP]


# Each goal kind: a generator (rng, world) -> goal dict or None (not possible here), and a
# planner (world, goal) -> calls, which reads the world the way the agent would via lookups.


def _gen_transfer(rng, world):
    src, dst = (str(p) for p in rng.choice(_people(world), size=2, replace=False))
    if world["accounts"][src] < 2:
        return None
    amount = int(rng.integers(1, min(world["accounts"][src], 150) + 1))
    return {"kind": "transfer", "source": src, "target": dst, "amount": amount,
            "text": f"Transfer {amount} dollars from {src} to {dst}."}


def _plan_transfer(world, g):
    return [("transfer", {"source": g["source"], "target": g["target"], "amount": g["amount"]})]


def _gen_move_sku(rng, world):
    sku = _pick(rng, sorted(world["items"]))
    location = _pick(rng, [x for x in _LOCATIONS if x != world["items"][sku]["location"]])
    return {"kind": "move_sku", "sku": sku, "location": location, "text": f"Move item {sku} to the {location}."}


def _plan_move_sku(world, g):
    return [("move_item", {"sku": g["sku"], "location": g["location"]})]


def _gen_create_event(rng, world):
    free = [t for t in _TITLES if t not in {e["title"] for e in world["events"].values()}]
    if not free:
        return None
    title, day, hour = _pick(rng, free), int(rng.integers(1, 8)), int(rng.integers(8, 19))
    attendees = [str(p) for p in rng.choice(_people(world), size=int(rng.integers(1, 4)), replace=False)]
    who = ", ".join(attendees[:-1]) + (" and " if len(attendees) > 1 else "") + attendees[-1]
    return {"kind": "create_event", "title": title, "day": day, "hour": hour, "attendees": attendees,
            "text": f"Schedule an event titled '{title}' on day {day} at {hour}:00 with {who}."}


def _plan_create_event(world, g):
    return [("create_event", {"title": g["title"], "day": g["day"], "hour": g["hour"], "attendees": g["attendees"]})]


def _gen_write_file(rng, world):
    path = f"{_pick(rng, ['todo', 'memo', 'reminder', 'plan'])}-{int(rng.integers(1, 100))}.txt"
    content = _pick(rng, _PHRASES)
    return {"kind": "write_file", "path": path, "content": content,
            "text": f"Create the file '{path}' containing exactly: {content}"}


def _plan_write_file(world, g):
    return [("write_file", {"path": g["path"], "content": g["content"]})]


def _gen_transfer_half(rng, world):
    src, dst = (str(p) for p in rng.choice(_people(world), size=2, replace=False))
    if world["accounts"][src] < 2:
        return None
    return {"kind": "transfer_half", "source": src, "target": dst,
            "text": f"Transfer half of {src}'s current balance (rounded down to whole dollars) to {dst}."}


def _plan_transfer_half(world, g):
    amount = world["accounts"][g["source"]] // 2
    return [("get_balance", {"account": g["source"]}), ("transfer", {"source": g["source"], "target": g["target"], "amount": amount})]


def _gen_move_by_name(rng, world):
    sku = _pick(rng, sorted(world["items"]))
    item = world["items"][sku]
    location = _pick(rng, [x for x in _LOCATIONS if x != item["location"]])
    return {"kind": "move_by_name", "name": item["name"], "location": location,
            "text": f"Move the {item['name']} to the {location}."}


def _plan_move_by_name(world, g):
    sku = _find_sku(world, g["name"])
    return [("find_item", {"name": g["name"]}), ("move_item", {"sku": sku, "location": g["location"]})]


def _gen_cancel_by_title(rng, world):
    if not world["events"]:
        return None
    title = _pick(rng, sorted(e["title"] for e in world["events"].values()))
    return {"kind": "cancel_by_title", "title": title, "text": f"Cancel the event titled '{title}'."}


def _plan_cancel_by_title(world, g):
    return [("list_events", {}), ("cancel_event", {"event_id": _find_event(world, g["title"])})]


def _gen_add_stock(rng, world):
    sku = _pick(rng, sorted(world["items"]))
    units = int(rng.integers(2, 30))
    return {"kind": "add_stock", "name": world["items"][sku]["name"], "units": units,
            "text": f"We received {units} more units of the {world['items'][sku]['name']}: add them to its stock."}


def _plan_add_stock(world, g):
    sku = _find_sku(world, g["name"])
    return [("find_item", {"name": g["name"]}), ("set_quantity", {"sku": sku, "quantity": world["items"][sku]["qty"] + g["units"]})]


def _gen_report_balance(rng, world):
    person = _pick(rng, _people(world))
    path = f"reports/{person.lower()}.txt"
    return {"kind": "report_balance", "person": person, "path": path,
            "text": f"Write {person}'s current balance in dollars (just the number) to the file '{path}'."}


def _plan_report_balance(world, g):
    return [("get_balance", {"account": g["person"]}), ("write_file", {"path": g["path"], "content": str(world["accounts"][g["person"]])})]


def _gen_move_location(rng, world):
    occupied = sorted({it["location"] for it in world["items"].values()})
    source = _pick(rng, occupied)
    target = _pick(rng, [x for x in _LOCATIONS if x != source])
    return {"kind": "move_location", "source": source, "target": target,
            "text": f"Move every item stored in the {source} to the {target}."}


def _plan_move_location(world, g):
    calls: list[Call] = [("list_items", {"location": g["source"]})]
    for sku, item in sorted(world["items"].items()):
        if item["location"] == g["source"]:
            calls.append(("move_item", {"sku": sku, "location": g["target"]}))
    return calls


def _gen_reschedule(rng, world):
    movable = sorted(e["title"] for e in world["events"].values() if e["day"] < 7)
    if not movable:
        return None
    title = _pick(rng, movable)
    return {"kind": "reschedule_next_day", "title": title,
            "text": f"Push the event titled '{title}' back by one day, keeping its hour."}


def _plan_reschedule(world, g):
    eid = _find_event(world, g["title"])
    ev = world["events"][eid]
    return [("list_events", {}), ("reschedule_event", {"event_id": eid, "day": ev["day"] + 1, "hour": ev["hour"]})]


def _gen_purchase(rng, world):
    buyer = _pick(rng, _people(world))
    sku = _pick(rng, sorted(world["items"]))
    item = world["items"][sku]
    units = int(rng.integers(1, 4))
    if item["qty"] < units or world["accounts"][buyer] < units * item["price"]:
        return None
    return {"kind": "purchase", "buyer": buyer, "name": item["name"], "units": units,
            "text": (f"{buyer} buys {units} unit(s) of the {item['name']}: take them out of stock and transfer "
                     f"their price (units times the unit price) from {buyer} to the {SHOP} account.")}


def _plan_purchase(world, g):
    sku = _find_sku(world, g["name"])
    item = world["items"][sku]
    return [("find_item", {"name": g["name"]}), ("set_quantity", {"sku": sku, "quantity": item["qty"] - g["units"]}),
            ("transfer", {"source": g["buyer"], "target": SHOP, "amount": g["units"] * item["price"]})]


# kind -> (level, generator, planner)
_KINDS: dict[str, tuple[int, Callable, Callable]] = {
    "transfer": (1, _gen_transfer, _plan_transfer),
    "move_sku": (1, _gen_move_sku, _plan_move_sku),
    "create_event": (1, _gen_create_event, _plan_create_event),
    "write_file": (1, _gen_write_file, _plan_write_file),
    "transfer_half": (2, _gen_transfer_half, _plan_transfer_half),
    "move_by_name": (2, _gen_move_by_name, _plan_move_by_name),
    "cancel_by_title": (2, _gen_cancel_by_title, _plan_cancel_by_title),
    "add_stock": (2, _gen_add_stock, _plan_add_stock),
    "report_balance": (3, _gen_report_balance, _plan_report_balance),
    "move_location": (3, _gen_move_location, _plan_move_location),
    "reschedule_next_day": (3, _gen_reschedule, _plan_reschedule),
    "purchase": (3, _gen_purchase, _plan_purchase),
}
_LEVELS: dict[int, list[str]] = {lvl: [k for k, (l, _, _) in _KINDS.items() if l == lvl] for lvl in (1, 2, 3)}
# Goal levels per difficulty, in the order they are drawn (then shuffled), and the user turn
# each goal belongs to.
_RECIPES = {1: ([1], [0]), 2: ([1, 2], [0, 0]), 3: ([1, 2, 3], [0, 0, 0]), 4: ([2, 3, 2, 3], [0, 0, 1, 1])}

_OPS: dict[str, Callable[..., Any]] = {
    "transfer": op_transfer, "move_item": op_move_item, "set_quantity": op_set_quantity, "create_event": op_create_event,
    "cancel_event": op_cancel_event, "reschedule_event": op_reschedule_event, "write_file": op_write_file,
}


def apply_call(world: dict[str, Any], name: str, args: dict[str, Any]) -> None:
    """Apply one state-changing call to ``world`` (lookups change nothing)."""
    if name in _OPS:
        _OPS[name](world, **args)


def solve(world: dict[str, Any], goals: list[dict[str, Any]]) -> tuple[list[list[Call]], dict[str, Any]]:
    """The solver: plan each goal against the world as it stands when its turn comes (lookups
    included), apply it, and return (calls per goal, final world). ``world`` is not modified."""
    world = copy.deepcopy(world)
    plans = []
    for goal in goals:
        calls = _KINDS[goal["kind"]][2](world, goal)
        for name, args in calls:
            apply_call(world, name, args)
        plans.append(calls)
    return plans, world


def _user_message(goals: list[dict[str, Any]], first: bool) -> str:
    lead = "Please do the following, in order:" if first else "Thanks. Next, please do the following, in order:"
    if len(goals) == 1:
        return goals[0]["text"] if first else f"Thanks. Next: {goals[0]['text']}"
    return lead + "\n" + "\n".join(f"{i}. {g['text']}" for i, g in enumerate(goals, start=1))


class ToolCallsTasks:
    """Procedural ToolCalls tasks: ``get(index, split)`` is a pure function of (seed, index, split).

    ``difficulty`` fixes the level (1-4); ``None`` cycles 1, 2, 3, 4 with the index. A task's
    ``metadata`` holds the initial ``world``, the structured ``goals`` with the ``turn`` each
    belongs to, the ``user_turns`` texts and the ``difficulty``; ``ground_truth`` is
    ``{"goal_state": canonical_state(final world)}``.
    """

    SIZE = 1_000_000

    def __init__(self, seed: int = 0, difficulty: int | None = None):
        if difficulty is not None and difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {DIFFICULTIES} or None, got {difficulty!r}")
        self.seed = int(seed)
        self.difficulty = difficulty

    def size(self, split: Split = "train") -> int:
        """A large bound: tasks are generated on demand."""
        return self.SIZE

    def get(self, index: int, split: Split = "train") -> Task:
        """The task at ``index`` of ``split``."""
        if not 0 <= index < self.SIZE:
            raise IndexError(f"ToolCalls index must be in [0, {self.SIZE}), got {index}")
        if split not in _SPLIT_CODE:
            raise ValueError(f"unknown split {split!r}")
        difficulty = self.difficulty or DIFFICULTIES[index % len(DIFFICULTIES)]
        rng = np.random.default_rng([self.seed, _SPLIT_CODE[split], index, difficulty])
        world = _new_world(rng)
        levels, turn_of = _RECIPES[difficulty]
        order = rng.permutation(len(levels)) if difficulty < 4 else np.arange(len(levels))
        goals: list[dict[str, Any]] = []
        work = copy.deepcopy(world)
        for k in order:
            for _ in range(50):  # redraw a goal the world cannot host or that would change nothing
                _, gen, plan = _KINDS[_pick(rng, _LEVELS[levels[k]])]
                goal = gen(rng, work)
                if goal is None:
                    continue
                after = copy.deepcopy(work)
                for name, args in plan(after, goal):
                    apply_call(after, name, args)
                if canonical_state(after) != canonical_state(work):
                    break
            else:  # pragma: no cover - every level has kinds that always fit and always change the world
                raise RuntimeError(f"could not generate a goal for task {index} of {split}")
            work = after
            goal["turn"] = int(turn_of[len(goals)])
            goals.append(goal)
        n_turns = max(g["turn"] for g in goals) + 1
        user_turns = [_user_message([g for g in goals if g["turn"] == t], first=(t == 0)) for t in range(n_turns)]
        return Task(
            id=f"toolcalls/{split}/{index}",
            prompt=user_turns[0],
            ground_truth={"goal_state": canonical_state(work)},
            metadata={"difficulty": difficulty, "world": world, "goals": goals, "user_turns": user_turns, "seed": self.seed},
            split=split,
        )


_SYSTEM = (
    "You are an office assistant with tools for bank accounts, the shop inventory, the calendar and files. "
    "Fulfil the user's request by calling tools, each as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; "
    "look things up instead of guessing. When the request is done, reply to the user inside <answer>...</answer>. "
    "You may think first inside <think>...</think>."
)


class ToolCallsEnv(AgentEnv):
    """``trace_gym/ToolCalls-v0``; see the module docstring.

    ``difficulty`` (1-4 or ``None``) is passed to :class:`ToolCallsTasks`. The world is the
    episode's tool state (snapshots copy it). An ``<answer>`` ends the current user turn; after
    the last one the reward is 1 iff :func:`canonical_state` of the world equals the task's goal
    state. ``info["goal_reached"]`` reports the comparison.
    """

    env_id: ClassVar[str] = "trace_gym/ToolCalls-v0"
    default_max_turns: ClassVar[int] = 30
    system_prompt: ClassVar[str] = _SYSTEM

    def __init__(self, *, difficulty: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._source = ToolCallsTasks(seed=self.seed_value, difficulty=difficulty)
        # The tools read the world from the live episode state, so one set serves every episode
        # and every restored snapshot (building their pydantic models costs milliseconds).
        self._toolset = make_tools(lambda: self.state.tool_state["world"])  # type: ignore[union-attr]

    def tasks(self) -> ToolCallsTasks:
        return self._source

    def initial_tool_state(self, task: Task) -> dict[str, Any]:
        return {"world": copy.deepcopy(task.metadata["world"]), "user_turn": 0}

    def build_tools(self, task: Task) -> list[Tool]:
        return list(self._toolset)

    def score(self, task: Task, answer: str) -> float:
        """1.0 iff the current world matches the goal state (the answer text is not judged)."""
        assert self.state is not None
        return float(canonical_state(self.state.tool_state["world"]) == task.ground_truth["goal_state"])

    def turn(self, parsed: ParsedTurn, action: str) -> TurnResult:
        assert self.state is not None
        if parsed.answer is None:
            return super().turn(parsed, action)
        st = self.state.tool_state
        turns = self.state.task.metadata["user_turns"]
        st["user_turn"] += 1
        if st["user_turn"] < len(turns):
            return TurnResult(turns[st["user_turn"]], info={"role": "user", "answer": parsed.answer})
        reward = self.score(self.state.task, parsed.answer)
        return TurnResult("", reward=reward, terminated=True, info={"answer": parsed.answer, "goal_reached": reward == 1.0})

    def demonstrate(self, task: Task) -> list[str]:
        """The solver's calls, one per turn, and an ``<answer>`` closing each user turn."""
        goals = task.metadata["goals"]
        plans, _ = solve(task.metadata["world"], goals)
        out: list[str] = []
        n_turns = len(task.metadata["user_turns"])
        for t in range(n_turns):
            for goal, calls in zip(goals, plans):
                if goal["turn"] == t:
                    out.extend(format_tool_call(name, args) for name, args in calls)
            out.append(format_answer("Done." if t == n_turns - 1 else "Done; anything else?"))
        return out
