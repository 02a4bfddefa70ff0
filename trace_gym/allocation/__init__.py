"""Allocation: the budget, the allocator base class and registry, the driver of the two
stages (``allocator.py``), the exact stage-1/stage-2 solvers (``solvers.py``), the streaming
driver (``streaming.py``) and what a run's branches showed (``prefix_evidence.py``)."""
