# The image that examples/k8s/ names: this repository's wheel (docs/operations.md, "Install") on a slim
# Python, run as uid 1000 with the `memcache` command as its entrypoint.
#
#   docker build -t memcache-python:0.1.0 .                             # MetaService and providers
#   docker build --target vllm -t memcache-python-vllm:0.1.0 .          # vLLM with the connector
#
# The first stage builds the sdist and the wheel where a C compiler is (the native copy loop); the pool
# image installs only that wheel: no compiler, no source tree, no pip cache. vLLM's image runs another
# Python than the wheel's (a wheel with the loop is tagged for one), so it installs the sdist, which
# builds the loop where that image has a compiler and falls back to the Python loop where not. Not
# built in this project's CI (no container runtime there): hadolint and tests/unit/test_deploy_files.py
# check this file.
#
# Every Python package is pinned by constraints.txt (the versions the tests ran with), the build's own
# setuptools included (PIP_CONSTRAINT reaches pip inside `python -m build`'s isolated environment).
# The base images are pinned by tag: for a reproducible build pin them by digest as well, e.g.
#   FROM python:3.11-slim-bookworm@sha256:<digest>
# with the digest your registry serves (docker buildx imagetools inspect python:3.11-slim-bookworm);
# this repository names none, having no registry to read one from and verify it against.

FROM python:3.11-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md constraints.txt ./
COPY memcache_core ./memcache_core
COPY integrations ./integrations
ENV PIP_CONSTRAINT=/src/constraints.txt
RUN pip install --no-cache-dir build==1.2.2 \
    && python -m build --outdir /dist . \
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
FROM python:3.11-slim-bookworm AS pool
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install --no-cache-dir -c /tmp/dist/constraints.txt "$(ls /tmp/dist/memcache_python-0.1.0-*.whl)[cli,ha,events]" \
    && rm -rf /tmp/dist \
    && useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin memcache
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
EXPOSE 5000 5557 5558 6000 7000 8000 9000
ENTRYPOINT ["memcache"]
CMD ["--help"]
