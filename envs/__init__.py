"""Built-in environments (importable as ``trace_gym.envs``).

Registration uses string entry points, so importing trace_gym loads no environment
module (and none of their dependencies) until an env is made.
"""

from trace_gym.registry import register

register("trace_gym/ContrastLab-v0", entry_point="trace_gym.envs.contrastlab:ContrastLabEnv")
