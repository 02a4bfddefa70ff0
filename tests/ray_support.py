"""The local Ray of the Ray tests: ``ray.init(num_cpus=2)`` once per test module, shut down after it.

Import the fixture into a test module (``from ray_support import local_ray``) after
``pytest.importorskip("ray")``.
"""

from __future__ import annotations

import pytest
import ray


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
