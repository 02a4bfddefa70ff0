"""The rollout engine: runs an allocator's plans over envs with a policy, token in, token
out, with exact-prefix branching (``engine.py``), and the forest's JSONL node records."""
