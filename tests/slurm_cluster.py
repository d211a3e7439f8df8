"""A real Slurm cluster for the tests: munge, slurmctld and one slurmd per node, under a temporary folder.

Debian's own packages provide the programs (`apt-get install -y --no-install-recommends slurmctld slurmd
slurm-client munge`; .ci/run installs them). Nothing here touches the machine's own Slurm or munge set-up: the
munge key, its socket, slurm.conf, state, spool, logs and PID files are all in the folder, every port is a free
one, the clients find the cluster through SLURM_CONF, and every daemon is stopped by its PID at the end. No
systemd and no cgroup plugins (slurmd only wants /sys/fs/cgroup mounted): processes are tracked through /proc
(proctrack/linuxproc) and there is no accounting, so a job's state comes from `scontrol show job` and each
task's exit from srun's lines in the job's output.

Node names must differ from the machine's hostname. One node in this network namespace is `localhost`, which
TensorFlow's Slurm resolver (it connects to the node names) reaches. Two nodes each get a namespace of their
own (netns.Hosts): on one machine both nodes' first task would otherwise want the same port.
"""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue")
PACKAGES = "slurmctld slurmd slurm-client munge"
# What each node says it has (SlurmdParameters=config_overrides): enough for deploy/slurm.sbatch's
# --cpus-per-task as written, whatever the machine has. Nothing binds tasks to CPUs (task/none).
NODE_CPUS = 8
START_SECONDS = 60  # daemons up and the nodes idle, which takes them seconds
STOP_SECONDS = 20
CRED_EXPIRE_SECONDS = 10
SCHEDULER_SECONDS = 1
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}
# srun's own lines for tasks that ended badly, one line for the tasks that ended alike at once ("tasks 0-1",
# "tasks 0,2-3"); a task that exits 0 gets none.
TASK_EXITED = re.compile(r"tasks? ([\d,-]+): Exited with exit code (\d+)")
TASK_KILLED = re.compile(r"tasks? ([\d,-]+): Killed")

SLURM_CONF = """\
ClusterName=mnisttest
SlurmctldHost=localhost({controller})
SlurmctldPort={controller_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job starts again once its old credential has expired: 120 s by default.
AuthInfo=socket={munge_socket},cred_expire={cred_expire}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# The nodes have the CPUs configured below, whatever the machine has.
SlurmdParameters=config_overrides
# Seconds between a cancelled job's SIGTERM and its SIGKILL (default 30), so a hung test ends sooner.
KillWait=5
# A requeued job becomes eligible once its old credential expires, which no event marks: the scheduler's loops
# start it at their next pass (60 s and 30 s by default), so that a test would wait anything up to a minute.
SchedulerParameters=sched_interval={scheduler_seconds},bf_interval={scheduler_seconds}
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def unavailable():
    """Why a real Slurm cannot run here, or None."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install -y --no-install-recommends {PACKAGES})"
    if os.geteuid() != 0:
        return "slurmd needs root to start jobs"
    return None


class Node:
    def __init__(self, name, address, port, run_in=()):
        self.name, self.address, self.port, self.run_in = name, address, port, list(run_in)


