# syntax=docker/dockerfile:1
# The recsvc gRPC service, CPU image (deploy/README.md). Build from the repository root:
#   docker build -t recsvc:0.1.0-cpu .
# CUDA variant (torch's CUDA wheel, same image otherwise; not built or tested in this repository):
#   docker build --build-arg TORCH_VARIANT=cu128 -t recsvc:0.1.0-cuda .
# The model bundle is not in the image: mount it at /models/bundle (RECSVC_BUNDLE). Flags come from RECSVC_*
# variables (deploy/docker/entrypoint.sh) and from the container's arguments.
FROM python:3.11-slim

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
# whose torch==2.13.0 requirement the installed wheel already satisfies.
RUN python -m venv /opt/venv \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY recsvc ./recsvc
COPY tokenizer_rqvae ./tokenizer_rqvae
COPY training ./training
RUN pip install . \
    && pip check \
    && python -c "import torch, recsvc.service.server; print('torch', torch.__version__)" \
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
