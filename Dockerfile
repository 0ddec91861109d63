# syntax=docker/dockerfile:1
# The modelserver image: the vllm-rbln base (RBLN SDK: rebel-compiler, vllm-rbln) with cachemgr as
# its entrypoint.
#
#   docker build --build-arg BASE_IMAGE=<your vllm-rbln image> -t modelserver-cachemgr .
#   docker build --build-arg FLAVOR=slim -t cachemgr-slim .    # no SDK: inspection and prune Jobs
#
# cachemgr is installed by scripts/install, the command CI runs (.ci/run -> scripts/test ->
# scripts/install .venv test): one install recipe, exercised on every CI run.

# The modelserver base, with rebel-compiler and vllm-rbln in its python3's site-packages
# (scripts/install stops with a clear message when they are not there). No usable default:
# the SDK version is the operator's choice, and it is part of every cache key.
ARG BASE_IMAGE=vllm-rbln:set-BASE_IMAGE
# The slim flavor's base: Python only. `cachemgr ls/du/show/verify/prune/locks` need no SDK.
ARG SLIM_BASE_IMAGE=python:3.11-slim-bookworm
# modelserver (default) or slim.
ARG FLAVOR=modelserver

# Each flavor names the extra the install step below takes; it stays in the image as a record.
FROM ${BASE_IMAGE} AS modelserver
ARG BASE_IMAGE
LABEL org.opencontainers.image.base.name="${BASE_IMAGE}"
ENV CACHEMGR_INSTALL_EXTRA=modelserver

FROM ${SLIM_BASE_IMAGE} AS slim
ARG SLIM_BASE_IMAGE
LABEL org.opencontainers.image.base.name="${SLIM_BASE_IMAGE}"
# remote: boto3, for push/pull/ls --remote/prune --remote Jobs.
ENV CACHEMGR_INSTALL_EXTRA=remote

FROM ${FLAVOR}
ARG FLAVOR
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="cachemgr (${FLAVOR})" \
      org.opencontainers.image.description="Compile cache manager for RBLN NPU modelserver pods: compile once per key, reuse everywhere" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${SOURCE}"

USER root
COPY . /usr/src/cachemgr
# The install CI runs, into its own venv. With the modelserver extra the venv also sees the base
# image's site-packages (the SDK); cachemgr's own dependencies stay in the venv, so they never
# change what vllm runs with.
RUN /usr/src/cachemgr/scripts/install /opt/cachemgr "$CACHEMGR_INSTALL_EXTRA"

# Appended, not prepended: python3, pip and vllm stay the base image's; only `cachemgr` is new.
ENV PATH="${PATH}:/opt/cachemgr/bin"
COPY entrypoint/ /usr/local/bin/

# A non-root user with a home (vLLM and Hugging Face write ~/.cache and ~/.config) and a writable
# pod-local state dir for the probes (an emptyDir in Kubernetes mounts over it). The compile cache
# mount point is deliberately NOT created: cachemgr refuses a missing cache root (exit 74), so a
# pod whose PVC is not mounted fails loudly instead of compiling into the container's disk.
RUN groupadd --gid 10001 cachemgr \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/cachemgr --shell /bin/sh cachemgr \
 && install -d -o 10001 -g 10001 -m 0755 /run/cachemgr
ENV HOME=/home/cachemgr \
    CACHEMGR_STATE_DIR=/run/cachemgr
USER 10001:10001
WORKDIR /home/cachemgr

# cachemgr becomes PID 1 (the script execs it): signals reach it, exit codes come back.
# No CMD: the server argv comes from the pod spec (args), and ENTRYPOINT clears the base's CMD.
ENTRYPOINT ["cachemgr-entrypoint"]