class SlurmCluster:
    """A running cluster of `nodes`; the first node's host also holds slurmctld, munge is shared through a file
    socket. Use it as a context manager: leaving it cancels every job and stops every daemon."""

    def __init__(self, folder, nodes, controller_port, python_bin):
        self.folder, self.nodes = str(folder), nodes
        self.conf = os.path.join(self.folder, "slurm.conf")
        # munged wants every folder above its socket open to all; pytest's temporary folders are private.
        self.munge_folder = tempfile.mkdtemp(prefix="munge-")
        os.chmod(self.munge_folder, 0o755)
        self.munge_socket = os.path.join(self.munge_folder, "munge.socket")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.python_bin = python_bin
        self.controller_port = controller_port
        self._daemons = []  # (name, Popen), in start order
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    # ------------------------------------------------------------ start and stop

    def _start(self):
        for sub in ("state", "spool", "munge", "logs"):
            os.makedirs(os.path.join(self.folder, sub), exist_ok=True)
        for node in self.nodes:
            os.makedirs(os.path.join(self.folder, "spool", node.name), exist_ok=True)
        # A key of this cluster's own, readable by its owner only (munged refuses any other).
        key = os.path.join(self.folder, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self._daemon("munged", ["munged", "--foreground", f"--key-file={key}", f"--socket={self.munge_socket}",
                                f"--pid-file={self.folder}/munge/munged.pid",
                                f"--seed-file={self.folder}/munge/munged.seed"])
        self._wait_until(lambda: os.path.exists(self.munge_socket), "munged's socket")

        nodes = "\n".join(f"NodeName={n.name} NodeAddr={n.address} Port={n.port} CPUs={NODE_CPUS} State=UNKNOWN"
                          for n in self.nodes)
        with open(self.conf, "w") as f:
            f.write(SLURM_CONF.format(controller=self.nodes[0].address, controller_port=self.controller_port,
                                      munge_socket=self.munge_socket, folder=self.folder, nodes=nodes,
                                      cred_expire=CRED_EXPIRE_SECONDS, scheduler_seconds=SCHEDULER_SECONDS))
        self._daemon("slurmctld", self.nodes[0].run_in + ["slurmctld", "-D", "-f", self.conf])
        for node in self.nodes:
            self._daemon(f"slurmd-{node.name}", node.run_in + ["slurmd", "-D", "-f", self.conf, "-N", node.name])
        self._wait_until(self._all_idle, "every node idle")

    def _daemon(self, name, command):
        env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}  # they are given -f
        with open(os.path.join(self.folder, "logs", name + ".log"), "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._daemons.append((name, proc))

    def _wait_until(self, ready, what):
        deadline = time.monotonic() + START_SECONDS
        while not ready():
            for name, proc in self._daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode} while waiting for {what}:\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {START_SECONDS} s:\n" +
                                   "\n".join(self.log(name) for name, _ in self._daemons))
            time.sleep(0.2)

    def _all_idle(self):
        out = self.client("scontrol", "show", "node", "-o", check=False).stdout
        states = re.findall(r"\bState=(\S+)", out)
        return len(states) == len(self.nodes) and all(s == "IDLE" for s in states)

    def log(self, name):
        path = os.path.join(self.folder, "logs", name + ".log")
        with open(path, errors="replace") as f:
            return f"--- {name}:\n" + f.read()[-3000:]

    def stop(self):
        """Cancels every job and waits for its processes, then stops the daemons by PID, last started first."""
        if any(name == "slurmctld" and proc.poll() is None for name, proc in self._daemons):
            self.client("scancel", "--full", "--signal=KILL", "--state=RUNNING", check=False)
            self.client("scancel", "--state=PENDING", check=False)
            deadline = time.monotonic() + STOP_SECONDS
            while self.client("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        for _, proc in reversed(self._daemons):
            if proc.poll() is None:
                proc.terminate()
        for _, proc in reversed(self._daemons):
            try:
                proc.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_SECONDS)
        self._daemons = []
        for pid in self._leftover_tasks():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.munge_folder, ignore_errors=True)

    def _leftover_tasks(self):
        """Processes started by this cluster's jobs that outlived them: a job's environment names our slurm.conf
        (sbatch passes on the submitter's), the daemons' does not."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if marker in f.read().split(b"\0"):
                            pids.append(int(entry))
                except OSError:
                    pass
        return pids

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------ clients

    def client(self, *command, check=True, **kwargs):
        """A Slurm client on the controller's host."""
        proc = subprocess.run(self.nodes[0].run_in + list(command), env=self.env, capture_output=True, text=True,
                              timeout=60, **kwargs)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}: {proc.stderr}")
        return proc

    def job_env(self, **extra):
        """What a job started with `sbatch` inherits (sbatch's --export=ALL): `python` is this interpreter, and
        CUDA_VISIBLE_DEVICES="" says the nodes have no GPUs without asking nvidia-smi."""
        env = {k: v for k, v in self.env.items() if k not in ("TF_CONFIG", "PYTHONPATH") and not k.startswith("SLURM_")}
        return {**env, "SLURM_CONF": self.conf, "PATH": self.python_bin + os.pathsep + env.get("PATH", ""),
                "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", **extra}

    def sbatch(self, script, *args, options=(), cwd, env):
        """Submits `script` with sbatch's `options` and the script's own `args`; the job's id."""
        proc = subprocess.run(self.nodes[0].run_in + ["sbatch", "--parsable", *options, script, *args],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
        if proc.returncode:
            raise RuntimeError(f"sbatch exited {proc.returncode}: {proc.stderr}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id):
        """`scontrol show job`'s fields, e.g. JobState, ExitCode, NodeList, StdOut."""
        out = self.client("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_for_state(self, job_id, states, timeout):
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["JobState"] in states:
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {job['JobState']} after {timeout} s")
            time.sleep(0.2)

    def wait_for_end(self, job_id, timeout):
        return self.wait_for_state(job_id, FINAL_STATES, timeout)

    def task_pids(self, job_id, node):
        """{global task id: PID} of the job's tasks on `node` (scontrol listpids asks that node's slurmd)."""
        out = self.client("scontrol", "listpids", str(job_id), node.name).stdout
        pids = {}
        for line in out.splitlines()[1:]:  # PID JOBID STEPID LOCALID GLOBALID
            pid, _, step, _, task = line.split()
            if step not in ("batch", "extern") and task != "-":
                pids[int(task)] = int(pid)
        return pids


def watch(cluster, job_id, since, timeout, fail_on=None):
    """Waits for the job's end, noting when srun reports each task's exit; returns (scontrol's fields, output,
    {task: (status, seconds from `since` until srun reported it)}). Fails at once if `fail_on` is printed."""
    deadline, seen = time.monotonic() + timeout, {}
    while True:
        job = cluster.job(job_id)
        output = read_output(job)
        if fail_on and fail_on in output:
            raise AssertionError(f"job {job_id} printed {fail_on!r}:\n{output[-3000:]}")
        now = time.monotonic()
        for task, status in task_exits(output).items():
            seen.setdefault(task, (status, round(now - since, 2)))
        if job["JobState"] in FINAL_STATES:
            return job, output, seen
        if now > deadline:
            raise AssertionError(f"job {job_id} still {job['JobState']} after {timeout} s:\n{output[-3000:]}")
        time.sleep(0.1)


def wait_for_text(cluster, job_id, text, timeout):
    """Waits until the job's output holds `text`; fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while True:
        job = cluster.job(job_id)
        output = read_output(job)
        if text in output:
            return
        if job["JobState"] in FINAL_STATES or time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} {job['JobState']} without {text!r}:\n{output[-3000:]}")
        time.sleep(0.1)


def read_output(job):
    """The job's output file: the batch script's, with every task's stdout and stderr and srun's own lines."""
    try:
        with open(job["StdOut"], errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def task_exits(output):
    """{task: exit status} from srun's lines in a job's output; a task killed by a signal is "Killed"."""
    exits = {task: int(code) for tasks, code in TASK_EXITED.findall(output) for task in _task_ids(tasks)}
    exits.update({task: "Killed" for tasks in TASK_KILLED.findall(output) for task in _task_ids(tasks)})
    return exits


def _task_ids(text):
    """srun's task list, e.g. "0-1" or "0,2-3", as numbers."""
    ids = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        ids += range(int(first), int(last or first) + 1)
    return ids
