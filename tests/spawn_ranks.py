"""Start N ranks of a command on this machine with the variables torchrun hands its ranks, for the test runs
whose subject is not the launcher (``launch.NOT_THE_SUBJECT``):

    python tests/spawn_ranks.py N MASTER_PORT [--zygote SOCKET] -- COMMAND ...

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR (loopback) and MASTER_PORT, which is
what the trainer reads from any launcher (``convbert_ds/engine/distributed.py``), and inherits stdout and
stderr.

Why the ranks are forked. Every rank of a run first imports torch, DeepSpeed and the trainer (4.2
CPU-seconds), and DeepSpeed's ZeRO check imports its Muon optimizer, whose ``torch.compile`` decorators import
inductor (1.5 more): a 3-step tiny run on 2 ranks took 10.5 CPU-seconds, most of it those imports, and the
suite starts about sixty runs on 2 CPU cores that are short of CPU, not of wall time. So when COMMAND is this
Python running a module (``-m convbert_ds.train``) or a script (``.py``), the ranks are forked from a process
that has made those imports (``PRELOAD``), and each runs COMMAND from there as ``python`` would. Nothing runs
before the fork but imports, and torch starts its thread pools at the first operation, so none is forked.

- ``--zygote SOCKET``: that process is the zygote listening there (``python tests/spawn_ranks.py --serve
  SOCKET``, one per pytest process, started by ``launch.py``): it forks a spawner per run, which takes this
  process's stdin, stdout, stderr, working directory and environment, forks the ranks and sends back the
  exit code. The run's environment must match the zygote's in everything but ``LAZY_VARIABLES`` (read when
  used, not at import); otherwise, or without a zygote, this process makes the imports and forks.
  If this process dies (a test's timeout kills its process group), the spawner kills the ranks.
- Any other COMMAND starts as processes of their own.

As torchrun does, it stops the other ranks when one fails (they would wait in a collective for it): SIGTERM,
then SIGKILL after a grace. It exits with the first failed rank's code (128 + N for a signal), else 0.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback

GRACE_S = 10.0  # for the other ranks to leave after SIGTERM (the trainer takes it for a preemption and may
# try to save: a save that waits on the failed rank is killed)
PRELOAD = ("torch", "torch._dynamo", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer",
           "convbert_ds.engine.trainer")
# Read when used, not when imported: a run may set them differently from the zygote's environment. Anything
# else that differs (a TORCHINDUCTOR_ or OMP_ setting, say) makes the run fork from fresh imports instead.
LAZY_VARIABLES = ("PYTEST_CURRENT_TEST", "MASTER_PORT", "CONVBERT_DS_")
_HEADER = struct.Struct("!I")  # the length of the JSON request; the reply is the exit code, the same struct


def preload() -> dict:
    """Import ``PRELOAD``; the environment variables the imports set (torch sets TORCHINDUCTOR_CACHE_DIR to
    its default), which a rank gets where its own environment does not set them, as after its own imports."""
    before = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    return {name: value for name, value in os.environ.items() if before.get(name) != value}


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class ForkedRank:
    """A rank forked from this process, with the calls of ``subprocess.Popen`` that ``run_ranks`` makes."""

    def __init__(self, command: list[str], rank_env: dict, imports_set: dict, close: socket.socket | None = None):
        module = command[2] if command[1] == "-m" else None
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid, self.returncode = os.fork(), None
        if self.pid:
            return
        # The rank: ``python -m MODULE ARGS`` or ``python SCRIPT ARGS`` from here on, in this environment. It
        # ends as that process would: SystemExit goes up to the interpreter (atexit handlers, flushed streams;
        # nothing above catches it), and an exception prints its traceback and exits with 1.
        if close is not None:
            close.close()
        os.environ.clear()
        os.environ.update({**imports_set, **rank_env})
        sys.argv = command[2 if module else 1:]
        try:
            if module:
                sys.path[0] = os.getcwd()  # as ``python -m`` sets it
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                sys.path[0] = os.path.dirname(os.path.abspath(command[1]))  # as ``python SCRIPT`` sets it
                runpy.run_path(command[1], run_name="__main__")
        except Exception:  # noqa: BLE001 -- what python does with an uncaught exception
            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def _runs_python(command: list[str]) -> bool:
    """``python -m MODULE ...`` or ``python SCRIPT.py ...`` with this Python: what a rank can be forked for."""
    return (len(command) >= 2 and os.path.realpath(command[0]) == os.path.realpath(sys.executable)
            and (command[1] == "-m" and len(command) >= 3 or command[1].endswith(".py")))


def _rank_envs(ranks: int, port: str, base: dict) -> list[dict]:
    base = {**base, "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port}
    return [{**base, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(ranks)]


def run_ranks(ranks: int, port: str, command: list[str], base_env: dict, client: socket.socket | None = None) -> int:
    """Start the ranks (forked from this process when it has ``PRELOAD`` imported) and wait for them; the
    first failure stops the rest. ``client``: the zygote's connection to the run's caller, whose closing
    (the caller killed) kills the ranks."""
    envs = _rank_envs(ranks, port, base_env)
    if _runs_python(command):
        imports_set = _IMPORTS_SET if _IMPORTS_SET is not None else preload()
        running = [ForkedRank(command, rank_env, imports_set, close=client) for rank_env in envs]
    else:
        running = [subprocess.Popen(command, env=rank_env) for rank_env in envs]
    failed = 0
    while running:
        for process in [p for p in running if p.poll() is not None]:
            running.remove(process)
            if process.returncode and not failed:
                failed = _exit_code(process.returncode)
                _stop(running)
        if client is not None and _closed(client):  # the caller was killed: so is all this spawner started
            os.killpg(0, signal.SIGKILL)
        time.sleep(0.05)
    return failed


def _stop(processes: list) -> None:
    for process in processes:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()


def _closed(connection: socket.socket) -> bool:
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# The zygote ------------------------------------------------------------------------------------------


_IMPORTS_SET: dict | None = None  # in the zygote and its spawners: what ``preload`` returned


def serve(path: str, owner: int) -> None:
    """Import ``PRELOAD``, then fork a spawner for each run asked for on the Unix socket ``path``; exit when
    the process ``owner`` (the pytest process) is gone. ``path.env`` holds the environment the imports were
    made in, written once the socket listens."""
    global _IMPORTS_SET
    sys.path[0] = os.getcwd()  # the package as ``python -m`` finds it, not this file's folder
    started_with = dict(os.environ)
    _IMPORTS_SET = preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    server.settimeout(1.0)
    with open(path + ".env.part", "w") as file:
        json.dump(started_with, file)
    os.replace(path + ".env.part", path + ".env")
    while True:
        try:
            connection, _ = server.accept()
        except socket.timeout:
            connection = None
        while True:  # reap the spawners that have finished
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if connection is None:
            if os.getppid() != owner:
                return
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            server.close()
            try:
                code = _spawn(connection)
            except Exception:  # noqa: BLE001 -- the spawner's own failure (a rank's SystemExit is not caught)
                traceback.print_exc()
                code = 1
            os._exit(code)
        connection.close()


def _spawn(connection: socket.socket) -> int:
    """In the spawner: the caller's streams, directory and environment, then the ranks; the exit code back."""
    os.setsid()  # the ranks in a group of their own, which the caller's death takes down (_closed)
    length = _HEADER.unpack(_receive(connection, _HEADER.size))[0]
    message, fds, _, _ = socket.recv_fds(connection, length, 3)
    while len(message) < length:
        message += connection.recv(length - len(message))
    request = json.loads(message)
    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    code = run_ranks(request["ranks"], request["port"], request["command"], request["env"], client=connection)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        connection.sendall(_HEADER.pack(code))
    except OSError:
        pass
    return code


