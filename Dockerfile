# Multi-stage build: a wheel in the builder, a slim non-root runtime.
FROM python:3.11-slim-bookworm AS builder
# kvd._native (native/) is C against liburing.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev liburing-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY kvd ./kvd
COPY native ./native
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends liburing2 \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 1000 --create-home kvd
COPY --from=builder /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER kvd
WORKDIR /home/kvd
EXPOSE 50051 9464
ENTRYPOINT ["kvd"]
CMD ["serve", "--state-dir", "/var/run/kvd", "--tcp-address", "0.0.0.0:50051", "--metrics-address", "0.0.0.0:9464"]
