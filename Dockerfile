# kpx's image: `docker build -t kpx:0.1.0 .` (the tag deploy/kpx.yaml runs).
# Untested on an engine (none where kpx is developed); tests/test_deploy.py
# checks its structure. compose/Dockerfile is the lab's image, not this one.
ARG BASE=python:3.11-slim
FROM ${BASE}

# nft and ip program the return path, VIPs and nfqueue rules; nfqueue mode adds
# one iptables rule (Debian's iptables speaks nft). Nothing else from Debian.
RUN apt-get update \
 && apt-get install -y --no-install-recommends nftables iproute2 iptables \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proxy ./proxy
COPY healthz ./healthz
COPY lab ./lab
COPY bench ./bench
# setup.py compiles the relay core (proxy/userspace/_relaycore.c); the compiler
# leaves the image with the sources.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install --no-cache-dir . \
 && apt-get purge -y --auto-remove gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && cd / && rm -rf /src

WORKDIR /
ENTRYPOINT ["kpx"]
CMD ["node", "--help"]
