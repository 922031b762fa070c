"""A throw-away 2-node SLURM 22.05 cluster on this machine, for tests and the slow-link benchmark.

Each node is a slurmd in its own network, UTS and mount namespace (hostname nX, address
10.88.S.1X on a bridge whose 10.88.S.1 is where slurmctld listens), so torchrun, gloo and srun
really cross a network link between "nodes", which ``rate`` can shape with tc (tbf on each
node's side of the link). Nodes share this machine's filesystem, like a cluster with a shared
filesystem. Everything is private to one ``LocalCluster``: its own munged (own key and socket),
slurm.conf, ports, subnet and interface names, so it neither needs nor disturbs a system SLURM
or munge, and two clusters can coexist. ``down()`` removes what ``up()`` made, by PID and name.

Needs root, ``ip netns``/veth/bridge support and the Debian packages slurmctld, slurmd,
slurm-client, munge, iproute2 (``install_packages()`` installs the missing ones).
Traffic stays on loopback and on the bridge made here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron_grpo.platform.ports import free_port

COMMANDS = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
            "scontrol": "slurm-client", "sinfo": "slurm-client", "munged": "munge",
            "ip": "iproute2", "tc": "iproute2", "nsenter": "util-linux", "unshare": "util-linux"}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


class ClusterError(RuntimeError):
    """The local cluster could not be started or used; the message says which step and why."""


def _run(cmd: Sequence[str], timeout: float = 30, check: bool = True,
         env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise ClusterError(f"'{' '.join(cmd)}' failed (rc {proc.returncode}): {proc.stderr.strip()[-800:]}")
    return proc


def missing_packages() -> List[str]:
    return sorted({pkg for cmd, pkg in COMMANDS.items() if shutil.which(cmd) is None})


def install_packages(timeout: float = 900) -> None:
    """apt-get install the Debian packages whose commands are missing (no-op when none are)."""
    pkgs = missing_packages()
    if not pkgs:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *pkgs]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise ClusterError(f"'{' '.join(cmd)}' failed (rc {proc.returncode}); install "
                               f"{' '.join(pkgs)} by hand: {proc.stderr.strip()[-600:]}")
    if missing_packages():
        raise ClusterError(f"still missing after apt-get: {missing_packages()}")


def unavailable_reason() -> Optional[str]:
    """Why this machine cannot host the cluster (None if it can). Packages are not checked."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, bridge, slurmd as root)"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare (util-linux) and ip (iproute2)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "ip", "link", "add", "probe0",
                            "type", "veth", "peer", "name", "probe1"],
                           capture_output=True, text=True, timeout=20)
    if probe.returncode != 0:
        return f"network namespaces with veth links are unavailable here: {probe.stderr.strip()[:300]}"
    return None


def _free_port() -> int:
    return free_port("0.0.0.0")


@dataclass
class JobResult:
    job_id: int
    state: str
    exit_code: int
    seconds: float
    output: str


