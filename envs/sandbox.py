"""A sandboxed Python tool: the policy's code runs in a separate process with limits.

Layers, strongest first (:attr:`PythonSandbox.isolation` says which one this machine got):

* ``"namespaces"``: the process gets its own mount, network, PID, IPC and UTS namespaces
  (``unshare``; a user namespace too when not run as root). Every mount is remounted
  read-only except the run's temporary folder, the network has no interfaces, and all
  capabilities are dropped (``setpriv``), so the kernel itself refuses writes elsewhere,
  connections, remounts and signals to outside processes.
* ``"audit-hook"`` (where namespaces are unavailable) and, in every mode, inside the process:
  resource limits (CPU seconds, address space, file size, open files, process count) and a
  :func:`sys.addaudithook` policy that refuses writes outside the temporary folder, sockets,
  ``fork``/``exec``/``subprocess``/``os.system``, signals, and imports of ``ctypes`` and
  other ways around the hook. The hook gives clear error messages; in audit-hook mode it is
  the only barrier against writes and connections, which stops accidents and obvious
  misuse, not a determined attacker with a CPython exploit.

A wall-clock timeout kills the whole process group. Output is captured in files bounded by
the file-size limit, so a program that prints forever cannot exhaust the caller's memory.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache

from trace_gym.tools import Tool

__all__ = ["PythonSandbox", "SandboxResult", "isolation_level"]

# The code run inside the sandbox before the policy's code: limits, then the audit hook.
_RUNNER = r'''
import os, resource, sys


def _setup():
    root, cpu_s, mem, fsize, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    code = sys.stdin.read()
    limits = [(resource.RLIMIT_CPU, cpu_s, cpu_s + 1), (resource.RLIMIT_FSIZE, fsize, fsize),
              (resource.RLIMIT_CORE, 0, 0), (resource.RLIMIT_NOFILE, 64, 64)]
    if mem > 0:
        limits.append((resource.RLIMIT_AS, mem, mem))
    if nproc > 0:
        limits.append((resource.RLIMIT_NPROC, nproc, nproc))
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))
    root = os.path.realpath(root)
    os.chdir(root)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    path_args = {
        "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,), "os.chmod": (0,),
        "os.chown": (0,), "os.link": (0, 1), "os.symlink": (1,), "os.truncate": (0,), "os.utime": (0,),
        "os.chflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,), "shutil.rmtree": (0,),
        "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (1,), "shutil.chown": (0,),
        "shutil.copymode": (1,), "shutil.copystat": (1,), "shutil.unpack_archive": (1,),
        "shutil.make_archive": (0,), "sqlite3.connect": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
    }
    blocked_events = {
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
        "os.kill", "os.killpg", "os.chroot", "os.setuid", "os.setgid", "pty.spawn", "sys.remote_exec",
        "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "ctypes.string_at",
        "ctypes.cdata/buffer", "webbrowser.open", "os.startfile",
        "urllib.Request", "http.client.connect", "ftplib.connect", "smtplib.connect", "imaplib.open",
        "poplib.connect", "telnetlib.Telnet.open", "nntplib.connect",
    }
    blocked_imports = {"cffi", "_testcapi", "_testinternalcapi", "_xxsubinterpreters",
                       "_xxinterpchannels", "_interpreters", "_interpchannels"}
    # Libraries such as sympy import ctypes for sizeof(c_long); importing it here, before the
    # hook, lets them work, while loading libraries, looking up symbols, calling foreign
    # functions and reading raw memory stay blocked by the events below.
    import ctypes  # noqa: F401
    # The same for subprocess (sympy imports it); its C entry point, which forks without an
    # audit event, is replaced so only the audited Popen path remains, and that is blocked.
    import subprocess
    import _posixsubprocess

    def no_fork_exec(*args, **kwargs):
        raise PermissionError("sandbox: starting processes is not allowed")

    _posixsubprocess.fork_exec = subprocess._fork_exec = no_fork_exec

    def inside(p):
        if isinstance(p, int):
            return True  # an already-open descriptor: its opening was checked
        try:
            p = os.fsdecode(p)
        except Exception:
            return False
        if p in (":memory:", ""):
            return True
        full = os.path.realpath(os.path.join(root, p))
        return full == root or full.startswith(root + os.sep)

    def hook(event, args):
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing outside the sandbox folder is not allowed ({path!r})")
        elif event in path_args:
            for i in path_args[event]:
                if i < len(args) and args[i] is not None and not inside(args[i]):
                    raise PermissionError(f"sandbox: {event} outside the sandbox folder is not allowed ({args[i]!r})")
        elif event == "import":
            if str(args[0]).split(".")[0] in blocked_imports:
                raise ImportError(f"sandbox: importing {args[0]} is not allowed")
        elif event in blocked_events or event.startswith("socket."):
            raise PermissionError(f"sandbox: {event} is not allowed (no network, processes or native calls)")

    sys.addaudithook(hook)
    return code


def _run(code):
    import ast, traceback
    globs = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(code, "<sandbox>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<sandbox>", "exec"), globs)
        if last is not None:  # like a notebook cell: show the value of a final expression
            value = eval(compile(ast.Expression(last.value), "<sandbox>", "eval"), globs)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    except BaseException as exc:
        # Show the policy its own frames and the libraries it called, not the runner or the hook.
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != "<string>"]
        sys.stdout.flush()
        if frames:
            sys.stderr.write("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames[-8:])))
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        sys.exit(1)


_run(_setup())
'''

# Run inside fresh namespaces: make every mount read-only except the sandbox folder, then
# drop all capabilities (so the code cannot remount) and exec the runner.
_NAMESPACE_SCRIPT = r'''
set -e
T="$1"; shift
mount --make-rprivate /
mount --bind "$T" "$T"
awk '{print $5}' /proc/self/mountinfo | while read -r m; do
  case "$m" in "$T") ;; *) mount -o remount,bind,ro "$m" 2>/dev/null || true ;; esac
done
set +e
# Not exec: the shell stays the namespace's init, so the program is an ordinary process that
# receives its resource-limit signals; the shell exits with 128 + signal when it is killed.
setpriv --no-new-privs --bounding-set=-all --inh-caps=-all -- "$@"
exit $?
'''

_SIGNALS = {
    signal.SIGXCPU: "it used more than its CPU time limit",
    signal.SIGKILL: "it was killed (time or memory limit)",
    signal.SIGXFSZ: "it wrote more than the file-size limit",
    signal.SIGSEGV: "it crashed (segmentation fault)",
}


@dataclass
class SandboxResult:
    """What one run produced: ``ok`` is False for errors, timeouts and limit violations;
    ``output`` is what the tool shows (program output, or ``"Error: ..."``)."""

    ok: bool
    output: str
    returncode: int | None
    timed_out: bool = False


def _namespace_prefix(root: bool) -> list[str]:
    flags = ["--mount", "--net", "--pid", "--fork", "--mount-proc", "--ipc", "--uts"]
    if not root:
        flags = ["--user", "--map-root-user"] + flags
    return ["unshare", *flags, "--", "sh", "-c", _NAMESPACE_SCRIPT, "trace-gym-sandbox"]


@lru_cache(maxsize=1)
def isolation_level() -> str:
    """``"namespaces"`` if this machine can run the sandbox in its own namespaces (checked
    once by running a probe that must fail to write outside its folder), else ``"audit-hook"``."""
    if not sys.platform.startswith("linux") or not (shutil.which("unshare") and shutil.which("setpriv")):
        return "audit-hook"
    tmp = tempfile.mkdtemp(prefix="trace-gym-sandbox-probe-")
    outside = tmp + "-outside"  # a sibling of the sandbox folder: writing there must fail
    probe = ("import sys\ntry:\n    open(sys.argv[1], 'w')\n    print('leak')\nexcept OSError:\n    print('ok')\n"
             "open(sys.argv[2], 'w').write('ok')\n")
    try:
        cmd = _namespace_prefix(os.geteuid() == 0) + [tmp, sys.executable, "-I", "-B", "-c", probe, outside,
                                                      os.path.join(tmp, "inside")]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        works = out.returncode == 0 and out.stdout.strip() == "ok" and os.path.exists(os.path.join(tmp, "inside"))
        return "namespaces" if works else "audit-hook"
    except (OSError, subprocess.SubprocessError):
        return "audit-hook"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(outside):
            os.remove(outside)


def _count_processes(uid: int) -> int:
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _read_bounded(f, limit: int) -> str:
    f.seek(0)
    data = f.read(limit * 4 + 4)
    return data.decode("utf-8", errors="replace")


class PythonSandbox:
    """Runs Python code in a subprocess: :meth:`run` gives a :class:`SandboxResult`,
    :meth:`as_tool` a ``python(code)`` tool for an env.

    Args:
        timeout_s: Wall-clock limit per run (CPU time is limited to the same, rounded up).
        memory_mb: Address-space limit of the process.
        max_output_chars: Output shown to the policy (longer output is cut).
        max_file_mb: Largest file (and output) the code may write.
        max_code_chars: Longest accepted program.
    """

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 1024, max_output_chars: int = 4000,
                 max_file_mb: int = 16, max_code_chars: int = 100_000):
        if timeout_s <= 0 or memory_mb <= 0:
            raise ValueError("timeout_s and memory_mb must be positive")
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.max_output_chars = int(max_output_chars)
        self.max_file_mb = int(max_file_mb)
        self.max_code_chars = int(max_code_chars)

    @property
    def isolation(self) -> str:
        """The isolation this machine provides (see the module docstring)."""
        return isolation_level()

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` (a Python program) and report what happened. Never raises for
        anything the code does."""
        if not isinstance(code, str):
            return SandboxResult(False, "Error: the code must be text.", None)
        if len(code) > self.max_code_chars:
            return SandboxResult(False, f"Error: the code is longer than {self.max_code_chars} characters.", None)
        if not code.strip():
            return SandboxResult(False, "Error: the code is empty.", None)
        tmp = tempfile.mkdtemp(prefix="trace-gym-sandbox-")
        uid = os.geteuid()
        nproc = _count_processes(uid) + 32  # room for nothing much beyond what the user already runs
        args = [tmp, str(max(1, math.ceil(self.timeout_s))), str(self.memory_mb << 20), str(self.max_file_mb << 20), str(nproc)]
        cmd = [sys.executable, "-I", "-B", "-X", "utf8", "-c", _RUNNER, *args]
        if self.isolation == "namespaces":
            cmd = _namespace_prefix(uid == 0) + [tmp, *cmd]
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        timed_out = False
        try:
            with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=tmp, env=env,
                                        start_new_session=True, close_fds=True)
                try:
                    # A little grace beyond the limit for interpreter start-up.
                    proc.communicate(code.encode("utf-8", errors="replace"), timeout=self.timeout_s + 0.5)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # the whole group, whatever the code started
                    except (ProcessLookupError, PermissionError):
                        pass
                    proc.wait()
                stdout, stderr = _read_bounded(out, self.max_output_chars), _read_bounded(err, self.max_output_chars)
        except OSError as exc:
            return SandboxResult(False, f"Error: the sandbox could not start ({exc}).", None)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return self._result(proc.returncode, stdout, stderr, timed_out)

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + f"\n[... output cut at {self.max_output_chars} characters]"

    def _result(self, rc: int | None, stdout: str, stderr: str, timed_out: bool) -> SandboxResult:
        shown = self._cut(stdout.rstrip())
        if rc is not None and rc > 128 and self.isolation == "namespaces":
            rc = -(rc - 128)  # the namespace's shell reports a killed program as 128 + signal
        if timed_out:
            msg = f"Error: the program ran longer than {self.timeout_s:g} s and was stopped."
            return SandboxResult(False, (shown + "\n" if shown else "") + msg, rc, True)
        if rc is not None and rc < 0:
            why = _SIGNALS.get(-rc, f"it was stopped by signal {-rc}")
            if -rc == signal.SIGXCPU:
                return SandboxResult(False, (shown + "\n" if shown else "") + f"Error: {why}.", rc, True)
            return SandboxResult(False, (shown + "\n" if shown else "") + f"Error: {why}.", rc)
        if rc != 0:
            lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
            detail = "\n".join(lines[-12:]) or f"exit status {rc}"
            if "MemoryError" in detail:
                detail += f"\n(the memory limit is {self.memory_mb} MB)"
            return SandboxResult(False, (shown + "\n" if shown else "") + "Error:\n" + self._cut(detail), rc)
        extra = self._cut(stderr.strip())
        text = "\n".join(x for x in (shown, extra) if x) or "(no output)"
        return SandboxResult(True, text, rc)

    def as_tool(self) -> Tool:
        """The ``python`` tool for an env (stateless: each call is a fresh process)."""

        def python(code: str) -> str:
            """Run a Python 3 program in a sandbox and return what it prints (the value of a final expression is
            printed too). No network, no files outside a scratch folder, a few seconds of time.

            Args:
                code: The program, e.g. "from fractions import Fraction\\nprint(Fraction(1, 3) + Fraction(1, 6))".
            """
            return self.run(code).output

        return Tool.from_function(python)
