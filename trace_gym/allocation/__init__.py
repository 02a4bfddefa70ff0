"""Allocation: the budget, the allocator base class and registry, the driver of the two
stages (``allocator.py``), and the exact stage-1/stage-2 solvers (``solvers.py``)."""
