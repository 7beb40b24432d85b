# Multi-stage build: a wheel in the builder, a slim non-root runtime.
FROM python:3.11-slim-bookworm AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvd ./kvd
COPY native ./native
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
RUN useradd --uid 1000 --create-home kvd
COPY --from=builder /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER kvd
WORKDIR /home/kvd
EXPOSE 50051 9464
ENTRYPOINT ["kvd"]
CMD ["serve", "--state-dir", "/var/run/kvd", "--tcp-address", "0.0.0.0:50051", "--metrics-address", "0.0.0.0:9464"]
