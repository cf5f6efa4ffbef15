#!/usr/bin/env bash
# Install what is missing, then run the whole test suite (unit, component and mounted FUSE
# tests against a moto S3 server that the tests start themselves). Extra arguments go to
# pytest: bash scripts/test.sh tests/unit -k config
# install.sh skips pip when .venv is already up to date (its stamp), so only the first run,
# on a clean checkout as in CI, or a run after pyproject.toml changed, installs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