def _receive(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the caller left")
        data += chunk
    return data


def zygote_env_matches(env: dict, zygote_env: dict) -> bool:
    """True when ``env`` differs from the zygote's only in ``LAZY_VARIABLES``."""
    differ = {k for k in env.keys() | zygote_env.keys() if env.get(k) != zygote_env.get(k)}
    return all(name.startswith(LAZY_VARIABLES) for name in differ)


def _through_zygote(path: str, ranks: int, port: str, command: list[str]) -> int | None:
    """The run through the zygote at ``path``; None when there is none or its environment differs."""
    try:
        with open(path + ".env") as file:
            zygote_env = json.load(file)
    except OSError:
        return None
    if not zygote_env_matches(dict(os.environ), zygote_env):
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:
        return None
    message = json.dumps({"ranks": ranks, "port": port, "command": command, "env": dict(os.environ),
                          "cwd": os.getcwd()}).encode()
    connection.sendall(_HEADER.pack(len(message)))
    socket.send_fds(connection, [message], [0, 1, 2])
    return _HEADER.unpack(_receive(connection, _HEADER.size))[0]


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--serve":
        serve(argv[1], int(argv[2]))
        return 0
    zygote = None
    if len(argv) >= 4 and argv[2] == "--zygote":
        zygote, argv = argv[3], argv[:2] + argv[4:]
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    ranks, port, command = int(argv[0]), argv[1], argv[3:]
    if zygote and _runs_python(command):
        code = _through_zygote(zygote, ranks, port, command)
        if code is not None:
            return code
    sys.path[0] = os.getcwd()  # the package as ``python -m`` finds it, not this file's folder
    return run_ranks(ranks, port, command, dict(os.environ))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
