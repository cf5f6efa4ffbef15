#!/usr/bin/env bash
# Install what tierfs needs on Debian/Ubuntu (as root): FUSE 3, a compiler for
# pyfuse3, and a virtual environment in .venv with tierfs and its test tools.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "scripts/install.sh: run as root (it installs system packages and mounts FUSE)" >&2
  exit 1
fi

need_apt=0
for bin in fusermount3 pkg-config gcc strace; do
  command -v "$bin" >/dev/null 2>&1 || need_apt=1
done
[ -f /usr/include/fuse3/fuse_lowlevel.h ] || need_apt=1
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need_apt=1
if [ "$need_apt" = 1 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv attr strace >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'
echo "tierfs installed in $(pwd)/.venv ($(.venv/bin/tierfs --version))"
