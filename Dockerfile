# The specdec image: every pod of k8s/ runs from it (Ray head, router, autoscaler, draft and target
# workers), and `ray up` nodes can too (cluster/README.md). No model weights inside: pods prepare
# their models into a volume at start (`specdec models prepare`, SPECDEC_CACHE=/models), so one
# image serves every model. One Dockerfile, two variants by build args:
#
#   docker build -t specdec:0.1.0 .                       # CUDA: PyPI's torch wheel carries CUDA
#   docker build -t specdec:0.1.0-cpu \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .   # CPU-only, much smaller
#   docker build -t specdec:0.1.0-cu126 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .  # another CUDA build of torch
#
# BASE must be a Python 3.11 image with the interpreter at the same path in both stages (the venv
# is copied from one to the other); tests/unit/test_dockerfile.py checks the rules below.
ARG BASE=python:3.11-slim

# --------------------------------------------------------------------------- builder: the venv
FROM ${BASE} AS builder
# A second index for torch only when set (CPU or another CUDA build); pip prefers its local "+cpu" build.
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /build

# The dependencies first, in their own layer: pinned in pyproject.toml, they change rarely, and a
# code change must not reinstall torch and CUDA.
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
    && pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} -r requirements.txt

# Then the package itself, without touching the dependencies.
COPY . src/
# hadolint ignore=DL3013
RUN pip install --no-deps ./src

# The CPU loops (specdec/core/*.c) prebuilt for each x86-64 level into the venv: the runtime has no
# compiler, and loads the level its CPU runs (specdec/core/cpu_build.py). gcc in this stage only.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python -m specdec.core.cpu_build /opt/venv/share/specdec/kernels

# --------------------------------------------------------------------------- runtime
FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    SPECDEC_CACHE=/models \
    SPECDEC_PREBUILT_KERNELS=/opt/venv/share/specdec/kernels \
    HF_HUB_OFFLINE=1

# The venv stays root's: read-only to the runtime user (pack wheels go to the model cache,
# $SPECDEC_CACHE/.wheels: specdec/core/pack_prepare.py). KubeRay runs its commands in a login shell,
# which resets PATH from /etc/profile: profile.d puts the venv back ($PATH in single quotes on
# purpose: expanded at login).
# rsync and ssh: `ray up` with a `docker:` section (cluster/*-docker.yaml) copies files into the
# container with rsync and its autoscaler reaches the worker nodes over ssh from inside it. Debian's
# versions, not pinned: the base image's release fixes them.
# hadolint ignore=SC2016,DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends rsync openssh-client \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 --user-group specdec \
    && mkdir /models \
    && chown specdec:specdec /models \
    && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/specdec-venv.sh
COPY --from=builder /opt/venv /opt/venv
# The `ray up` node scripts, for cluster/*-docker.yaml (the router's supervisor, the node env).
COPY cluster/service.sh cluster/env.sh /opt/specdec/cluster/

USER 1000:1000
WORKDIR /home/specdec
# gRPC API, Prometheus metrics (router); Ray's ports are KubeRay's business.
EXPOSE 50051 9400
CMD ["specdec", "serve", "--help"]
