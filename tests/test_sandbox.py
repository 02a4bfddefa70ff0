"""The sandboxed Python tool: what it runs, what it refuses (writes outside its folder,
network, processes, endless loops, memory, output floods), and, under bubblewrap, what of the
host it cannot see (system secrets, home folders, the project, dataset caches, host /tmp, other
processes, packages it was not allowed)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import trace_gym.envs.sandbox as sandbox_module
from trace_gym.envs.sandbox import PythonSandbox, isolation_level, isolation_report

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
    slow = PythonSandbox(timeout_s=10, allow_packages=("sympy",))
    r = slow.run("import sympy\nsympy.factorint(360)")
    assert r.ok and r.output == "{2: 3, 3: 2, 5: 1}"


def test_isolation_level_is_reported():
    assert isolation_level() in ("bubblewrap", "namespaces", "audit-hook")
    assert PythonSandbox().isolation == isolation_level()


def test_python_tool_schema(sandbox):
    t = sandbox.as_tool()
    assert t.name == "python" and t.parameters["required"] == ["code"]
    assert t.call({"code": "print(6 * 7)"}) == "42"
    assert t.call({"code": "open('/etc/x', 'w')"}).startswith("Error:")


def _level_available(level: str) -> bool:
    if level == "bubblewrap":
        return isolation_level() == "bubblewrap"
    if level == "namespaces":
        return sandbox_module._namespaces_work()
    return True


@pytest.mark.parametrize("level", ["audit-hook", "namespaces", "bubblewrap"])
def test_every_level_refuses_the_same(monkeypatch, tmp_path, level):
    """Each isolation this machine can fall back to refuses the same things (the audit hook
    and rlimits alone included), and still runs plain code."""
    if not _level_available(level):
        pytest.skip(f"{level} isolation is not available on this machine")
    monkeypatch.setattr(sandbox_module, "isolation_level", lambda: level)
    sb = PythonSandbox(timeout_s=1.5)
    assert sb.isolation == level
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

    assert sb.run("open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())").output == "kept"


# ----------------------------------------------------------------------------- what the code can see

needs_bubblewrap = pytest.mark.skipif(
    isolation_level() != "bubblewrap",
    reason=f"bubblewrap isolation is not available here ({sandbox_module._bubblewrap_variant()[1]})")

REPO = pathlib.Path(__file__).resolve().parents[1]

# Prints what the sandbox finds at PATH: a listing, the first bytes, or "refused <error>".
_LOOK = """
import os
p = {path!r}
try:
    if os.path.isdir(p):
        print("listing", sorted(os.listdir(p)))
    else:
        print("content", open(p, "rb").read(200))
except OSError as e:
    print("refused", type(e).__name__)
