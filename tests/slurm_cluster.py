"""A real Slurm cluster of several nodes on one machine's loopback, private to one test session.

``slurmctld`` and one ``slurmd`` per node (Debian's ``slurm-wlm``, installed with apt when missing) run in
the foreground as children of this process, with their config, state, spool and logs under one
directory and ports nobody else uses. No systemd and no munge: ``auth/none``, ``cred/none``,
``proctrack/linuxproc``, ``task/none``. Clients find the cluster through ``SLURM_CONF``, which
jobs inherit, so ``srun``/``scontrol`` inside a job talk to the same cluster.

Each node (``n1``, ``n2``, ...) is a ``slurmd -N nK`` in UTS and mount namespaces of its own (``unshare``, as
root): its own hostname, its own ``/etc/hosts`` naming every node at 127.0.0.1 (so the rendezvous host
resolves inside a job), and its own node-local disk: ``cluster.scratch`` is one path on every node, bind-mounted
from ``disks/nK``, so a file a job writes there on n2 is not visible on n1 (``cluster.disk("n2")`` is where the
test reads it). Everything else (the test's temporary directories) is the shared disk. ``kill_node`` kills every
process of a node's namespaces, as a dead machine would (or, with ``hang``, stops them); Slurm marks the node
down after ``SlurmdTimeout`` and requeues its jobs for node failure; ``start_node`` brings it back.

Stopping cancels every job, waits for the queue to drain, stops both daemons, and finally
kills, by pid, any process still carrying this cluster's marker variable in its environment
(a job step or ``slurmstepd`` that outlived its daemon).

Run it by hand to experiment: ``python tests/slurm_cluster.py`` starts a cluster and prints the
``SLURM_CONF`` to export; Ctrl-C stops it.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

MARKER = "CONVBERT_DS_TEST_SLURM"
DAEMONS = ("slurmctld", "slurmd")
# Seconds without an answer before slurmctld marks a node down (a dead node is noticed in about 20-30 s).
# CONVBERT_DS_TEST_SLURMD_TIMEOUT=300 (Slurm's default) runs the node-loss test as a production cluster would
# time it: about 7 minutes.
SLURMD_TIMEOUT = int(os.environ.get("CONVBERT_DS_TEST_SLURMD_TIMEOUT", "10"))
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and cannot be installed here (not root, or no apt-get)."""


def find_daemon(name: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN_DIRS])
    return shutil.which(name, path=path)


