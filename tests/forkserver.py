"""A Python process that has imported torch once and forks a copy of itself for each test launch.

    python tests/forkserver.py SOCKET     (started by tests/launch.py, one per environment and rank)

Most of this suite's launches are `python train.py ...` or one rank of a gloo group, and each spent about 3 of its
4-5 CPU-seconds importing torch and DTensor before running a line of the recipe: over 300 launches, about a quarter
of the suite's CPU time (49 -> 37 CPU-minutes when this server came). This server pays that import once. A request
(over a Unix socket: the command line, the working folder, the environment, and the three standard files as
descriptors) is answered by a fork whose child becomes what `python SCRIPT ARGS` or `python -m MODULE ARGS` would be,
then runs it as the interpreter does:

- the same `sys.argv`, `sys.path` (the script's folder, or the working folder under -m, then PYTHONPATH), `__main__`
  module (a script's `__file__` absolute and `__spec__` None; under -m, runpy's), environment and working folder;
- the same exit: SystemExit's code (a message printed to stderr and 1), an uncaught exception's traceback and 1, a
  KeyboardInterrupt re-raised as SIGINT; non-daemon threads joined, then atexit, then the streams flushed.

What a fork cannot change is decided before the import: the environment variables torch, dynamo, inductor, OpenMP
and Python read when they load, and Python's string-hash seed. tests/launch.py starts one server per value of the
variables it knows to be read (AT_IMPORT) and per rank (so the ranks of a launch hash as differently as separately
started ranks do); this server also records every variable its imports looked up, and answers a request whose
environment differs in one of them with the variable's name instead of a fork: the client then starts a new
interpreter. Importing dynamo and inductor here (about half of what a forked train.py launch still spent: the
start-up memory estimate traces with dynamo's fake tensors) is what that check makes safe. Nothing of this
repository is imported here, so a launch always runs the files as they are now.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
import types
from importlib.machinery import SourceFileLoader
from typing import NoReturn

WARM = (
    "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp", "numpy",
    "torch._dynamo", "torch._inductor.compile_fx",
)  # fmt: skip


def _warm_imports() -> tuple[dict[str, str | None], dict[str, str]]:
    """Import WARM. The environment variables those imports looked up by name, with the value each had (None: unset;
    a copy of the whole environment, as networkx reads its own prefix, is not a lookup by name), and those they set
    (inductor sets its cache folder's)."""
    before = dict(os.environ)
    looked_up: dict[str, str | None] = {}
    environ = type(os.environ)
    getitem = environ.__getitem__

    def recording(self: os._Environ[str], key: str) -> str:
        caller = sys._getframe(1).f_code
        whole = caller.co_name == "__iter__" or (caller.co_name == "copy" and caller.co_filename == os.__file__)
        try:
            value = getitem(self, key)
        except KeyError:
            value = None
            raise
        finally:
            if not whole:
                looked_up.setdefault(key, value)
        return value

    environ.__getitem__ = recording  # type: ignore[method-assign]
    try:
        for name in WARM:
            __import__(name)
    finally:
        environ.__getitem__ = getitem  # type: ignore[method-assign]
    return looked_up, {key: value for key, value in os.environ.items() if before.get(key) != value}


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter exits with for SystemExit(code)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _search_path(pythonpath: str) -> list[str]:
    """sys.path after its first entry, for a PYTHONPATH: its entries, then the interpreter's own (this server's,
    after the entries of the PYTHONPATH it started with)."""
    started_with = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    entries = [entry for entry in pythonpath.split(os.pathsep) if entry]
    return entries + sys.path[1 + len(started_with) :]


def _become(request: dict, fds: list[int], set_by_imports: dict[str, str]) -> NoReturn:
    """In the child: turn into `python ARGV` in CWD with ENV (and what the warm imports set in it), run it, and exit
    as the interpreter would."""
    for target, fd in enumerate(fds):  # stdin, stdout, stderr
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    sys.path[1:] = _search_path(request["env"].get("PYTHONPATH", ""))
    os.environ.clear()
    os.environ.update(set_by_imports | request["env"])
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            import runpy

            sys.argv = ["-m", *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(argv[1], alter_argv=True)  # what `python -m` calls
        else:
            path = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(path)
            main = types.ModuleType("__main__")
            main.__file__, main.__cached__, main.__spec__ = path, None, None
            main.__loader__ = SourceFileLoader("__main__", path)
            sys.modules["__main__"] = main
            with open(path, "rb") as f:
                source = f.read()
            exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # printed from the script's frame on, as the interpreter prints it
        exc = exc.with_traceback(exc.__traceback__.tb_next if exc.__traceback__ else None)  # the frame above is ours
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's order at exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


def serve(path: str) -> None:
    looked_up, set_by_imports = _warm_imports()
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path + ".tmp")
    server.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for this name: the server is ready
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([server], [], [], 0.05)
        if ready:
            conn, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)  # what launch.Forked sent with socket.send_fds
            request = json.loads(message)
            stale = [key for key, value in looked_up.items() if request["env"].get(key) != value]
            if stale:  # the imports above would have read another value: not a fork of this interpreter
                for fd in fds:
                    os.close(fd)
                conn.send(f"stale {stale[0]}".encode())
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                for other in children.values():
                    other.close()
                conn.close()
                _become(request, fds, set_by_imports)
            for fd in fds:
                os.close(fd)
            conn.send(str(pid).encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            with contextlib.suppress(OSError):  # the client went away
                conn.send(str(os.waitstatus_to_exitcode(status)).encode())
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
