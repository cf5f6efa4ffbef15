#!/usr/bin/env bash
# Install everything needed, then run the whole test suite (unit, component and
# mounted FUSE tests against a moto S3 server that the tests start themselves).
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
