"""An MPI job's command line: the hostfile, mpirun with Open MPI's settings, each rank's program.

Pipeline position: :mod:`.mpi` puts these into the launcher pod and its ConfigMap; ``ringtrain
run`` (``ringtrain_localrun.plan``) runs the same command on one host. Ports and paths are fixed
here so :func:`.mpi.network_policy` can open exactly them.
"""

from __future__ import annotations

from . import manifests
from .job import Job, MPISpec

#: sshd's port in the workers: not 22, so it needs no privilege.
SSHD_PORT = 2022


#: Open MPI's TCP ports, pinned (MCA parameters in the launcher's environment, which mpirun
#: forwards to every rank) so that the NetworkPolicy can name them: ranks' byte transfer
#: (btl tcp) and the daemons' out-of-band channel (oob tcp).
BTL_PORT_MIN = 20000


OOB_PORT_MIN = 20100


PORT_RANGE = 100


OOB_MAX = OOB_PORT_MIN + PORT_RANGE - 1


MPI_CONFIG_DIR = "/etc/mpi"


HOSTFILE = f"{MPI_CONFIG_DIR}/hostfile"


KEY_FILE = "id_ed25519"


#: The launcher's main process with the built-in trainer (:mod:`.mpilaunch`).
LAUNCH = ("python3", "-m", "ringtrain_operator.mpilaunch")


#: The ranks' environment that mpirun forwards (sshd gives a session almost none).
EXPORTED_ENV = ("PATH", "HOME", "PYTHONUNBUFFERED")


def mpi_spec(job: Job) -> MPISpec:
    if job.mpi is None:
        raise ValueError(f"TrainingJob {job.name} has no spec.mpi")
    return job.mpi


def worker_host(job: Job, index: int) -> str:
    return f"{job.pod_name('worker', index)}.{job.service_name}.{job.namespace}.svc"


def workers(job: Job) -> int:
    w = job.replica("worker")
    return w.replicas if w else 0


def ranks(job: Job) -> int:
    return workers(job) * mpi_spec(job).slots_per_worker


def hostfile(job: Job, local: bool = False) -> str:
    """One line per worker pod; ``local`` (``ringtrain run``): this host with every slot, so
    mpirun starts the ranks itself, without ssh."""
    slots = mpi_spec(job).slots_per_worker
    if local:
        return f"localhost slots={ranks(job)}\n"
    return "".join(f"{worker_host(job, i)} slots={slots}\n" for i in range(workers(job)))


def rank_command(job: Job, local: bool = False) -> list[str]:
    """Each rank's program: spec.mpi.command, else the built-in trainer over Open MPI. Rank 0
    serves the trainer's metrics and ``/status`` on worker 0 (the operator reads progress
    there), with one rank per pod; locally, or with several slots, no rank does (one port)."""
    m = mpi_spec(job)
    if m.command is not None:
        return list(m.command)
    if job.trainer is None:
        return []
    args = manifests.trainer_args(job.trainer)
    if local or m.slots_per_worker > 1:
        i = args.index("--metrics-port")
        del args[i : i + 2]
    return ["ringtrain", "worker", "--collective", "mpi", *args]


def mpirun_command(job: Job, local: bool = False, program: list[str] | None = None) -> list[str]:
    """The launcher's command line running ``program`` (default :func:`rank_command`); []
    when the Launcher template brings its own. The hostfile and ssh settings come from the
    environment (:func:`launcher_env`), so a user's own ``mpirun`` gets them too."""
    program = rank_command(job, local) if program is None else program
    if not program:
        return []
    exported = [a for name in EXPORTED_ENV for a in ("-x", name)]
    return [
        "mpirun",
        "-np",
        str(ranks(job)),
        "--map-by",
        "slot",
        "--bind-to",
        "none",
        *exported,
        *program,
    ]


def launcher_env(job: Job, local: bool = False) -> list[dict]:
    """Open MPI's settings (MCA parameters as ``OMPI_MCA_*``, which mpirun also forwards to
    the ranks): the hostfile, ssh to sshd's port with the job's key, fixed TCP ports (not
    ``local``: one host's jobs must not share them)."""
    auth = mpi_spec(job).ssh_auth_mount_path.rstrip("/")
    rsh = (
        f"-p {SSHD_PORT} -i {auth}/{KEY_FILE} -o StrictHostKeyChecking=no "
        "-o UserKnownHostsFile=/dev/null -o ConnectionAttempts=10 -o LogLevel=ERROR"
    )
    values = {
        "OMPI_MCA_orte_default_hostfile": HOSTFILE,
        "OMPI_MCA_plm_rsh_args": rsh,
        "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
        "HOME": "/tmp",
        "PYTHONUNBUFFERED": "1",
    }
    if local:
        # one host's ranks share its cores: Open MPI's busy polling then starves them (measured:
        # 403 against 1,295 samples/s for the 300-step example on 2 busy cores)
        values["OMPI_MCA_mpi_yield_when_idle"] = "1"
    else:
        values |= {
            "OMPI_MCA_btl_tcp_port_min_v4": str(BTL_PORT_MIN),
            "OMPI_MCA_btl_tcp_port_range_v4": str(PORT_RANGE),
            "OMPI_MCA_oob_tcp_dynamic_ipv4_ports": f"{OOB_PORT_MIN}-{OOB_MAX}",
        }
    return [{"name": k, "value": v} for k, v in values.items()]
