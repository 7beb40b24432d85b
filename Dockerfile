# Multi-stage build: a wheel in the builder, a slim non-root runtime.
# Docker does not run on the build machines: tests/deploy/test_wheel_install.py
# builds the wheel from the paths COPYed below, checks that the runtime
# packages are the ones kvd._native links against, installs it into a fresh
# venv and runs `kvd config` and the native engine's tests from it.
FROM python:3.11-slim-bookworm AS builder
# kvd._native (native/) is C against liburing and Intel ISA-L (crc32c).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev liburing-dev libisal-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY kvd ./kvd
COPY native ./native
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
# The shared libraries of kvd._native (libc6 comes with the base image).
RUN apt-get update && apt-get install -y --no-install-recommends liburing2 libisal2 \
    && rm -rf /var/lib/apt/lists/*
# uid 1000: the sockets (kvd.sock and the arena socket kvd.sock.arena) are
# 0600, so engines run as the same uid or share server.unix_socket_group.
RUN useradd --uid 1000 --create-home kvd && install -d -o kvd -g kvd -m 0750 /var/run/kvd
COPY --from=builder /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER kvd
WORKDIR /home/kvd
EXPOSE 50051 9464
# The arena is memfd files, not /dev/shm: no --shm-size or --ipc=host. Engines
# in other containers mount the same host directory as /var/run/kvd and get
# the arena over the arena socket; a --memory limit must cover
# host.capacity_bytes (1 GiB by default), which kvd touches at start. The default
# seccomp profiles of Docker 25+ and containerd 2.0+ block io_uring: kvd uses its
# thread-pool I/O engine for the disk tier (see docs/operations.md).
ENTRYPOINT ["kvd"]
CMD ["serve", "--state-dir", "/var/run/kvd", "--tcp-address", "0.0.0.0:50051", "--metrics-address", "0.0.0.0:9464"]
