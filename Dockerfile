# cachewitness: the sidecar image. Two stages: the builder installs the package and its
# runtime dependencies (aiohttp, httptools, orjson, prometheus-client, uvloop: all ship manylinux
# wheels, so no compiler is needed) into a venv; the runtime stage copies only that venv.
#
#   docker build -t cachewitness:0.1.0 .
#   docker run --rm -p 8000:8000 -e CACHEWITNESS_UPSTREAM=http://engine:8200 cachewitness:0.1.0
#
# Every `serve` option comes from an env var CACHEWITNESS_<NAME> (or a flag after the image name).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/cachewitness
# pyproject.toml names README.md as the long description: setuptools needs it to build.
COPY pyproject.toml README.md ./
COPY proxy ./proxy
# Installs the project itself from the local tree; its dependencies are bounded in pyproject.toml.
RUN /opt/cachewitness/bin/pip install --no-cache-dir . \
    && /opt/cachewitness/bin/cachewitness --help >/dev/null

FROM ${PYTHON_IMAGE}
# A fixed numeric uid/gid, so Kubernetes' runAsNonRoot can check it and volumes can be
# shared through fsGroup.
RUN groupadd --system --gid 10001 cachewitness \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin cachewitness \
    && mkdir -p /var/lib/cachewitness/evidence \
    && chown -R 10001:10001 /var/lib/cachewitness
COPY --from=builder /opt/cachewitness /opt/cachewitness
ENV PATH=/opt/cachewitness/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CACHEWITNESS_LISTEN=0.0.0.0:8000 \
    CACHEWITNESS_EVIDENCE=/var/lib/cachewitness/evidence/cachewitness.jsonl
WORKDIR /var/lib/cachewitness
USER 10001:10001
EXPOSE 8000
# python:3.11-slim has no curl: probe /-/healthy with the stdlib. urlopen raises on a
# non-2xx answer or a refused connection, which exits non-zero.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('CACHEWITNESS_LISTEN', '0.0.0.0:8000').rpartition(':')[2]; urllib.request.urlopen('http://127.0.0.1:' + port + '/-/healthy', timeout=2)"]
ENTRYPOINT ["cachewitness", "serve"]
