"""The env contract: :class:`AgentEnv` and its text spaces (``base.py``), ReAct turn
parsing and formatting (``react.py``), and tools (``tools.py``)."""
