# The recsvc gRPC service, CPU image (deploy/README.md). Needs BuildKit (DOCKER_BUILDKIT=1 or buildx). Build from
# the repository root:
#   make image                              # the same build, plus: torch's wheel from this host, a local base
#   docker build -t recsvc:0.1.0-cpu .
# Where python:3.11-slim cannot be pulled, a Debian base made from Debian's packages (`make base-image`,
# deploy/docker/base-image.sh):
#   docker build --build-arg BASE_IMAGE=recsvc-base:bookworm -t recsvc:0.1.0-cpu .
# CUDA variant (torch's CUDA wheel, same image otherwise; not built or tested in this repository):
#   docker build --build-arg TORCH_VARIANT=cu128 -t recsvc:0.1.0-cuda .
# The model bundle is not in the image: mount it at /models/bundle (RECSVC_BUNDLE). Flags come from RECSVC_*
# variables (deploy/docker/entrypoint.sh) and from the container's arguments.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# torch is pinned as in the Makefile (torch==2.13.0, the CPU wheel); TORCH_VARIANT picks the wheel index:
# cpu, or a CUDA tag that torch 2.13.0 is published for (cu126, cu128, ...).
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# torch first, from its own index (PyPI's Linux wheel of torch pulls the CUDA libraries); then the project,
# whose torch==2.13.0 requirement the installed wheel already satisfies. A torch wheel of the wanted variant put
# in the build context's .whl/ (git-ignored; `make image` puts the host's there) is used instead of the index,
# its dependencies coming from PyPI; the wheel is bind-mounted, not copied, so it adds no layer.
# Behind a TLS-inspecting proxy, pip trusts the CA bundle given as the build secret `build-ca`
# (`--secret id=build-ca,src=/path/to/ca.pem`; `make image` passes BUILD_CA); it is not kept in the image.
RUN --mount=type=bind,source=.whl,target=/tmp/wheels \
    --mount=type=secret,id=build-ca \
    if [ -f /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
    && python3 -m venv /opt/venv \
    && if ls /tmp/wheels/torch-"${TORCH_VERSION}+${TORCH_VARIANT}"-*.whl >/dev/null 2>&1; then \
         pip install --find-links /tmp/wheels "torch==${TORCH_VERSION}+${TORCH_VARIANT}"; \
       else \
         pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
       fi
# The project's dependencies (from pyproject.toml alone, so a change of the code does not download them again),
# then the project itself.
WORKDIR /src
COPY pyproject.toml ./
RUN --mount=type=secret,id=build-ca \
    if [ -f /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
    && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
       > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY README.md ./
COPY recsvc_base ./recsvc_base
COPY recsvc ./recsvc
COPY tokenizer_rqvae ./tokenizer_rqvae
COPY training ./training
RUN --mount=type=secret,id=build-ca \
    if [ -f /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
    && pip install . --no-deps \
    && pip check \
    && python -c "import torch, recsvc.service.rpc.server; print('torch', torch.__version__)" \
    && rm -rf /src

COPY --chmod=0755 deploy/docker/entrypoint.sh /usr/local/bin/recsvc-entrypoint
COPY --chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/recsvc-healthcheck

# A non-root user with a fixed numeric id (Kubernetes' runAsNonRoot can only check a numeric USER).
RUN groupadd --system --gid 10001 recsvc \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/recsvc \
       --shell /usr/sbin/nologin recsvc
WORKDIR /home/recsvc
# Nothing is fetched at run time: the bundle holds the weights and the tokenizer.
ENV HOME=/home/recsvc \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    RECSVC_BUNDLE=/models/bundle \
    RECSVC_HOST=0.0.0.0 \
    RECSVC_GRPC_PORT=50051
USER 10001:10001

EXPOSE 50051
# The port listens at once with health NOT_SERVING; SERVING once the engine is loaded and calibrated (up to
# --startup-budget-s, 60 s by default, after loading), hence the long start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 CMD ["recsvc-healthcheck"]
ENTRYPOINT ["recsvc-entrypoint"]
