# Test image: tierfs with its test dependencies; runs the whole pytest suite
# (FUSE mounts and a moto S3 server inside the container).
#   docker build -t tierfs-test .
#   docker run --rm --device /dev/fuse --cap-add SYS_ADMIN tierfs-test
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      fuse3 libfuse3-dev pkg-config gcc python3-dev attr \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY tierfs ./tierfs
RUN pip install --no-cache-dir -e '.[test]'
COPY tests ./tests
COPY scripts ./scripts

CMD ["python", "-m", "pytest", "-q"]
