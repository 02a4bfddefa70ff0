"""One SmolLM2-135M policy per test process, shared by the test files that need a real model.

The GGUF -> safetensors conversion happens once per machine (``trace_gym.policies.models`` caches it
under ``$TRACE_GYM_CACHE``); loading the converted model takes about a second. Sharing one
loaded policy keeps the suite's memory and time down. Tests that change its weights must
restore them (see ``test_policies.py``).
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@functools.lru_cache(maxsize=1)
def smollm2_path() -> str:
    """Local directory of the converted SmolLM2-135M-Instruct (built on first use)."""
    from trace_gym.policies.models import resolve_model

    return resolve_model("smollm2-135m")


@functools.lru_cache(maxsize=1)
def smollm2_policy():
    """The shared ``hf`` policy on SmolLM2-135M-Instruct (CPU, fp32)."""
    from trace_gym.policies.hf import HFPolicy

    return HFPolicy(smollm2_path(), device="cpu")
