# The image that examples/k8s/ names: this repository's wheel (docs/operations.md, "Install") on Debian
# bookworm's own Python 3.11, in a virtual environment (/opt/memcache, its bin first on PATH), run as
# uid 1000 (home /home/memcache) with the `memcache` command as its entrypoint.
#
#   docker build -t memcache-python:0.1.0 .                             # MetaService and providers
#   docker build --target vllm -t memcache-python-vllm:0.1.0 .          # vLLM with the connector
#
# The first stages build the sdist and the wheel where a C compiler is (the native copy loop); the pool
# image installs only that wheel: no compiler, no source tree, no pip cache. vLLM's image runs another
# Python than the wheel's (a wheel with the loop is tagged for one), so it installs the sdist, which
# builds the loop where that image has a compiler and falls back to the Python loop where not.
#
# The pool's stages stand on ARG BASE, any Debian bookworm (debian:bookworm-slim by default), and take
# everything else from Debian's packages and PyPI. So CI, which reaches no image registry, builds this
# very file: .ci/image.sh makes a bookworm with mmdebstrap, builds with buildah (no daemon) and runs the
# demo and a MetaService publishing KV events in the image (docs/operations.md, "Kubernetes");
# hadolint and tests/unit/test_deploy_files.py check it too.
#
# Every Python package is pinned by constraints.txt (the versions the tests ran with), the build's own
# setuptools included (PIP_CONSTRAINT reaches pip inside `python -m build`'s isolated environment);
# pip is the one Debian's python3-venv puts in a new environment. Debian's packages are not pinned
# (hadolint's DL3008): a stable release takes security fixes only, and a pinned version leaves the
# mirror at the next point release. The base is named by tag: for a reproducible build pin it by
# digest as well,
#   docker build --build-arg BASE=debian:bookworm-slim@sha256:<digest> ...
# with the digest your registry serves (docker buildx imagetools inspect debian:bookworm-slim); this
# repository names none, having no registry to read one from and verify it against.

ARG BASE=debian:bookworm-slim

# Debian's Python 3.11 and venv, and the CA certificates pip checks PyPI with: the base of both stages
# that run this Python.
FROM ${BASE} AS python
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM python AS wheel
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md constraints.txt ./
COPY memcache_core ./memcache_core
COPY integrations ./integrations
ENV PIP_CONSTRAINT=/src/constraints.txt
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip install --no-cache-dir build==1.2.2 \
    && /opt/build/bin/python -m build --outdir /dist . \
    && cp constraints.txt /dist/

# vLLM's own image with the wheel and its vllm connector; pick the vLLM 0.32 tag you run.
FROM vllm/vllm-openai:v0.32.0 AS vllm
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install --no-cache-dir --no-deps /tmp/dist/memcache_python-0.1.0.tar.gz \
    && pip install --no-cache-dir -c /tmp/dist/constraints.txt "msgspec>=0.18" "xxhash>=3.4" \
    && rm -rf /tmp/dist \
    && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin memcache
ENV PYTHONUNBUFFERED=1
USER 1000:1000

# The pool's image (the default target): MetaService (with pyzmq for KV events), providers, the memcache command.
FROM python AS pool
COPY --from=wheel /dist/ /tmp/dist/
RUN python3 -m venv /opt/memcache \
    && /opt/memcache/bin/pip install --no-cache-dir -c /tmp/dist/constraints.txt "$(ls /tmp/dist/memcache_python-0.1.0-*.whl)[cli,ha,events]" \
    && rm -rf /tmp/dist \
    && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin memcache
ENV PATH=/opt/memcache/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
EXPOSE 5000 5557 5558 6000 7000 8000 9000
ENTRYPOINT ["memcache"]
CMD ["--help"]