class LocalCluster:
    def __init__(self, root: str, nodes: int = 2, rate: Optional[str] = None,
                 cpus_per_node: int = 1) -> None:
        self.root = os.path.abspath(root)
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.rate = rate
        self.cpus = cpus_per_node
        self.tag = f"mg{os.getpid() % 100000}"
        self.subnet = ""
        self.conf = os.path.join(self.root, "slurm.conf")
        self.procs: Dict[str, subprocess.Popen] = {}
        self._logs: List = []
        self._mnt_ns: set = set()
        self._links: List[str] = []
        self._netns: List[str] = []

    # ------------------------------------------------------------------ addresses
    def node_addr(self, node: str) -> str:
        return f"{self.subnet}.{10 + self.nodes.index(node) + 1}"

    @property
    def controller_addr(self) -> str:
        return f"{self.subnet}.1"

    def env(self, **extra) -> Dict[str, str]:
        return dict(os.environ, SLURM_CONF=self.conf, **extra)

    def _pick_subnet(self) -> str:
        used = _run(["ip", "-o", "-4", "addr"]).stdout + _run(["ip", "-4", "route"]).stdout
        start = os.getpid() % 100
        for k in range(100):
            candidate = f"10.88.{100 + (start + k) % 100}"
            if f"{candidate}." not in used:
                return candidate
        raise ClusterError("no free 10.88.1xx.0/24 subnet for the cluster bridge")

    # ------------------------------------------------------------------ up
    def up(self, timeout: float = 60) -> "LocalCluster":
        try:
            self._up(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _spawn(self, name: str, cmd: List[str]) -> None:
        log = open(os.path.join(self.root, "log", f"{name}.out"), "w")
        self._logs.append(log)
        # Own session: a Ctrl-C aimed at pytest must not kill daemons before down() runs.
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    def _up(self, timeout: float) -> None:
        t0 = time.monotonic()
        os.makedirs(os.path.join(self.root, "log"), exist_ok=True)
        self.subnet = self._pick_subnet()
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        self._net_up()
        for node in self.nodes:
            ns = f"/run/netns/{self.tag}-{node}"
            # nsenter, not 'ip netns exec': that remounts /sys, and slurmd then dies with
            # "No filesystem mounted on /sys/fs/cgroup". A private mount namespace gets its own
            # /etc/hosts that keeps this machine's entries (getaddrinfo needs them) + the nodes.
            self._spawn(node, ["nsenter", f"--net={ns}", "unshare", "--uts", "--mount",
                               "--propagation", "private", "sh", "-c",
                               f"hostname {node} && mount --bind {self.root}/hosts /etc/hosts "
                               f"&& exec slurmd -D -f {self.conf} -N {node}"])
        while True:
            idle = _run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], check=False,
                        env=self.env()).stdout.split()
            if sorted(set(idle)) == self.nodes:
                break
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise ClusterError(f"{name} exited (rc {proc.returncode}) while starting: "
                                       f"{self._tail(name)}")
            if time.monotonic() - t0 > timeout:
                raise ClusterError(f"nodes not idle after {timeout:.0f} s (idle: {idle}); logs in "
                                   f"{self.root}/log: {self._tail('slurmctld')}")
            time.sleep(0.2)
        for node in self.nodes:  # job processes inherit the slurmd's mount namespace
            self._mnt_ns.add(os.readlink(f"/proc/{self.procs[node].pid}/ns/mnt"))
        self.startup_s = time.monotonic() - t0

    def _tail(self, name: str, n: int = 600) -> str:
        try:
            with open(os.path.join(self.root, "log", f"{name}.out")) as fh:
                return fh.read()[-n:]
        except OSError:
            return "(no log)"

    def _start_munge(self) -> None:
        d = os.path.join(self.root, "munge")
        os.makedirs(d, exist_ok=True)
        os.chmod(d, 0o711)  # munged refuses a socket directory others may write to
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as fh:
            fh.write(os.urandom(1024))
        os.chmod(key, 0o600)
        self.munge_socket = os.path.join(d, "munge.socket")
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--log-file={d}/munged.log",
                               f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed"])
        for _ in range(100):
            if os.path.exists(self.munge_socket):
                return
            if self.procs["munged"].poll() is not None:
                break
            time.sleep(0.05)
        raise ClusterError(f"munged did not start: {self._tail('munged')}")

    def _write_conf(self) -> None:
        self.ctl_port = _free_port()
        r = self.root
        lines = [
            f"ClusterName=grpo{self.tag}", f"SlurmctldHost=localhost({self.controller_addr})",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}", "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "ReturnToService=2", "MailProg=/bin/true", f"SlurmctldPort={self.ctl_port}", "SlurmdPort=6818",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool-%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info", "SlurmdTimeout=30", "InactiveLimit=0",
            "KillWait=5", "MinJobAge=600",
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeAddr={self.node_addr(node)} CPUs={self.cpus} "
                         f"RealMemory=1000 State=UNKNOWN")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        # Fresh state: a reused root would carry another cluster's name and jobs.
        for d in ["state", *(f"spool-{n}" for n in self.nodes)]:
            shutil.rmtree(os.path.join(r, d), ignore_errors=True)
            os.makedirs(os.path.join(r, d))
        with open(self.conf, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        with open("/etc/hosts") as fh:
            own = [ln for ln in fh.read().splitlines() if not re.search(r"(^|\s)n\d+(\s|$)", ln)]
        with open(os.path.join(r, "hosts"), "w") as fh:
            fh.write("\n".join(own + [f"{self.node_addr(n)} {n}" for n in self.nodes]) + "\n")

    def _net_up(self) -> None:
        br = f"{self.tag}-br"
        _run(["ip", "link", "add", br, "type", "bridge"])
        self._links.append(br)
        _run(["ip", "addr", "add", f"{self.controller_addr}/24", "dev", br])
        _run(["ip", "link", "set", br, "up"])
        for i, node in enumerate(self.nodes, 1):
            ns, inner, outer = f"{self.tag}-{node}", f"{self.tag}-v{i}", f"{self.tag}-v{i}p"
            _run(["ip", "netns", "add", ns])
            self._netns.append(ns)
            _run(["ip", "link", "add", inner, "type", "veth", "peer", "name", outer])
            self._links.append(outer)  # deleting one end deletes the pair
            _run(["ip", "link", "set", inner, "netns", ns])
            _run(["ip", "link", "set", outer, "master", br])
            _run(["ip", "link", "set", outer, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.node_addr(node)}/24", "dev", inner])
            _run(["ip", "-n", ns, "link", "set", inner, "up"])
            if self.rate:
                # Egress limit of each node: every inter-node byte leaves some node's veth.
                _run(["nsenter", f"--net=/run/netns/{ns}", "tc", "qdisc", "add", "dev", inner,
                      "root", "tbf", "rate", self.rate, "burst", "64kb", "latency", "50ms"])

    def link_tx_bytes(self, node: str) -> int:
        """Bytes this node has sent over its link so far (its veth's counter, headers included)."""
        import json

        i = self.nodes.index(node) + 1
        out = _run(["ip", "-n", f"{self.tag}-{node}", "-j", "-s", "link", "show", "dev",
                    f"{self.tag}-v{i}"]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    # ------------------------------------------------------------------ jobs
    def submit(self, script: str, args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
               nodes: int = 2, output: Optional[str] = None, chdir: Optional[str] = None) -> int:
        output = output or os.path.join(self.root, "job-%j.out")
        cmd = ["sbatch", "--parsable", f"--nodes={nodes}", f"--output={output}"]
        if chdir:
            cmd.append(f"--chdir={chdir}")
        proc = _run([*cmd, script, *args], env=dict(self.env(), **(env or {})))
        return int(proc.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> Dict[str, str]:
        out = _run(["scontrol", "show", "job", "-o", str(job_id)], check=False, env=self.env()).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, timeout: float) -> JobResult:
        """Poll every 0.25 s (sbatch --wait polls with growing intervals: late by tens of s)."""
        t0 = time.monotonic()
        while True:
            info = self.job_info(job_id)
            state = info.get("JobState", "")
            if state in TERMINAL:
                break
            if time.monotonic() - t0 > timeout:
                _run(["scancel", str(job_id)], check=False, env=self.env())
                raise ClusterError(f"job {job_id} still {state or 'unknown'} after {timeout:.0f} s "
                                   f"(cancelled); output: {info.get('StdOut')}")
            time.sleep(0.25)
        seconds = time.monotonic() - t0
        exit_code = int(info.get("ExitCode", "0:0").split(":")[0])
        try:
            with open(info["StdOut"]) as fh:
                text = fh.read()
        except (KeyError, OSError):
            text = ""
        return JobResult(job_id, state, exit_code, seconds, text)

    def run_job(self, script: str, args: Sequence[str] = (), timeout: float = 300, **kw) -> JobResult:
        return self.wait(self.submit(script, args, **kw), timeout)

    # ------------------------------------------------------------------ down
    def down(self) -> List[str]:
        """Stop and remove everything up() made; returns what could not be cleaned (empty: all)."""
        problems: List[str] = []
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            # Best effort: a controller that does not answer (scancel or squeue timing out, as
            # under a loaded machine's SIGTERM) must not keep the daemons and namespaces below
            # from being removed; the jobs' processes are killed by namespace anyway.
            try:
                _run(["scancel", "--quiet", "--user", "root"], check=False, env=self.env(), timeout=10)
                for _ in range(40):  # bounded: up to 10 s for jobs to end
                    if not _run(["squeue", "-h"], check=False, env=self.env(), timeout=5).stdout.strip():
                        break
                    time.sleep(0.25)
            except (subprocess.SubprocessError, OSError) as exc:
                problems.append(f"jobs not cancelled ({type(exc).__name__}); their processes are killed")
        for name in [*self.nodes, "slurmctld", "munged"]:
            proc = self.procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        # Job processes (slurmstepd, torchrun, ranks) live on in the nodes' namespaces.
        ns_ids = set(self._mnt_ns)
        for ns in self._netns:
            try:
                ns_ids.add(f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]")
            except OSError:
                pass
        for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
            try:
                mine = {os.readlink(f"/proc/{pid}/ns/mnt"), os.readlink(f"/proc/{pid}/ns/net")}
            except OSError:
                continue
            if mine & ns_ids and pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in self._netns:
            _run(["ip", "netns", "del", ns], check=False)
            if os.path.exists(f"/run/netns/{ns}"):
                problems.append(f"netns {ns}")
        for link in self._links:
            _run(["ip", "link", "del", link], check=False)
        for _ in range(50):  # namespace deletion is asynchronous; bounded 5 s
            if self.tag not in _run(["ip", "-br", "link"], check=False).stdout:
                break
            time.sleep(0.1)
        else:
            problems.append(f"links {self.tag}-*")
        for log in self._logs:
            log.close()
        self._netns, self._links, self._logs = [], [], []
        self.procs = {k: p for k, p in self.procs.items() if p.poll() is None}
        problems += [f"process {k} (pid {p.pid})" for k, p in self.procs.items()]
        return problems


@contextlib.contextmanager
def down_on_signals(cluster, signals=(signal.SIGTERM, signal.SIGINT)):
    """While inside: SIGTERM or SIGINT takes ``cluster`` down first. Without it SIGTERM
    (``timeout``, a CI job cancelled, ``kill``) ends pytest at once: no fixture finalizer runs,
    and munged, slurmctld, both slurmd (their own sessions, so the signal does not reach them)
    and the network namespaces stay. After the teardown SIGTERM ends the process with the same
    signal, and SIGINT raises KeyboardInterrupt as Python's own handler does (pytest then stops
    and reports; the fixture's second ``down()`` finds nothing left). A second signal during the
    teardown ends the process at once (the handlers are reset first)."""
    def handler(signum, _frame):
        for s in signals:
            signal.signal(s, signal.SIG_DFL)
        try:
            cluster.down()
        finally:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)

    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield cluster
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------- reading a job's results
RANK_LINE = re.compile(r"^\[rank (\d+) on (\S+)\] iteration (\d+)(?:/\d+ step| tier map (\w+))")


def rank_logs(log_dir):
    """{(rank, host): {"progress": [iterations], "maps": [(iteration, tier map)]}} from the
    per-rank log files that launch/slurm/rank_exec.sh writes."""
    out = defaultdict(lambda: {"progress": [], "maps": []})
    for name in sorted(os.listdir(log_dir)):
        if not name.endswith(".log"):
            continue
        with open(os.path.join(log_dir, name)) as fh:
            for line in fh:
                m = RANK_LINE.match(line)
                if not m:
                    continue
                entry = out[(int(m.group(1)), m.group(2))]
                if m.group(4):
                    entry["maps"].append((int(m.group(3)), m.group(4)))
                else:
                    entry["progress"].append(int(m.group(3)))
    return dict(out)
