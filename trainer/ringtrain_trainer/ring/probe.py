"""`ringtrain health`: ask a worker's gRPC Health service whether it serves (the exec form of
the worker Pod's readiness and liveness probes, for clusters before Kubernetes 1.24 that have
no gRPC probes; the gRPC form asks the same service).

Exit 0 when the answer is SERVING, 1 otherwise (no answer within the deadline: a frozen or
gone worker), so the kubelet restarts a worker that stopped answering.

Where the worker's port is mutual TLS (the job's material in ``RINGTRAIN_TLS_DIR``, which the
exec probe inherits from the container), the probe presents the job's certificate as well.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringtrain_trainer.ring import channels, tls

#: The ring port of a worker pod (ringtrain_operator.manifests.RING_PORT).
DEFAULT_ADDRESS = "127.0.0.1:2222"


def check(address: str, service: str = "", timeout_s: float = 2.0, material=None) -> str:
    """The serving status's name (``SERVING``, ``NOT_SERVING``, …) or the error's code name;
    ``material`` (``ring.tls.Material``) for a mutual-TLS port."""
    with channels.channel(address, material) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ringtrain health",
        description=" ".join((__doc__ or "").split("\n\n")[:2]).replace("\n", " "),
    )
    p.add_argument(
        "--address",
        default=DEFAULT_ADDRESS,
        help=f"the worker's ring port (default {DEFAULT_ADDRESS})",
    )
    p.add_argument(
        "--service",
        default="",
        help='"" (the process) or ringtrain.Ring (joined the ring and not broken)',
    )
    p.add_argument("--timeout-s", type=float, default=2.0)
    p.add_argument(
        "--tls-dir",
        default=os.environ.get("RINGTRAIN_TLS_DIR") or None,
        help="the job's ca.crt, tls.crt, tls.key (default $RINGTRAIN_TLS_DIR; neither: plaintext)",
    )
    a = p.parse_args(argv)
    material = None
    if a.tls_dir:
        material = tls.load(a.tls_dir)
    status = check(a.address, a.service, a.timeout_s, material)
    print(f"{a.address} {a.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
