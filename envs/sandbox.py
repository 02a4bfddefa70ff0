"""A sandboxed Python tool: the policy's code runs in a separate process with limits.

Layers, strongest first (:attr:`PythonSandbox.isolation` says which one this machine got, and
:func:`isolation_report` what it was checked to hide and refuse):

* ``"bubblewrap"``: the process runs under ``bwrap`` in its own user (where the kernel allows
  one), mount, network, PID, IPC and UTS namespaces, without capabilities, in a new root that
  holds only the system libraries (``/usr/lib*``) and the Python runtime read-only, the packages
  the sandbox allows (``allow_packages``) read-only under ``/opt/packages``, an empty ``/etc``,
  a minimal ``/dev``, a private ``/proc`` and its own size-limited ``/tmp`` (a tmpfs of
  ``max_disk_mb``, its working folder). Nothing else of the host exists there: no ``/etc/passwd``
  or ``/etc/shadow``, no home folders, no project files, no dataset caches, no host ``/tmp``,
  no other site-packages, no other processes; every other path is on a read-only file system.
* ``"namespaces"`` (where ``bwrap`` is missing or cannot create its namespaces): the process gets
  its own mount, network, PID, IPC and UTS namespaces (``unshare``; a user namespace too when not
  run as root). Every mount is remounted read-only except the run's temporary folder, the network
  has no interfaces, and all capabilities are dropped (``setpriv``), so the kernel itself refuses
  writes elsewhere, connections, remounts and signals to outside processes; the host's files
  stay readable.
* ``"audit-hook"`` (where neither is available) and, in every mode, inside the process:
  resource limits (CPU seconds, address space, file size, open files, process count) and a
  :func:`sys.addaudithook` policy that refuses writes outside the temporary folder, sockets,
  ``fork``/``exec``/``subprocess``/``os.system``, signals, and imports of ``ctypes`` and
  other ways around the hook. The hook gives clear error messages; in audit-hook mode it is
  the only barrier against writes and connections, which stops accidents and obvious
  misuse, not a determined attacker with a CPython exploit.

In every mode the interpreter starts without ``site`` (``-I -S``): only the standard library and
the allowed packages (with the packages they require) are importable.

A wall-clock timeout kills the whole process group. Output is captured in files bounded by
the file-size limit, so a program that prints forever cannot exhaust the caller's memory.
"""

from __future__ import annotations

import glob
import math
import os
import re
import select
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from trace_gym.env.tools import Tool

__all__ = ["PythonSandbox", "SandboxResult", "isolation_level", "isolation_report"]

