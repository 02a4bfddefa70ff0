"""Built-in environments (importable as ``trace_gym.envs``).

Registration uses string entry points, so importing trace_gym loads no environment
module (and none of their dependencies) until an env is made.
"""

from trace_gym.registry import register

register("trace_gym/ContrastLab-v0", entry_point="trace_gym.sim.env:ContrastLabEnv")
register("trace_gym/MultiHopQA-v0", entry_point="trace_gym.envs.multihop:MultiHopQAEnv")
register("trace_gym/BFCL-v0", entry_point="trace_gym.envs.bfcl:BFCLEnv")
register("trace_gym/BFCLMultiTurn-v0", entry_point="trace_gym.envs.bfcl:BFCLMultiTurnEnv")
register("trace_gym/ToolCalls-v0", entry_point="trace_gym.envs.toolcalls:ToolCallsEnv")
register("trace_gym/MathCalc-v0", entry_point="trace_gym.envs.math:MathCalcEnv")
register("trace_gym/GSM8K-v0", entry_point="trace_gym.envs.math:GSM8KEnv")
register("trace_gym/MATH-v0", entry_point="trace_gym.envs.math:MATHEnv")
register("trace_gym/HotpotQA-v0", entry_point="trace_gym.envs.multihop:HotpotQAEnv")
register("trace_gym/2WikiMultiHopQA-v0", entry_point="trace_gym.envs.multihop:TwoWikiMultiHopQAEnv")
register("trace_gym/MuSiQue-v0", entry_point="trace_gym.envs.multihop:MuSiQueEnv")
