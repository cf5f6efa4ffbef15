#!/usr/bin/env bash
# Install what is missing, then run the whole test suite (unit, component and mounted FUSE
# tests against a moto S3 server that the tests start themselves). Extra arguments go to
# pytest: bash scripts/test.sh tests/unit -k config
# install.sh skips pip when .venv is already up to date (its stamp), so only the first run,
# on a clean checkout as in CI, or a run after pyproject.toml changed, installs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Two test processes (pytest-xdist): most of a mounted test is waiting (on the daemon,
# the bucket, an upload delay), so two of them share two cores well. TIERFS_TEST_WORKERS
# sets another number; 0 runs everything in this one process.
workers=${TIERFS_TEST_WORKERS:-2}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers")
set +e
.venv/bin/python -m pytest -q "${parallel[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