# The code run inside the sandbox before the policy's code: limits, then the audit hook.
_RUNNER = r'''
import os, resource, sys


def _setup():
    root, cpu_s, mem, fsize, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    packages = sys.argv[6]
    code = sys.stdin.read()
    if packages:  # the interpreter runs without site: the allowed packages are all it adds
        sys.path.append(packages)
    import site
    site.setquit()  # exit() and quit(), which -S leaves out
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

# Where things are inside a bubblewrap sandbox.
_BW_PYTHON = "/opt/python"  # the Python runtime (its prefix), when it lives outside /usr
_BW_PACKAGES = "/opt/packages"  # the allowed packages: one entry per top-level site-packages entry
_BW_WORK = "/tmp"  # the run's working folder: a size-limited tmpfs
# The entries of a bubblewrap sandbox's root (the rest of the host does not exist there).
_BW_ROOT_ENTRIES = frozenset({"usr", "lib", "lib64", "lib32", "libx32", "opt", "etc", "dev", "proc", "tmp"})

# bwrap's namespace flags, tried in this order: a user namespace in which the program runs as an
# unprivileged uid (all capabilities dropped, no further user namespaces), else, for root where
# user namespaces are refused, the same namespaces but no user namespace and no capabilities.
_BW_VARIANTS: dict[str, list[str]] = {
    "user namespace": ["--unshare-all", "--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534"],
    "no user namespace": ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                          "--cap-drop", "ALL"],
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


# ----------------------------------------------------------------------------- allowed packages


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: Any) -> list[str]:
    """The names of the distributions ``dist`` requires on this interpreter, extras left out."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # packaging is almost always there; without it, keep what no extra asks for
        Requirement = None
    names = []
    for text in dist.requires or ():
        if Requirement is None:
            spec, _, marker = text.partition(";")
            m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
            if m and "extra" not in marker:
                names.append(m.group(1))
            continue
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return names


@lru_cache(maxsize=32)
def _package_entries(names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``(entry, host path)`` for every top-level site-packages entry (package folder, module
    file, ``.libs`` folder of bundled libraries, ``.dist-info``) of the named distributions and
    of every installed distribution they require, extras left out; sorted by entry.

    A name is a distribution name (``math-verify``) or an import name (``math_verify``,
    ``yaml``). Raises ValueError for a name that is not installed or whose files are not
    listed (no ``RECORD``)."""
    from importlib import metadata

    by_import = None
    todo: list[Any] = []
    for name in names:
        try:
            todo.append(metadata.distribution(name))
            continue
        except metadata.PackageNotFoundError:
            pass
        if by_import is None:
            by_import = metadata.packages_distributions()
        dists = by_import.get(name)
        if not dists:
            raise ValueError(f"allow_packages: {name!r} is not an installed package")
        todo.extend(metadata.distribution(d) for d in dists)
    seen: set[str] = set()
    entries: dict[str, str] = {}
    while todo:
        dist = todo.pop()
        key = _canonical(dist.metadata["Name"] or "")
        if key in seen:
            continue
        seen.add(key)
        files = dist.files
        if files is None:
            raise ValueError(f"allow_packages: the files of {dist.metadata['Name']!r} are not listed (no RECORD)")
        for f in files:
            top = f.parts[0] if f.parts else ""
            if not top or top in ("..", "__pycache__") or os.path.isabs(top) or top.endswith(".pth"):
                continue  # scripts, byte code of other modules, path hooks: not part of the package
            if top not in entries:
                path = os.path.realpath(dist.locate_file(top))
                if os.path.exists(path):
                    entries[top] = path
        for req in _requirements(dist):
            try:
                todo.append(metadata.distribution(req))
            except metadata.PackageNotFoundError:
                pass  # not installed here: the package imports without it or not at all
    return tuple(sorted(entries.items()))


def _link_packages(entries: tuple[tuple[str, str], ...], folder: str) -> None:
    """A folder of symbolic links to the allowed entries: the import path outside bubblewrap."""
    os.mkdir(folder)
    for entry, path in entries:
        os.symlink(path, os.path.join(folder, entry))


# ----------------------------------------------------------------------------- bubblewrap


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


@lru_cache(maxsize=1)
def _bubblewrap_runtime() -> tuple[tuple[str, ...], str, tuple[tuple[str, str], ...]]:
    """The bwrap arguments that show the system libraries and this Python runtime read-only
    (with every site-packages folder in them emptied), the interpreter's path inside, and the
    environment variables it needs there.

    A runtime under ``/usr`` keeps its paths; any other (pyenv, uv, a custom prefix, even one
    inside a home folder) is shown at ``/opt/python``, so no home folder appears."""
    args: list[str] = []
    links: list[str] = []
    shown: list[tuple[str, str]] = []  # (host folder, folder inside)

    def show(src: str, dest: str) -> None:
        if os.path.islink(src):  # e.g. /lib -> usr/lib: the same link inside
            target = os.readlink(src)
            if os.path.isabs(target):
                target = _inside(os.path.realpath(src), shown) or target
            links.extend(["--symlink", target, dest])
        elif os.path.isdir(src):
            args.extend(["--ro-bind", src, dest])
            shown.append((src, dest))

    for top in ("/usr", "/"):  # libc, the loader, libffi, libssl ... (/lib* are links into /usr on merged /usr)
        for name in ("lib", "lib64", "lib32", "libx32"):
            show(os.path.join(top, name), os.path.join(top, name))
    if os.path.isdir("/usr/share/zoneinfo"):
        show("/usr/share/zoneinfo", "/usr/share/zoneinfo")

    base = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    env: list[tuple[str, str]] = []
    if base in ("/", "/usr") or not _under(exe, base):
        inside_exe = exe  # a system Python: its stdlib is under /usr/lib, shown above
        args.extend(["--ro-bind", exe, exe])
    else:

        def moved(p: str) -> str:
            return _BW_PYTHON + p[len(base):]

        inside_exe = moved(exe)
        args.extend(["--ro-bind", exe, inside_exe])
        for name in ("lib", "lib64"):
            show(os.path.join(base, name), moved(os.path.join(base, name)))
        libdir = os.path.realpath(sysconfig.get_config_var("LIBDIR") or os.path.join(base, "lib"))
        if _under(libdir, base):
            # Its libpython, which an absolute RUNPATH would look for at the host path (and the
            # loader would then take the system's libpython from /usr/lib instead).
            env = [("LD_LIBRARY_PATH", moved(libdir))]
    base_vars = {"base": sys.base_prefix, "installed_base": sys.base_prefix, "platbase": sys.base_exec_prefix,
                 "installed_platbase": sys.base_exec_prefix}  # not the venv's: its lib holds its site-packages
    for key in ("stdlib", "platstdlib"):
        d = os.path.realpath(sysconfig.get_path(key, vars=base_vars))
        if os.path.isdir(d) and _inside(d, shown) is None:
            show(d, d)
    hidden: set[str] = set()
    candidates = list(site.getsitepackages([sys.base_prefix])) if hasattr(site, "getsitepackages") else []
    for src, _ in shown:
        candidates += glob.glob(os.path.join(src, "python3*", "*-packages"))
    for c in candidates:
        c = os.path.realpath(c)
        dest = _inside(c, shown)
        if dest and os.path.isdir(c) and os.path.basename(c) in ("site-packages", "dist-packages") and dest not in hidden:
            hidden.add(dest)
            args.extend(["--tmpfs", dest, "--remount-ro", dest])
    return tuple(args + links), inside_exe, tuple(env)


def _inside(path: str, shown: list[tuple[str, str]]) -> str | None:
    for src, dest in shown:
        if _under(path, src):
            return dest + path[len(src):]
    return None


def _bubblewrap_argv(variant: str, packages: tuple[tuple[str, str], ...], disk_bytes: int,
                     env: dict[str, str] | None = None) -> tuple[list[str], str]:
    """The bwrap command line up to the program (``--`` included), and the interpreter's path
    inside: the runtime and ``packages`` read-only, ``/tmp`` a tmpfs of ``disk_bytes`` that is
    also the working folder, an empty read-only ``/etc``, a read-only root; the program's
    environment is ``env`` only, when given."""
    runtime, python, runtime_env = _bubblewrap_runtime()
    argv = [shutil.which("bwrap") or "bwrap", *_BW_VARIANTS[variant], "--die-with-parent", "--hostname", "sandbox",
            *runtime]
    for entry, path in packages:
        argv += ["--ro-bind", path, f"{_BW_PACKAGES}/{entry}"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(int(disk_bytes)), "--tmpfs", _BW_WORK, "--dir", "/etc",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", _BW_WORK]
    if env is not None:
        argv.append("--clearenv")
    for k, v in [*(env or {}).items(), *runtime_env]:
        argv += ["--setenv", k, v]
    return argv + ["--"], python


@lru_cache(maxsize=1)
def _bubblewrap_variant() -> tuple[str | None, str]:
    """``(variant, why)``: the first of :data:`_BW_VARIANTS` under which a probe program starts
    on this very Python build, writes its ``/tmp`` and cannot see the host's temporary folder;
    ``(None, reason)`` when none does (``bwrap`` missing, namespaces refused ...)."""
    if not sys.platform.startswith("linux"):
        return None, "bubblewrap needs Linux"
    if not shutil.which("bwrap"):
        return None, "bwrap is not installed"
    host_dir = tempfile.mkdtemp(prefix="trace-gym-sandbox-probe-")
    probe = ("import os, sys\nopen('/tmp/inside', 'w').write('ok')\n"
             "print('ok' if open('/tmp/inside').read() == 'ok' and not os.path.exists(sys.argv[1]) else 'leak')\n"
             "print(sys.version)\n")
    why = ""
    try:
        for variant in _BW_VARIANTS:
            if variant == "no user namespace" and os.geteuid() != 0:
                continue
            argv, python = _bubblewrap_argv(variant, (), 1 << 20)
            try:
                out = subprocess.run([*argv, python, "-I", "-S", "-c", probe, host_dir], capture_output=True, text=True,
                                     timeout=30, stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"}, check=False)
            except (OSError, subprocess.SubprocessError) as exc:
                why = f"bwrap could not run ({exc})"
                continue
            if out.returncode == 0 and out.stdout.strip() == f"ok\n{sys.version}":
                return variant, ""
            lines = (out.stderr.strip() or out.stdout.strip() or f"exit status {out.returncode}").splitlines()
            why = f"bwrap failed ({variant}): {lines[-1]}"
        return None, why
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)


@lru_cache(maxsize=1)
def _namespaces_work() -> bool:
    """True if ``unshare`` and ``setpriv`` can run the sandbox in its own namespaces (checked
    once by running a probe that must fail to write outside its folder)."""
    if not sys.platform.startswith("linux") or not (shutil.which("unshare") and shutil.which("setpriv")):
        return False
    tmp = tempfile.mkdtemp(prefix="trace-gym-sandbox-probe-")
    outside = tmp + "-outside"  # a sibling of the sandbox folder: writing there must fail
    probe = ("import sys\ntry:\n    open(sys.argv[1], 'w')\n    print('leak')\nexcept OSError:\n    print('ok')\n"
             "open(sys.argv[2], 'w').write('ok')\n")
    try:
        cmd = _namespace_prefix(os.geteuid() == 0) + [tmp, sys.executable, "-I", "-B", "-c", probe, outside,
                                                      os.path.join(tmp, "inside")]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL, check=False)
        return out.returncode == 0 and out.stdout.strip() == "ok" and os.path.exists(os.path.join(tmp, "inside"))
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(outside):
            os.remove(outside)


@lru_cache(maxsize=1)
def isolation_level() -> str:
    """The strongest isolation this machine provides, checked once by running probes:
    ``"bubblewrap"``, else ``"namespaces"``, else ``"audit-hook"`` (see the module docstring)."""
    if _bubblewrap_variant()[0] is not None:
        return "bubblewrap"
    return "namespaces" if _namespaces_work() else "audit-hook"


# ----------------------------------------------------------------------------- the probes


def _readable(path: str) -> bool:
    """Whether this process can read ``path`` and finds something there (an entry of a folder,
    a byte of a file). The host asks it of each candidate path; the probes, which get its
    source, ask it again inside the sandbox."""
    try:
        if os.path.isdir(path):
            return bool(os.listdir(path))
        with open(path, "rb") as f:
            return bool(f.read(1))
    except OSError:
        return False


# Run in the sandbox by isolation_report, after a line that sets FACTS (a JSON object of host
# facts: paths the host can read, a pid, a port ...) and the source of _readable: prints, for
# each probe, whether the host thing stayed out of reach.
_PROBES = r'''
import json, os, socket
facts = json.loads(FACTS)
result = {}