"""


def _host_sees(path: str) -> bool:
    try:
        return bool(os.listdir(path) if os.path.isdir(path) else pathlib.Path(path).read_bytes())
    except OSError:
        return False


def _hf_cache() -> str:
    home = os.path.expanduser("~")
    return os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"),
                                                     "huggingface")


@needs_bubblewrap
@pytest.mark.parametrize("path", ["/etc/shadow", "/etc/passwd", "/root", os.path.expanduser("~"), "/home", str(REPO),
                                  str(REPO / "README.md"), "hf-cache"])
def test_host_files_are_not_there(sandbox, path):
    if path == "hf-cache":
        path = _hf_cache()
    if not _host_sees(path):
        pytest.skip(f"this host has nothing readable at {path}, so the sandbox cannot show whether it hides it")
    r = sandbox.run(_LOOK.format(path=path))
    assert r.ok and r.output.startswith("refused"), (path, r.output)


@needs_bubblewrap
def test_host_tmp_is_not_there(sandbox):
    with tempfile.NamedTemporaryFile("w", prefix="trace-gym-sandbox-marker-", dir="/tmp") as marker:
        marker.write("host secret")
        marker.flush()
        r = sandbox.run(_LOOK.format(path=marker.name) + "\nprint(sorted(os.listdir('/tmp')))")
        assert r.ok and r.output.startswith("refused") and "host secret" not in r.output
        assert r.output.splitlines()[-1] == "[]"  # its /tmp is its own, empty folder


@needs_bubblewrap
def test_root_holds_only_the_runtime(sandbox):
    r = sandbox.run("import os\nprint(sorted(os.listdir('/')))\nprint(sorted(os.listdir('/etc')))")
    assert r.ok, r.output
    root, etc = (eval(line) for line in r.output.splitlines())
    assert set(root) <= sandbox_module._BW_ROOT_ENTRIES and {"usr", "tmp", "proc", "dev"} <= set(root)
    assert not {"root", "home", "work", "srv", "var", "mnt"} & set(root)
    assert etc == []


@needs_bubblewrap
def test_other_processes_are_not_there(sandbox):
    secret = f"TRACE_GYM_SECRET_{uuid.uuid4().hex}"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, "SECRET": secret})
    try:
        deadline = time.monotonic() + 10
        while secret.encode() not in pathlib.Path(f"/proc/{other.pid}/environ").read_bytes():  # empty until exec is done
            assert time.monotonic() < deadline, "the host cannot read the other process's environment"
            time.sleep(0.05)
        # The host can read it: the sandbox must not.
        for pid in (other.pid, os.getpid()):
            r = sandbox.run(_LOOK.format(path=f"/proc/{pid}/environ") + "\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
            assert r.ok and r.output.startswith("refused") and secret not in r.output, r.output
            assert max(eval(r.output.splitlines()[-1])) < 10  # only its own few processes
    finally:
        other.kill()
        other.wait()


@needs_bubblewrap
def test_working_folder_is_size_limited():
    sb = PythonSandbox(timeout_s=5, max_disk_mb=2, max_file_mb=16)
    r = sb.run("open('big', 'wb').write(b'x' * (3 << 20))")
    assert not r.ok and "No space left on device" in r.output and "at most 2 MB" in r.output
    assert sb.run("open('small', 'wb').write(b'x' * (1 << 20))").ok


@needs_bubblewrap
@pytest.mark.parametrize("variant", list(sandbox_module._BW_VARIANTS))
def test_bubblewrap_alone_hides_and_refuses(variant, tmp_path):
    """The kernel's layer without the audit hook: a plain interpreter under bwrap finds a
    read-only root holding nothing of the host, a private /proc and its own writable /tmp."""
    if variant == "no user namespace" and os.geteuid() != 0:
        pytest.skip("bwrap without a user namespace needs root")
    (tmp_path / "marker").write_text("host")
    argv, python = sandbox_module._bubblewrap_argv(variant, (), 1 << 20, {"PATH": "/usr/bin:/bin"})
    program = f"""
import os, errno
for p in ["/x", "/etc/passwd", "/usr/lib/x", "/opt/python/x", "/dev/x", "/proc/x", "{tmp_path}/x"]:
    try:
        open(p, "w")
        print("wrote", p)
    except OSError:
        pass
open("/tmp/ok", "w").write("ok")
for p in ["/etc/shadow", "/root", "{REPO}", "{tmp_path}/marker", "/proc/{os.getpid()}/environ"]:
    if os.path.exists(p):
        print("sees", p)
