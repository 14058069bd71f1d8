# The specdec image: every pod of k8s/ runs from it (Ray head, router, autoscaler, draft and target
# workers). No model weights inside: pods prepare the packs into a volume at start
# (`specdec models prepare`, SPECDEC_CACHE=/models), so one image serves every model.
#
#   docker build -t specdec:0.1.0 .                       # GPU: PyPI's torch wheel carries CUDA
#   docker build -t specdec:0.1.0-cpu \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .   # CPU-only, much smaller
FROM python:3.11-slim

# A second index for torch only when set (the CPU wheels); pip prefers its local "+cpu" build.
ARG TORCH_INDEX_URL=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    SPECDEC_CACHE=/models \
    HF_HUB_OFFLINE=1

# The venv belongs to the runtime user: `specdec models prepare` pip-installs the pack wheels into
# it at pod start. KubeRay runs its commands in a login shell, which resets PATH from /etc/profile:
# profile.d puts the venv back ($PATH in single quotes on purpose: expanded at login).
# hadolint ignore=SC2016
RUN useradd --create-home --uid 1000 --user-group specdec \
    && python -m venv /opt/venv \
    && mkdir /models \
    && chown -R specdec:specdec /opt/venv /models \
    && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/specdec-venv.sh

USER 1000:1000
WORKDIR /home/specdec
COPY --chown=1000:1000 . src/
# The package itself: its dependencies are pinned in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} ./src \
    && rm -rf src

# gRPC API, Prometheus metrics (router); Ray's ports are KubeRay's business.
EXPOSE 50051 9400
CMD ["specdec", "serve", "--help"]
