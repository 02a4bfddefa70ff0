"""The sandboxed Python tool: what it runs, and what it refuses (writes outside its folder,
network, processes, endless loops, memory, output floods)."""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid

import pytest

from trace_gym.envs.sandbox import PythonSandbox, isolation_level

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox uses Linux rlimits and namespaces")


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(timeout_s=1.5, memory_mb=512)


def test_runs_code_and_shows_output(sandbox):
    r = sandbox.run("import math\nprint('hi')\nmath.factorial(5)")
    assert r.ok and r.output == "hi\n120"
    assert sandbox.run("x = 1").output == "(no output)"


def test_errors_come_back_as_text(sandbox):
    r = sandbox.run("def f(:\n  pass")
    assert not r.ok and r.output.startswith("Error:") and "SyntaxError" in r.output
    r = sandbox.run("print('partial')\n1/0")
    assert not r.ok and r.output.startswith("partial\nError:") and "ZeroDivisionError" in r.output
    assert "hook" not in r.output  # the policy sees its own frames, not the sandbox's
    assert sandbox.run("").output == "Error: the code is empty."


def test_can_write_inside_its_own_folder(sandbox):
    r = sandbox.run("open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())")
    assert r.ok and r.output == "kept"


@pytest.mark.parametrize("code", [
    "open('/etc/{name}', 'w').write('x')",
    "import os\nfd = os.open('/etc/{name}', os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'x')",
    "import pathlib\npathlib.Path('/etc/{name}').write_text('x')",
    "import os\nos.symlink('/etc/{name}', 'link')\nopen('link', 'w').write('x')",
    "import shutil\nopen('a', 'w').write('x')\nshutil.copyfile('a', '/etc/{name}')",
])
def test_write_to_etc_is_an_error(sandbox, code):
    name = f"trace-gym-sandbox-{uuid.uuid4().hex}"
    r = sandbox.run(code.format(name=name))
    assert not r.ok and r.output.startswith("Error:")
    assert not os.path.exists(f"/etc/{name}")


def test_writes_elsewhere_outside_its_folder_are_errors(sandbox, tmp_path):
    target = tmp_path / "leak.txt"
    r = sandbox.run(f"open({str(target)!r}, 'w').write('x')")
    assert not r.ok and not target.exists()


def test_socket_connection_is_an_error(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    try:
        r = sandbox.run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')")
        assert not r.ok and r.output.startswith("Error:") and "connected" not in r.output
        with pytest.raises(socket.timeout):
            server.accept()  # nothing reached the listening server
    finally:
        server.close()
    r = sandbox.run("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)")
    assert not r.ok and r.output.startswith("Error:")


@pytest.mark.parametrize("code", [
    "import os\nwhile True:\n    os.fork()",
    "import os\nos.system(':(){ :|:& };:')",
    "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])",
    "import multiprocessing\nps = [multiprocessing.Process(target=print) for _ in range(100)]\n[p.start() for p in ps]",
])
def test_fork_bomb_is_an_error(sandbox, code):
    start = time.monotonic()
    r = sandbox.run(code)
    assert not r.ok and r.output.startswith("Error:")
    assert time.monotonic() - start < sandbox.timeout_s + 5


@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(60)"])
def test_endless_loop_is_stopped_with_an_error(sandbox, code):
    start = time.monotonic()
    r = sandbox.run(code)
    assert not r.ok and r.timed_out and r.output.startswith("Error:")
    assert time.monotonic() - start < sandbox.timeout_s + 5


def test_native_calls_and_signals_are_errors(sandbox):
    for code in ("import ctypes\nctypes.CDLL(None).system(b'true')", "import os\nos.kill(1, 9)",
                 "import _posixsubprocess\n_posixsubprocess.fork_exec()"):
        r = sandbox.run(code)
        assert not r.ok and r.output.startswith("Error:"), code


def test_memory_and_output_are_bounded(sandbox):
    r = sandbox.run("x = bytearray(2 << 30)")
    assert not r.ok and "MemoryError" in r.output
    r = sandbox.run("while True:\n    print('x' * 1000)")
    assert not r.ok and len(r.output) < sandbox.max_output_chars + 2000


def test_libraries_still_work(sandbox):
    slow = PythonSandbox(timeout_s=10)
    r = slow.run("import sympy\nsympy.factorint(360)")
    assert r.ok and r.output == "{2: 3, 3: 2, 5: 1}"


def test_isolation_level_is_reported():
    assert isolation_level() in ("namespaces", "audit-hook")
    assert PythonSandbox().isolation == isolation_level()


def test_python_tool_schema(sandbox):
    t = sandbox.as_tool()
    assert t.name == "python" and t.parameters["required"] == ["code"]
    assert t.call({"code": "print(6 * 7)"}) == "42"
    assert t.call({"code": "open('/etc/x', 'w')"}).startswith("Error:")


def test_the_in_process_layer_alone_refuses_the_same(monkeypatch, tmp_path):
    """Where namespaces are unavailable the audit hook and rlimits must still refuse."""
    import trace_gym.envs.sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "isolation_level", lambda: "audit-hook")
    sb = PythonSandbox(timeout_s=1.5)
    assert sb.isolation == "audit-hook"
    name = f"trace-gym-sandbox-{uuid.uuid4().hex}"
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        for code in (f"open('/etc/{name}', 'w')", f"open({str(tmp_path / 'x')!r}, 'w')",
                     f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
                     "import os\nwhile True:\n    os.fork()", "while True:\n    pass"):
            r = sb.run(code)
            assert not r.ok and r.output.startswith("Error:"), code
    finally:
        server.close()
    assert not os.path.exists(f"/etc/{name}") and not (tmp_path / "x").exists()
    assert sb.run("print(1 + 1)").output == "2"