for name, path in facts["paths"].items():
    result[name] = not _readable(path)
result["minimal /"] = set(os.listdir("/")) <= set(facts["root_entries"])
result["no other processes"] = not _readable(f"/proc/{facts['pid']}/environ") and not os.path.exists(f"/proc/{facts['pid']}")
try:
    open(facts["outside"], "w").write("x")
    result["no writes outside its folder"] = False
except OSError:
    result["no writes outside its folder"] = True
try:
    socket.create_connection(("127.0.0.1", facts["port"]), timeout=1).close()
    result["no network"] = False
except OSError:
    result["no network"] = True
try:
    import subprocess
    subprocess.run(["true"], timeout=1)
    result["no processes"] = False
except (OSError, subprocess.SubprocessError):
    result["no processes"] = True
print(json.dumps(result))
'''


@lru_cache(maxsize=4)
def _report_for(level: str) -> dict[str, Any]:
    import inspect
    import json

    import trace_gym

    facts: dict[str, Any] = {"paths": {}, "root_entries": sorted(_BW_ROOT_ENTRIES), "pid": os.getpid()}
    home = os.path.expanduser("~")
    hf = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"),
                                                   "huggingface")
    candidates = {"no /etc/shadow": "/etc/shadow", "no host /etc/passwd": "/etc/passwd", "no home folder": home,
                  "no project files": os.path.dirname(os.path.realpath(trace_gym.__file__)), "no dataset cache": hf}
    marker_dir = tempfile.mkdtemp(prefix="trace-gym-sandbox-report-")
    marker = os.path.join(marker_dir, "marker")
    with open(marker, "w") as f:
        f.write("host")
    candidates["no host /tmp"] = marker
    for name, path in candidates.items():  # only what this host has and can read makes a probe
        if _readable(path):
            facts["paths"][name] = path
    facts["outside"] = os.path.join(marker_dir, "written")
    server = socket.socket()
    try:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        facts["port"] = server.getsockname()[1]
        run = PythonSandbox(timeout_s=10).run(f"FACTS = {json.dumps(facts)!r}\n" + inspect.getsource(_readable) + _PROBES)
        probes: dict[str, bool] | None = None
        if run.ok:
            try:
                probes = json.loads(run.output.strip().splitlines()[-1])
            except (ValueError, IndexError):
                probes = None
        if probes is not None and os.path.exists(facts["outside"]):
            probes["no writes outside its folder"] = False
    finally:
        server.close()
        shutil.rmtree(marker_dir, ignore_errors=True)
    variant, why = _bubblewrap_variant()
    detail = f"bubblewrap ({variant})" if level == "bubblewrap" else level
    if level != "bubblewrap" and why:
        detail += f"; {why}"
    if probes is None:
        return {"isolation": level, "detail": detail, "passed": [], "failed": ["probe run"],
                "summary": f"{detail}; the probe program failed: {run.output[:300]}"}
    passed = [k for k, v in probes.items() if v]
    failed = [k for k, v in probes.items() if not v]
    summary = f"{detail}; probes passed {len(passed)}/{len(probes)}"
    if failed:
        summary += " (failed: " + ", ".join(failed) + ")"
    return {"isolation": level, "detail": detail, "passed": passed, "failed": failed, "summary": summary}


def isolation_report() -> dict[str, Any]:
    """What the sandbox on this machine was checked to hide and refuse (computed once per
    isolation level, one sandbox run of about a tenth of a second).

    Returns a dict: ``isolation`` (as :func:`isolation_level`), ``detail`` (the bubblewrap
    variant, or why bubblewrap is not used), ``passed`` and ``failed`` (names of the probes, run
    through the sandbox: ``"no /etc/shadow"``, ``"no host /etc/passwd"``, ``"no home folder"``,
    ``"no project files"``, ``"no dataset cache"`` and ``"no host /tmp"`` for those of these host
    paths this host has and can read, then ``"minimal /"``, ``"no other processes"``, ``"no writes
    outside its folder"``, ``"no network"``, ``"no processes"``) and ``summary``, one line for
    people, e.g. ``"bubblewrap (user namespace); probes passed 11/11"``."""
    return _report_for(isolation_level())


# ----------------------------------------------------------------------------- the sandbox


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


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for ``proc`` to exit, at most ``timeout`` seconds; True if it did. Wakes up as soon
    as it exits (a pidfd), where ``Popen.wait`` would poll every 50 ms."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


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
        allow_packages: Installed packages the code may import besides the standard library,
            by distribution or import name (``("numpy", "sympy", "math-verify")``); the packages
            they require come with them, nothing else of site-packages does. A name that is not
            installed is a ValueError.
        max_disk_mb: Size of the working folder under bubblewrap (a tmpfs: a write past it fails
            with "No space left on device"); elsewhere only ``max_file_mb`` bounds each file.
    """

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 1024, max_output_chars: int = 4000,
                 max_file_mb: int = 16, max_code_chars: int = 100_000, allow_packages: tuple[str, ...] | list[str] = (),
                 max_disk_mb: int = 64):
        if timeout_s <= 0 or memory_mb <= 0 or max_disk_mb <= 0:
            raise ValueError("timeout_s, memory_mb and max_disk_mb must be positive")
        if isinstance(allow_packages, str):
            raise TypeError("allow_packages is a list of package names, not one string")
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.max_output_chars = int(max_output_chars)
        self.max_file_mb = int(max_file_mb)
        self.max_code_chars = int(max_code_chars)
        self.max_disk_mb = int(max_disk_mb)
        self.allow_packages = tuple(allow_packages)
        self._packages = _package_entries(self.allow_packages) if self.allow_packages else ()

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
        isolation = self.isolation
        uid = os.geteuid()  # in every mode the sandbox's processes count as the caller's user
        nproc = _count_processes(uid) + 32  # room for nothing much beyond what the user already runs
        limits = [str(max(1, math.ceil(self.timeout_s))), str(self.memory_mb << 20), str(self.max_file_mb << 20), str(nproc)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        tmp = tempfile.mkdtemp(prefix="trace-gym-sandbox-")
        try:
            if isolation == "bubblewrap":
                argv, python = _bubblewrap_argv(_bubblewrap_variant()[0] or "user namespace", self._packages,
                                                self.max_disk_mb << 20, {**env, "HOME": _BW_WORK, "TMPDIR": _BW_WORK})
                cmd = [*argv, python, "-I", "-S", "-B", "-X", "utf8", "-c", _RUNNER, _BW_WORK, *limits,
                       _BW_PACKAGES if self._packages else ""]
                cwd = tmp
            else:
                work = os.path.join(tmp, "work")
                os.mkdir(work)
                packages = ""
                if self._packages:
                    packages = os.path.join(tmp, "packages")
                    _link_packages(self._packages, packages)
                cmd = [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", _RUNNER, work, *limits, packages]
                if isolation == "namespaces":
                    cmd = _namespace_prefix(uid == 0) + [work, *cmd]
                env.update(HOME=work, TMPDIR=work)
                cwd = work
            return self._execute(cmd, cwd, env, code, isolation)
        except OSError as exc:
            return SandboxResult(False, f"Error: the sandbox could not start ({exc}).", None)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _execute(self, cmd: list[str], cwd: str, env: dict[str, str], code: str, isolation: str) -> SandboxResult:
        with tempfile.TemporaryFile() as src, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            src.write(code.encode("utf-8", errors="replace"))
            src.seek(0)
            proc = subprocess.Popen(cmd, stdin=src, stdout=out, stderr=err, cwd=cwd, env=env, start_new_session=True,
                                    close_fds=True)
            try:
                # A little grace beyond the limit for interpreter start-up.
                timed_out = not _wait(proc, self.timeout_s + 0.5)
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole group, whatever the code started
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
            stdout, stderr = _read_bounded(out, self.max_output_chars), _read_bounded(err, self.max_output_chars)
        return self._result(proc.returncode, stdout, stderr, timed_out, isolation)

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + f"\n[... output cut at {self.max_output_chars} characters]"

    def _result(self, rc: int | None, stdout: str, stderr: str, timed_out: bool, isolation: str) -> SandboxResult:
        shown = self._cut(stdout.rstrip())
        if rc is not None and rc > 128 and isolation in ("namespaces", "bubblewrap"):
            rc = -(rc - 128)  # the namespace's init (shell or bwrap) reports a killed program as 128 + signal
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
            if "No space left on device" in detail and isolation == "bubblewrap":
                detail += f"\n(the working folder holds at most {self.max_disk_mb} MB)"
            if "ModuleNotFoundError" in detail:
                allowed = f" and {', '.join(self.allow_packages)}" if self.allow_packages else " only"
                detail += f"\n(importable: the standard library{allowed})"
            return SandboxResult(False, (shown + "\n" if shown else "") + "Error:\n" + self._cut(detail), rc)
        extra = self._cut(stderr.strip())
        text = "\n".join(x for x in (shown, extra) if x) or "(no output)"
        return SandboxResult(True, text, rc)

    def as_tool(self) -> Tool:
        """The ``python`` tool for an env (stateless: each call is a fresh process)."""

        def python(code: str) -> str:
            return self.run(code).output

        packages = ", ".join(self.allow_packages)
        python.__doc__ = (
            "Run a Python 3 program in a sandbox and return what it prints (the value of a final expression is\n"
            "printed too). No network, no files outside a scratch folder, a few seconds of time; it can import\n"
            + (f"the standard library and {packages}.\n" if packages else "the standard library only.\n")
            + "\nArgs:\n"
            '    code: The program, e.g. "from fractions import Fraction\\nprint(Fraction(1, 3) + Fraction(1, 6))".\n')
        return Tool.from_function(python)
