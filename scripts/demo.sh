#!/usr/bin/env bash
# End-to-end demo on the embedded default (a local directory as the bucket; no
# cloud account): install, mount, write a dataset and a checkpoint, upload,
# drop the hot copies, read everything back verified, remount, unmount.
#
# Runs as root (bash scripts/demo.sh; sudo bash scripts/demo.sh where sudo exists).
# Works in a fresh directory from mktemp -d, so parallel runs do not meet, or in
# $TIERFS_DEMO_DIR when set (it must be empty or not exist yet). On every exit,
# also after a failure, it unmounts and removes what it created there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$(pwd)/.venv/bin:$PATH"

if [ -n "${TIERFS_DEMO_DIR:-}" ]; then
  demo=$TIERFS_DEMO_DIR
  if [ -e "$demo" ] && [ -n "$(ls -A "$demo" 2>/dev/null)" ]; then
    echo "demo.sh: TIERFS_DEMO_DIR=$demo is not empty: empty it, or name a new directory" >&2
    exit 1
  fi
  [ -d "$demo" ] && made_dir=0 || made_dir=1
  mkdir -p "$demo"
else
  demo=$(mktemp -d "${TMPDIR:-/tmp}/tierfs-demo.XXXXXX")
  made_dir=1
fi
demo=$(cd "$demo" && pwd -P)
mnt=$demo/mnt

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if grep -q " $mnt fuse" /proc/mounts; then
    # a bounded flush first; a lazy unmount if the daemon does not answer
    timeout 120 tierfs umount "$mnt" >/dev/null 2>&1 || fusermount3 -u -z "$mnt" 2>/dev/null || true
  fi
  if [ "$rc" -ne 0 ] && [ -f "$demo/cache/tierfs.log" ]; then
    echo "demo.sh: failed (exit $rc); the daemon log ended with:" >&2
    tail -n 20 "$demo/cache/tierfs.log" >&2
  fi
  if grep -q " $mnt fuse" /proc/mounts; then  # never delete through a live mount
    echo "demo.sh: $mnt is still mounted; left $demo in place (fusermount3 -u -z $mnt, then rm -rf $demo)" >&2
  elif [ "$made_dir" = 1 ]; then
    rm -rf "$demo"
  else
    rm -rf "$mnt" "$demo/bucket" "$demo/cache" "$demo/before.sha256"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p "$mnt"
step() { printf '\n== %s\n' "$*"; }

step "mount file://$demo/bucket on $mnt (hot tier and metadata in $demo/cache)"
tierfs mount "file://$demo/bucket" "$mnt" --cache-dir "$demo/cache" --upload-delay 1

step "write a small dataset (200 files of 64 KiB), and a 64 MiB checkpoint with tierfs.open (straight into the hot tier)"
python3 - "$mnt" <<'PY'
import hashlib, os, sys
import tierfs
root = sys.argv[1]
os.makedirs(f"{root}/dataset", exist_ok=True)
for i in range(200):
    with open(f"{root}/dataset/sample-{i:04d}.bin", "wb") as f:
        f.write(hashlib.sha256(str(i).encode()).digest() * 2048)
os.makedirs(f"{root}/checkpoints", exist_ok=True)
with tierfs.open(f"{root}/checkpoints/step-1000.pt", "wb") as f:
    for i in range(64):
        f.write(hashlib.sha512(str(i).encode()).digest() * 16384)
    f.flush()
    os.fsync(f.fileno())
PY
ls -la "$mnt" "$mnt/checkpoints"
(cd "$mnt" && find . -type f -exec sha256sum {} + | sort -k2) > "$demo/before.sha256"

step "upload everything to the bucket and wait (the checkpoint durability signal)"
tierfs sync "$mnt" --wait
tierfs status "$mnt"

step "drop the hot copies: the data now lives only in the bucket"
tierfs release -r "$mnt"
# so that the reads below reach the daemon instead of the kernel's page cache
{ echo 3 > /proc/sys/vm/drop_caches; } 2>/dev/null || echo "(cannot drop the page cache here: some reads may be served from it)"
tierfs status "$mnt/checkpoints/step-1000.pt"

step "read everything back (fetched from the bucket, checksums verified)"
(cd "$mnt" && sha256sum -c --quiet "$demo/before.sha256") && echo "all $(wc -l < "$demo/before.sha256") files intact"

step "unmount, mount again, verify again"
tierfs umount "$mnt"
tierfs mount "file://$demo/bucket" "$mnt" --cache-dir "$demo/cache"
(cd "$mnt" && sha256sum -c --quiet "$demo/before.sha256") && echo "all files intact after remount"
tierfs umount "$mnt"
echo
echo "demo finished: the bucket held $(find "$demo/bucket" -type f | wc -l) objects ($(du -sh "$demo/bucket" | cut -f1)); cleaning up $demo"