def ensure_slurm_installed() -> None:
    """Install Debian's ``slurm-wlm`` if the daemons are missing (as CI does on a fresh machine)."""
    if all(find_daemon(d) for d in DAEMONS) and shutil.which("sbatch"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("slurmctld/slurmd not found and cannot apt-get install slurm-wlm here "
                               "(needs root and apt)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm"]):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    if not all(find_daemon(d) for d in DAEMONS):
        raise RuntimeError("slurm-wlm installed but slurmctld/slurmd still not found")


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SlurmCluster:
    """``with SlurmCluster(root, nodes=2) as cluster:`` nodes ``n1..nN``, each ``cpus`` CPUs and ``gpus`` stand-in
    GPUs, in partition ``ci``."""

    def __init__(self, root: Path, nodes: int = 2, cpus: int = 2, gpus: int = 2):
        self.root = Path(root)
        self.cpus, self.gpus = cpus, gpus
        self.nodes = [f"n{k}" for k in range(1, nodes + 1)]
        self.conf = self.root / "slurm.conf"
        self.log_dir = self.root / "log"
        self.scratch = self.root / "scratch"  # the node-local path: the same name on every node, its own disk
        self.processes: dict[str, subprocess.Popen] = {}  # "slurmctld" and one per node name
        # Jobs derive their rendezvous port from the job id (20000 + id % 12000): a random first
        # id keeps two test sessions on one machine off each other's ports.
        self.first_job_id = random.randrange(1000, 19000)

    def disk(self, node: str) -> Path:
        """Node ``node``'s own disk, seen from outside the nodes (inside it is ``self.scratch``)."""
        return self.root / "disks" / node

    # Configuration -----------------------------------------------------------------
    def write_config(self) -> None:
        for sub in ("state", "spool", "log", "scratch", *(f"disks/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        r = self.root
        # Stand-in GPUs: Slurm schedules and reports them (SLURM_GPUS_ON_NODE), which is what the
        # job scripts' tasks-vs-GPUs check reads; torch still sees no CUDA device.
        gres = f"Gres=gpu:{self.gpus} " if self.gpus else ""
        nodes = "\n".join(f"NodeName={n} NodeHostname={n} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
                          f"{gres}State=UNKNOWN" for n, port in zip(self.nodes, node_ports))
        self.conf.write_text(f"""\
ClusterName=convbertci
SlurmctldHost={socket.gethostname().split(".")[0]}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
# cred_expire is also how long a requeued job waits before it may start again (default 120 s;
# 5 is the least Slurm takes); the short scheduler intervals start it as soon as it may.
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=1,bf_interval=1
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Each node has the configured CPUs whatever the machine has.
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
# A node that answers again (start_node) is back in service at once.
ReturnToService=2
SlurmdTimeout={SLURMD_TIMEOUT}
FirstJobId={self.first_job_id}
MinJobAge=600
KillWait=10
InactiveLimit=0
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
GresTypes=gpu
{nodes}
PartitionName=ci Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        (self.root / "gres.conf").write_text(self._fake_gpus())
        hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").is_file() else ""
        (self.root / "hosts").write_text(f"{hosts.rstrip()}\n127.0.0.1 {' '.join(self.nodes)}\n")

    def _fake_gpus(self) -> str:
        """gres.conf lines for ``self.gpus`` stand-in GPU device files (Slurm drops file-less GPUs)."""
        if not self.gpus:
            return ""
        dev = self.root / "dev"
        dev.mkdir(exist_ok=True)
        for i in range(self.gpus):
            path = dev / f"fakegpu{i}"
            if not path.exists():
                try:  # a character device like /dev/null keeps slurmd quiet; a plain file also works
                    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
                except OSError:
                    path.touch()
        return f"NodeName={','.join(self.nodes)} Name=gpu File={dev}/fakegpu[0-{self.gpus - 1}]\n"

    # Environment for clients and jobs ------------------------------------------------
    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        # A job submitted from inside another job (or a shell with SLURM_* set) must not
        # inherit that job's identity.
        for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            del env[key]
        sbin = os.pathsep.join(d for d in SBIN_DIRS if os.path.isdir(d))
        env.update({"SLURM_CONF": str(self.conf), MARKER: str(self.root),
                    "PATH": f"{env.get('PATH', '')}{os.pathsep}{sbin}"})
        return env

    def run(self, *command: str, timeout: float = 60, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        env = self.env(kwargs.pop("env", None))
        result = subprocess.run(list(command), env=env, capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
                               f"\n{self.daemon_logs()}")
        return result

    # Lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float = 60) -> "SlurmCluster":
        ensure_slurm_installed()
        if not shutil.which("unshare"):
            raise SlurmUnavailable("unshare (util-linux) not found: the test cluster's nodes need namespaces")
        self.write_config()
        self._spawn("slurmctld", [find_daemon("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, timeout,
                   "slurmctld did not answer scontrol ping")
        for node in self.nodes:
            self.start_node(node, wait=False)
        self._wait(lambda: self._idle(self.nodes), timeout, f"nodes {self.nodes} did not become idle")
        return self

    def start_node(self, node: str, wait: bool = True, timeout: float = 60) -> None:
        """Start (or restart) node ``node``'s slurmd in namespaces of its own (see the module docstring)."""
        if node in self.processes:  # still there (hung by kill_node, or running): its processes go first
            self.kill_node(node)
        inside = (f"hostname {node} && mount --bind {self.disk(node)} {self.scratch} && "
                  f"mount --bind {self.root / 'hosts'} /etc/hosts && "
                  f"exec {find_daemon('slurmd')} -D -f {self.conf} -N {node}")
        self._spawn(node, ["unshare", "--uts", "--mount", "--propagation", "private", "bash", "-c", inside])
        if wait:  # answering again; it may still be finishing the steps it had when it died (completing)
            self._wait(lambda: self._answering(node), timeout,
                       f"node {node} did not come back (state {self.node_state(node)!r})")

    def kill_node(self, node: str, hang: bool = False) -> list[int]:
        """Kill every process of node ``node`` (its slurmd, its job steps, their children) at once, as a
        machine that dies would leave them; with ``hang``, stop them (SIGSTOP) instead, as a machine that hangs
        or drops off the network leaves them: their connections stay open and nothing answers on them
        (``start_node`` kills them first). Returns their pids."""
        process = self.processes[node] if hang else self.processes.pop(node)
        namespace = os.readlink(f"/proc/{process.pid}/ns/uts")
        killed = []
        for _ in range(3):  # a process forked while we were killing is caught by the next pass
            for entry in Path("/proc").iterdir():
                try:
                    if entry.name.isdigit() and os.readlink(entry / "ns" / "uts") == namespace:
                        os.kill(int(entry.name), signal.SIGSTOP if hang else signal.SIGKILL)
                        killed.append(int(entry.name))
                except OSError:
                    continue
            time.sleep(0.2)
        if not hang:
            process.wait()
        return sorted(set(killed))

    def node_state(self, node: str) -> str:
        return self.run("sinfo", "-h", "-n", node, "-N", "-o", "%T", check=False).stdout.strip()

    def _spawn(self, name: str, command: list[str]) -> None:
        with open(self.log_dir / f"{name}.stderr", "a") as log:
            self.processes[name] = subprocess.Popen(command, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True)

    def _answering(self, node: str) -> bool:
        state = self.node_state(node)
        return bool(state) and "*" not in state and not state.startswith(("down", "drain", "fail"))

    def _idle(self, nodes: list[str]) -> bool:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}\n{self.daemon_logs()}")
        return all(self.node_state(node) == "idle" for node in nodes)

    def _wait(self, condition, timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.3)
        raise RuntimeError(f"{message} within {timeout:.0f} s\n{self.daemon_logs()}")

    def stop(self) -> None:
        if not self.processes:
            return
        if self.processes["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user", str(os.geteuid()), check=False)
            try:  # squeue lists pending, running and completing jobs by default
                self._wait(lambda: not self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip(), 30,
                           "jobs did not drain")
            except RuntimeError:
                pass
        for name in [*self.nodes, "slurmctld"]:
            process = self.processes.pop(name, None)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        """Kill (by pid) processes that carry this cluster's marker: orphaned steps or slurmstepd."""
        tag = f"{MARKER}={self.root}".encode()
        for _ in range(2):
            found = []
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit() or int(entry.name) == os.getpid():
                    continue
                try:
                    if tag in (entry / "environ").read_bytes().split(b"\0"):
                        found.append(int(entry.name))
                except OSError:
                    continue
            if not found:
                return
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)

    def __enter__(self) -> "SlurmCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # Jobs ------------------------------------------------------------------------------
    def job(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout.strip()
        fields = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, timeout: float = 300, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                  "NODE_FAIL", "OUT_OF_MEMORY")) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout:.0f} s\n"
                           f"{self.daemon_logs()}")

    def daemon_logs(self, tail: int = 40) -> str:
        parts = []
        for path in sorted(self.log_dir.glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n".join(parts)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="slurm-") as tmp, SlurmCluster(Path(tmp)) as cluster:
        print(f"export SLURM_CONF={cluster.conf}    # Ctrl-C stops the cluster", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


def recording_prefix(directory: Path) -> tuple[str, Path]:
    """A stand-in for a container launcher, used as ``CONVBERT_DS_LAUNCH_PREFIX="container-exec IMAGE"``
    (two words, as ``apptainer exec IMAGE``): it appends the command it was given to a record file, one
    line each, drops IMAGE and runs the command unchanged. Returns (the prefix, the record file)."""
    record = directory / "prefix-calls.txt"
    script = directory / "container-exec"
    script.write_text(f'#!/bin/bash\nprintf "%s\\n" "$*" >> {shlex.quote(str(record))}\nshift\nexec "$@"\n')
    script.chmod(0o755)
    return f"{script} image.sif", record
