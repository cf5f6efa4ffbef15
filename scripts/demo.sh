#!/usr/bin/env bash
# End-to-end demo on the embedded default (a local directory as the bucket; no
# cloud account): install, mount, write a dataset and a checkpoint, upload,
# drop the hot copies, read everything back verified, remount, unmount.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$(pwd)/.venv/bin:$PATH"

demo=${TIERFS_DEMO_DIR:-/tmp/tierfs-demo}
mnt=$demo/mnt
if grep -q " $mnt fuse" /proc/mounts; then tierfs umount "$mnt" || fusermount3 -u -z "$mnt"; fi
rm -rf "$demo"
mkdir -p "$mnt"
step() { printf '\n== %s\n' "$*"; }

step "mount file://$demo/bucket on $mnt (hot tier and metadata in $demo/cache)"
tierfs mount "file://$demo/bucket" "$mnt" --cache-dir "$demo/cache" --upload-delay 1

step "write a small dataset (200 files of 64 KiB) and a 64 MiB checkpoint"
python3 - "$mnt" <<'PY'
import hashlib, os, sys
root = sys.argv[1]
os.makedirs(f"{root}/dataset", exist_ok=True)
for i in range(200):
    with open(f"{root}/dataset/sample-{i:04d}.bin", "wb") as f:
        f.write(hashlib.sha256(str(i).encode()).digest() * 2048)
os.makedirs(f"{root}/checkpoints", exist_ok=True)
with open(f"{root}/checkpoints/step-1000.pt", "wb") as f:
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
echo 3 > /proc/sys/vm/drop_caches
tierfs status "$mnt/checkpoints/step-1000.pt"

step "read everything back (fetched from the bucket, checksums verified)"
(cd "$mnt" && sha256sum -c --quiet "$demo/before.sha256") && echo "all $(wc -l < "$demo/before.sha256") files intact"

step "unmount, mount again, verify again"
tierfs umount "$mnt"
tierfs mount "file://$demo/bucket" "$mnt" --cache-dir "$demo/cache"
(cd "$mnt" && sha256sum -c --quiet "$demo/before.sha256") && echo "all files intact after remount"
tierfs umount "$mnt"
echo
echo "demo finished: bucket objects in $demo/bucket, daemon log in $demo/cache/tierfs.log"
