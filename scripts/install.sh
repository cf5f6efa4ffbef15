#!/usr/bin/env bash
# Install what tierfs needs on Debian/Ubuntu (as root; no sudo needed): FUSE 3, a compiler
# for pyfuse3, PostgreSQL's server (the tests of the PostgreSQL metadata engine start one),
# a virtual environment in .venv with tierfs and its test tools, and the links
# /usr/local/bin/tierfs and /usr/local/bin/mount.fuse.tierfs to its entry points.
#
# Runs again only what is missing: apt only when a tool is absent, pip only when the venv is
# missing or broken or when what decides its contents changed (a hash of pyproject.toml,
# this script and the Python version, kept in .venv/.tierfs-install-stamp).
# TIERFS_REINSTALL=1 reinstalls the venv's packages anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd -P)

if [ "$(id -u)" -ne 0 ]; then
  echo "scripts/install.sh: needs root (it installs system packages; tierfs mounts FUSE): become root (su -) and rerun, or use sudo bash $0 where sudo exists" >&2
  exit 1
fi

# One install at a time: parallel runs (test.sh, demo.sh) would both pip into .venv.
exec 9<"$repo/scripts/install.sh"
flock 9

need_apt=0
for bin in fusermount3 pkg-config gcc strace python3; do
  command -v "$bin" >/dev/null 2>&1 || need_apt=1
done
[ -f /usr/include/fuse3/fuse_lowlevel.h ] || need_apt=1
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need_apt=1
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || need_apt=1
id postgres >/dev/null 2>&1 || need_apt=1
if [ "$need_apt" = 1 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv attr strace \
    postgresql >/dev/null
fi

stamp=.venv/.tierfs-install-stamp
want=$( { cat pyproject.toml scripts/install.sh; python3 -VV; } | sha256sum | cut -d' ' -f1)

venv_ok() {  # the venv runs, imports everything, and its tierfs is this checkout's
  .venv/bin/python -I - "$repo" >/dev/null 2>&1 <<'PY' || return 1  # -I: not from the cwd
import os, sys
import boto3, fsspec, lmdb, moto, numpy, prometheus_client, psycopg, pyfuse3, pytest, trio, xdist, xxhash  # noqa: F401
import tierfs
sys.exit(os.path.dirname(os.path.realpath(tierfs.__file__)) != os.path.join(os.path.realpath(sys.argv[1]), "tierfs"))
PY
  [ -x .venv/bin/tierfs ] && [ -x .venv/bin/mount.fuse.tierfs ]
}

if [ "${TIERFS_REINSTALL:-0}" != 1 ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && venv_ok; then
  echo "tierfs is up to date in $repo/.venv ($(.venv/bin/tierfs --version); TIERFS_REINSTALL=1 reinstalls)"
else
  if ! .venv/bin/python -c '' >/dev/null 2>&1; then
    python3 -m venv --clear .venv  # missing, or made by an interpreter that is gone
  fi
  rm -f "$stamp"  # an install that fails halfway must not look complete next time
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e '.[test]'
  venv_ok || { echo "scripts/install.sh: the install in .venv is incomplete (import check failed): rerun with TIERFS_REINSTALL=1" >&2; exit 1; }
  echo "$want" >"$stamp"
  echo "tierfs installed in $repo/.venv ($(.venv/bin/tierfs --version))"
fi

# Byte-code for the package: an editable install leaves it to the first import, which
# writes none where PYTHONDONTWRITEBYTECODE is set (many images set it), and then every
# daemon, command and loader process compiles tierfs again as it starts. Files already
# compiled are skipped; a stale one is ignored by the interpreter.
.venv/bin/python -m compileall -q tierfs >/dev/null

# The commands on PATH for systemd units and mount(8). Only links are replaced: a real file
# there is someone else's install, left alone.
for cmd in tierfs mount.fuse.tierfs; do
  link=/usr/local/bin/$cmd
  if [ -e "$link" ] && [ ! -L "$link" ]; then
    echo "scripts/install.sh: $link exists and is not a link; left as it is (remove it to link $repo/.venv/bin/$cmd there)" >&2
  elif [ "$(readlink "$link" 2>/dev/null)" != "$repo/.venv/bin/$cmd" ]; then
    mkdir -p /usr/local/bin
    ln -sfn "$repo/.venv/bin/$cmd" "$link"
    echo "linked $link -> $repo/.venv/bin/$cmd"
  fi
done
