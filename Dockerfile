# Two images from one file:
#
# Test image (the default, last stage): tierfs with its test dependencies; runs the whole
# pytest suite inside the container (real FUSE mounts, a moto S3 server that the tests
# start on 127.0.0.1, and a PostgreSQL server they start on a Unix socket).
#
#   docker build -t tierfs-test .
#   docker run --rm --device /dev/fuse --cap-add SYS_ADMIN tierfs-test
#
# Runtime image (target `runtime`): just tierfs in /opt/venv, fuse3 and Python; no compilers,
# no test tools. deploy/daemonset.yaml runs it.
#
#   docker build --target runtime -t tierfs:0.1.0 .
#   docker run --rm tierfs:0.1.0 tierfs --version
#
# Flags of `docker run` for the tests, and why:
#   --device /dev/fuse --cap-add SYS_ADMIN   FUSE mounts (the tests run as root).
#   (The tests drop cached pages per file with fadvise, so /proc/sys may stay read-only.)
#   --security-opt apparmor:unconfined       needed only where the engine uses AppArmor
#       (Ubuntu, Debian with AppArmor on): Docker's docker-default profile has `deny mount`,
#       so every FUSE mount would fail. Not needed on hosts without AppArmor.
#   Optional: -v /tmp puts the tests' temporary directories (the hot tiers) on a volume, a
#       real disk filesystem, instead of the container's overlay root.
#   Extra pytest arguments: `docker run ... tierfs-test python -m pytest -q -k tiering`.
#
# scripts/docker-test.sh does all of this from scratch (starting a Docker engine, building a
# local Debian base when Docker Hub is unreachable, trusting a proxy's CA certificates).
#
# BASE_IMAGE: python:3.11-slim by default; any Debian bookworm image works, also one without
# Python (then Debian's python3 3.11 is installed from the image's own apt sources).
ARG BASE_IMAGE=python:3.11-slim

# ---- build: compilers and headers; tierfs and its dependencies into /opt/venv ------------
FROM ${BASE_IMAGE} AS build

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# Extra CA certificates (a TLS-intercepting proxy's, for pip): scripts/docker-test.sh puts the
# host's /usr/local/share/ca-certificates/*.crt into its build context as docker-ca-*.crt; a
# plain build has none. pyproject.toml is listed only so this COPY always has a source. They
# stay in the build and test stages; the runtime image does not inherit them.
COPY pyproject.toml docker-ca-*.crt /tmp/docker-ca/

# System packages: FUSE 3 (fusermount3), headers and a compiler for pyfuse3, getfattr; and
# Debian's Python 3 with venv and headers where the base image lacks them (a bare Debian base;
# python:3.11-slim has all three in /usr/local).
RUN set -eux; \
    mkdir -p /usr/local/share/ca-certificates; \
    for c in /tmp/docker-ca/*.crt; do \
      if [ -e "$c" ]; then cp "$c" /usr/local/share/ca-certificates/; fi; \
    done; \
    rm -rf /tmp/docker-ca; \
    if command -v update-ca-certificates >/dev/null 2>&1; then update-ca-certificates; fi; \
    pkgs="ca-certificates fuse3 libfuse3-dev pkg-config gcc libc6-dev attr strace"; \
    if ! command -v python3 >/dev/null 2>&1; then \
      pkgs="$pkgs python3 python3-venv python3-dev"; \
    else \
      python3 -c 'import ensurepip, venv' 2>/dev/null || pkgs="$pkgs python3-venv"; \
      python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("include"), "Python.h")))' \
        || pkgs="$pkgs python3-dev"; \
    fi; \
    apt-get update -qq; \
    apt-get install -y -qq --no-install-recommends $pkgs; \
    rm -rf /var/lib/apt/lists/*; \
    update-ca-certificates

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt

WORKDIR /src
COPY pyproject.toml README.md ./
COPY tierfs ./tierfs
# A regular (not editable) install: the runtime stage copies /opt/venv without /src.
# With the postgres extra: the runtime image also mounts a namespace shared by many nodes.
RUN pip install -q '.[postgres]' && python -c 'import pyfuse3, psycopg, tierfs; print("pyfuse3", pyfuse3.__version__)'

# ---- runtime: tierfs, fuse3 and Python only ----------------------------------------------
FROM ${BASE_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# fuse3: fusermount3 and libfuse3 (pyfuse3 links it); Debian's python3 on a bare base, the
# same interpreter the build stage made /opt/venv with.
RUN set -eux; \
    pkgs="ca-certificates fuse3"; \
    command -v python3 >/dev/null 2>&1 || pkgs="$pkgs python3"; \
    apt-get update -qq; \
    apt-get install -y -qq --no-install-recommends $pkgs; \
    rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin
RUN tierfs --version
CMD ["tierfs", "--help"]

# ---- test (default): the build stage plus the test tools, the tests and an editable tierfs --
FROM build AS test
WORKDIR /src
# PostgreSQL's server for the metadata engine tests (they start it as the postgres user).
RUN set -eux; apt-get update -qq; apt-get install -y -qq --no-install-recommends postgresql; \
    rm -rf /var/lib/apt/lists/*
RUN pip install -q -e '.[test]' && python -m compileall -q tierfs >/dev/null && python -c 'import moto, psycopg, pytest, tierfs; print("tierfs", tierfs.__version__)'
COPY tests ./tests
COPY scripts ./scripts
COPY docs ./docs

# The whole suite; "no tests collected" (pytest exit status 5) counts as a failure.
CMD ["sh", "-c", "python -m pytest -q \"$@\"; rc=$?; if [ \"$rc\" -eq 5 ]; then echo 'pytest collected no tests: failure' >&2; exit 1; fi; exit \"$rc\"", "pytest"]
