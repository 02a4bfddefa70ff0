"""The README's tutorials are executed here, in order, exactly as a user would paste them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"<!-- tutorial -->\s*```python\n(.*?)```", re.S)


def tutorials() -> list[str]:
    return _BLOCK.findall(README.read_text(encoding="utf-8"))


def test_readme_has_the_three_tutorials():
    text = README.read_text(encoding="utf-8")
    assert len(tutorials()) == 3
    for title in ("Register your own environment", "Swap allocators for an ablation", "Write your own allocator"):
        assert title in text


def test_readme_first_screen_has_the_two_commands():
    first_screen = "\n".join(README.read_text(encoding="utf-8").splitlines()[:15])
    assert "make run" in first_screen and "make test" in first_screen


@pytest.mark.parametrize("index", range(3), ids=["register-env", "ablation", "own-allocator"])
def test_tutorial_runs(index, capsys):
    code = tutorials()[index]
    exec(compile(code, f"README.md tutorial {index + 1}", "exec"), {"__name__": f"readme_tutorial_{index + 1}"})
    assert capsys.readouterr().out.strip(), "each tutorial prints what it shows"
