# One image for both daemons of the Hyperlight device plugin:
#   hlplugin serve       the hyperlight.dev/hypervisor device plugin
#   hlplugin bootstrap   the hyperlight.dev/device-access device plugin
# Build from the repository root:  docker build -t hlplugin .
#
# The base is python:3.12-slim-bookworm pinned by digest, so a rebuild gets
# the same bytes. To move it (Dependabot proposes this too), resolve the tag's
# current digest and replace it here (the only place it is written):
#   docker buildx imagetools inspect python:3.12-slim-bookworm --format '{{json .Manifest.Digest}}'
# BASE_IMAGE replaces it only where no registry is reachable: deploy/local-node.sh
# builds on a Debian bookworm stand-in with Python 3.11 and its venv module.
# checkov:skip=CKV_DOCKER_7:FROM names an ARG whose default is pinned by digest; checkov cannot resolve it
ARG BASE_IMAGE=python:3.12-slim-bookworm@sha256:782412e85d0f0984994c290652577d4018aff08145c85b262bb63dc0c7522254
FROM ${BASE_IMAGE} AS base

# Build stage: installs the package and its wheels into a virtual environment.
FROM base AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src/ src/
# Byte-compile everything now: the root filesystem is read-only at run time.
# Everything stays readable by any UID (the daemons run as 0, workloads as 65534).
RUN python -m venv /opt/hlplugin \
    && /opt/hlplugin/bin/pip install --no-cache-dir --no-compile . \
    && /opt/hlplugin/bin/python -m compileall -q /opt/hlplugin \
    && chmod -R a+rX,go-w /opt/hlplugin

# Final stage: the same slim base (no compilers) plus the virtual environment.
FROM base
# The package version (src/hlplugin/__init__.py); tests/test_packaging.py keeps them equal.
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="hlplugin" \
      org.opencontainers.image.description="Kubernetes device plugin for Hyperlight (KVM/MSHV)" \
      org.opencontainers.image.version="${VERSION}"
ENV PATH=/opt/hlplugin/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/hlplugin /opt/hlplugin
# Kubernetes liveness and readiness probes (GET /healthz, /readyz on 8080 and
# 8081) replace a Docker HEALTHCHECK, which the kubelet ignores.
HEALTHCHECK NONE
# Non-root by default. The DaemonSets set runAsUser 0 with every capability
# dropped, only because the kubelet's socket directory is root-owned.
USER 65534:65534
ENTRYPOINT ["hlplugin"]
CMD ["serve"]