print(os.getuid() if {variant == "user namespace"} else 0, open("/proc/self/status").read().split("CapEff:")[1].split()[0])
"""
    out = subprocess.run([*argv, python, "-I", "-S", "-c", program], capture_output=True, text=True, timeout=30,
                         stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"}, check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:-1] == [], lines  # nothing written, nothing seen
    uid, caps = lines[-1].split()
    assert int(caps, 16) == 0 and (variant != "user namespace" or uid == "65534")
    assert not (tmp_path / "x").exists()


@needs_bubblewrap
def test_the_no_user_namespace_variant_runs_the_tool(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("bwrap without a user namespace needs root")
    monkeypatch.setattr(sandbox_module, "_bubblewrap_variant", lambda: ("no user namespace", ""))
    sb = PythonSandbox(timeout_s=1.5)
    assert sb.run("print(6 * 7)").output == "42"
    r = sb.run("open('/etc/shadow').read()")
    assert not r.ok and "FileNotFoundError" in r.output
    assert not sb.run("import os\nwhile True:\n    os.fork()").ok


# ----------------------------------------------------------------------------- allowed packages


def test_packages_are_importable_only_when_allowed(sandbox):
    r = sandbox.run("import numpy")
    assert not r.ok and "ModuleNotFoundError" in r.output and "(importable: the standard library only)" in r.output
    with_numpy = PythonSandbox(timeout_s=10, allow_packages=("numpy",))
    r = with_numpy.run("import numpy as np\nprint(np.arange(10).reshape(2, 5).sum(axis=1).tolist())")
    assert r.ok and r.output == "[10, 35]", r.output
    for other in ("sympy", "trace_gym", "pydantic", "pytest"):
        r = with_numpy.run(f"import {other}")
        assert not r.ok and "ModuleNotFoundError" in r.output, (other, r.output)


def test_allowed_packages_bring_what_they_require():
    sb = PythonSandbox(timeout_s=20, allow_packages=("math_verify",))  # an import name
    r = sb.run("from math_verify import parse, verify\nimport mpmath, sympy\nprint(verify(parse('$1/2$'), parse('$0.5$')))")
    assert r.ok and r.output == "True", r.output
    entries = dict(sandbox_module._package_entries(("math-verify",)))
    assert {"math_verify", "latex2sympy2_extended", "sympy", "mpmath", "antlr4"} <= set(entries)
    assert "numpy" not in entries and not any(e.endswith(".pth") or e in ("..", "__pycache__") for e in entries)


def test_unknown_package_is_a_value_error():
    with pytest.raises(ValueError, match="not-a-real-package"):
        PythonSandbox(allow_packages=("not-a-real-package",))
    with pytest.raises(TypeError, match="list of package names"):
        PythonSandbox(allow_packages="numpy")


def test_tool_description_names_the_allowed_packages():
    assert "standard library only" in PythonSandbox().as_tool().description
    assert "numpy" in PythonSandbox(allow_packages=("numpy",)).as_tool().description


# ----------------------------------------------------------------------------- the report


def test_isolation_report_lists_its_probes():
    report = isolation_report()
    assert report["isolation"] == isolation_level()
    assert set(report) == {"isolation", "detail", "passed", "failed", "summary"}
    probes = report["passed"] + report["failed"]
    assert {"minimal /", "no other processes", "no writes outside its folder", "no network", "no processes",
            "no host /tmp", "no project files"} <= set(probes)
    assert report["summary"].startswith(report["detail"]) and f"/{len(probes)}" in report["summary"]
    if report["isolation"] == "bubblewrap":
        assert report["failed"] == [], report


def test_isolation_report_shows_what_the_audit_hook_alone_lets_through(monkeypatch):
    """The probes can fail: with only the audit hook the host's files and /tmp are readable."""
    monkeypatch.setattr(sandbox_module, "isolation_level", lambda: "audit-hook")
    report = isolation_report()
    assert report["isolation"] == "audit-hook"
    assert {"no host /tmp", "no project files", "minimal /"} <= set(report["failed"])
    assert {"no writes outside its folder", "no network", "no processes"} <= set(report["passed"])


def test_envs_command_shows_the_isolation_of_envs_that_run_code():
    import json as _json

    from trace_gym.cli.play import env_rows

    rows = {r["id"]: r for r in env_rows(build=False)}
    report = isolation_report()
    assert rows["trace_gym/MathCalc-v0"]["sandbox"] == report["summary"]
    assert report["isolation"] in report["summary"]
    assert "sandbox" not in rows["trace_gym/ContrastLab-v0"]  # runs no code
    _json.dumps(rows["trace_gym/MathCalc-v0"])  # the --json listing carries it
