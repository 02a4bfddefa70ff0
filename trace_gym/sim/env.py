"""``trace_gym/ContrastLab-v0``: the text face of ContrastLab, stepped turn by turn by any policy."""

from __future__ import annotations

import random
import time
from typing import Any


from trace_gym.env.base import AgentEnv, TurnResult
from trace_gym.env.react import ParsedTurn
from trace_gym.task import Split, Task
from trace_gym.env.tools import Tool

from trace_gym.sim.world import OBS_EARLY, OBS_NOT_ANSWER, SYSTEM_PROMPT, ContrastLabWorld, action_text, observation_text


class ContrastLabEnv(AgentEnv):
    """``trace_gym/ContrastLab-v0``: the text face of ContrastLab (the model: :mod:`trace_gym.sim.world`).

    Each turn the agent calls ``act`` with an option, or answers with ``<answer>X</answer>``
    on the task's last step. ``info["success_probability"]`` is the exact V(H) of the prefix
    ending at this turn (after ``reset``: the root's), ``info["on_track"]`` the latent bit.

    Args:
        world: the shared :class:`ContrastLabWorld`; when omitted, one is built from
            ``world_kwargs`` (``n_tasks``, ``difficulty``, ``seed`` ... of
            :class:`ContrastLabWorld`; its seed defaults to the env's).
        tool_latency_s: seconds each ``act`` call sleeps (a slow tool: an interpreter, a
            retrieval server; for scale-out benchmarks and tests). Timing only: outcomes
            do not change.
        tool_latency_jitter: each call sleeps a uniform draw in ``tool_latency_s x [1 - j, 1 + j]``.
    """

    env_id = "trace_gym/ContrastLab-v0"
    default_max_turns = 6
    system_prompt = SYSTEM_PROMPT

    def __init__(self, *, world: ContrastLabWorld | None = None, seed: int = 0, split: Split = "train",
                 max_turns: int | None = None, render_mode: str | None = None, tool_latency_s: float = 0.0,
                 tool_latency_jitter: float = 0.0, **world_kwargs: Any):
        super().__init__(seed=seed, split=split, max_turns=max_turns, render_mode=render_mode)
        if tool_latency_s < 0 or not 0 <= tool_latency_jitter <= 1:
            raise ValueError(f"tool_latency_s must be >= 0 and tool_latency_jitter in [0, 1], got {tool_latency_s}, {tool_latency_jitter}")
        self.tool_latency_s = float(tool_latency_s)
        self.tool_latency_jitter = float(tool_latency_jitter)
        if world is None:
            world_kwargs.setdefault("seed", seed)
            world = ContrastLabWorld(**world_kwargs)
        elif world_kwargs:
            raise TypeError(f"pass either world= or world arguments, not both (got {sorted(world_kwargs)})")
        self.world = world
        self.max_turns = max(self.max_turns, world.max_turns) if max_turns is None else self.max_turns

    def tasks(self) -> ContrastLabWorld:
        return self.world

    def _task_index(self) -> int:
        assert self.state is not None
        return self.world.index_of(self.state.task.id)

    def build_tools(self, task: Task) -> list[Tool]:
        options = self.world.options
        latency, jitter = self.tool_latency_s, self.tool_latency_jitter

        def act(option: str) -> str:
            """Carry out the current step with one of the options.

            Args:
                option: The option letter for this step.
            """
            if latency:  # a draw outside the env's RNG: timing never changes outcomes
                time.sleep(latency * (1.0 + jitter * (2.0 * random.random() - 1.0)))
            return option if option in options else f"Error: option must be one of {', '.join(options)}."

        return [Tool.from_function(act)]

    def initial_tool_state(self, task: Task) -> dict[str, int]:
        return {"on_track": 1}

    def demonstrate(self, task: Task) -> list[str]:
        opts = list(task.ground_truth)
        return [action_text(0, o, k == len(opts) - 1) for k, o in enumerate(opts)]

    def score(self, task: Task, answer: str) -> float:
        # the reward is the latent state after the last turn (see turn); score exists for the API
        return 0.0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, info = super().reset(seed=seed, options=options)
        i = self._task_index()
        info.update(success_probability=float(self.world.root_value(i)), on_track=1, turns=int(self.world.turns[i]))
        return obs, info

    def turn(self, parsed: ParsedTurn, action: str) -> TurnResult:
        st = self.state
        assert st is not None
        w = self.world
        i = self._task_index()
        t, T = st.turn, int(w.turns[i])
        final = t >= T
        problem = None
        option = None
        if parsed.error is not None:
            problem = self.error_observation(parsed.error)
        elif parsed.answer is not None:
            option = parsed.answer.strip()
            if not final:
                problem = OBS_EARLY.format(t=t, T=T)
        else:
            call = parsed.tool_calls[0]
            if len(parsed.tool_calls) > 1:
                problem = "Error: call act exactly once per step."
            elif call.name != "act":
                problem = self.run_tool_calls([call])  # the tool layer names the unknown tool
            else:
                checked = self._tools["act"].call(call.arguments)
                if checked.startswith("Error"):
                    problem = checked
                else:
                    option = checked
            if final and problem is None:
                problem = OBS_NOT_ANSWER
        correct = problem is None and option == w.options[w.correct[i, t]]
        on = int(st.tool_state["on_track"])
        u = st.rng.random(3)
        on = int(correct and (on == 1 or u[0] < w.recovery))
        st.tool_state["on_track"] = on
        early_end = parsed.answer is not None and not final
        if final or early_end:
            reward = float(on) if final and problem is None else 0.0
            info = {"success_probability": reward, "on_track": on}
            return TurnResult(problem or "", reward=reward, terminated=True, info=info)
        if problem is not None:
            obs = problem
        else:
            obs = observation_text(int(w.observation_category(on, u[1], u[2])), t, T)
        return TurnResult(obs, info={"success_probability": float(w.value(i, t, on)), "on_track": on})


# ----------------------------------------------------------------------------- the fast path


