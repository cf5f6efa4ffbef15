#!/usr/bin/env bash
# Build the test image (Dockerfile) and run the whole pytest suite inside it, FUSE mounts
# included. Extra arguments go to pytest:  bash scripts/docker-test.sh -k tiering
#
# From scratch, as root where it has to start or install things:
#   - uses the running Docker engine; when `docker info` fails, installs docker.io if needed
#     (apt) and starts its own dockerd (no iptables, no bridge), stopped again at exit;
#   - uses python:3.11-slim as the base (present or pulled); when it cannot be pulled (no
#     registry reachable), uses or builds tierfs-base:bookworm, a Debian bookworm image made
#     with debootstrap from this machine's own Debian mirror (TIERFS_DEBIAN_MIRROR overrides);
#     BASE_IMAGE=... chooses a base outright;
#   - builds from a temporary copy of the working tree (git's tracked and untracked, not
#     ignored, files) plus this machine's /usr/local/share/ca-certificates/*.crt, so that pip
#     trusts a TLS-intercepting proxy; proxy variables are passed on as build arguments;
#   - runs the suite with --device /dev/fuse --cap-add SYS_ADMIN, plus
#     --security-opt apparmor=unconfined when the engine uses AppArmor (it denies mount(2)),
#     and --network=none (the tests only talk to their own moto server on 127.0.0.1);
#     TIERFS_DOCKER_RUN_ARGS adds options (e.g. "-v /tmp": test directories on a volume).
# Exits with pytest's status ("no tests collected" is a failure); removes the container, the
# dockerd it started (and unmounts what that dockerd mounted, such as /run/docker/netns/default)
# and its temporary files on every exit.
# Packages it installed (docker.io, debootstrap) stay installed, so that the next run is quick;
# its last line names them and the command that removes them. The images it built stay in
# Docker's store (docker rmi tierfs-test tierfs-base:bookworm).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

IMAGE=${TIERFS_TEST_IMAGE:-tierfs-test}
DEFAULT_BASE=python:3.11-slim
LOCAL_BASE=tierfs-base:bookworm
PYTEST_CMD='python -m pytest -q "$@"; rc=$?; if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failure" >&2; exit 1; fi; exit "$rc"'

say() { echo "docker-test: $*" >&2; }
die() { say "$*"; exit 1; }

start_time=$(date +%s)
work=$(mktemp -d "${TMPDIR:-/tmp}/tierfs-docker-test.XXXXXX")
dockerd_pid=""
container=""
installed_list=$work/installed-packages  # what apt_install added (a file: it may run in $(...))
mounts_before=""    # /proc/mounts before our dockerd started: what it added is ours to undo

unmount_under() {  # lazily unmount anything left mounted below $1 (debootstrap's /proc etc.)
  local m
  for m in $(awk -v p="$1/" 'index($2, p) == 1 {print $2}' /proc/mounts | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
}

unmount_dockerd_leftovers() {  # mounts our dockerd made and left behind (netns, overlays)
  local m
  for m in $(awk '{print $2}' /proc/mounts | sort -r); do
    case "$m" in /run/docker|/run/docker/*|/run/containerd|/run/containerd/*|/var/lib/docker|/var/lib/docker/*|/var/lib/containerd|/var/lib/containerd/*) ;;
      *) continue ;;
    esac
    grep -qxF "$m" <<<"$mounts_before" && continue
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || say "could not unmount $m"
  done
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$container" ] && docker inspect "$container" >/dev/null 2>&1; then
    docker rm -f "$container" >/dev/null 2>&1 || true
  fi
  if [ -n "$dockerd_pid" ]; then
    say "stopping the dockerd this script started (pid $dockerd_pid)"
    kill -TERM "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 1 60); do
      kill -0 "$dockerd_pid" 2>/dev/null || break
      sleep 1
    done
    if kill -0 "$dockerd_pid" 2>/dev/null; then
      say "dockerd did not stop in 60 s; killing it"
      kill -KILL "$dockerd_pid" 2>/dev/null || true
    fi
    wait "$dockerd_pid" 2>/dev/null || true
    unmount_dockerd_leftovers
  fi
  local pkgs=""
  [ -f "$installed_list" ] && pkgs=$(paste -sd' ' "$installed_list")
  unmount_under "$work"
  rm -rf "$work"
  say "total time $(( $(date +%s) - start_time ))s"
  if [ -n "$pkgs" ]; then
    say "installed $pkgs (apt) and left them installed; remove them with: apt-get purge $pkgs && apt-get autoremove --purge"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

is_root() { [ "$(id -u)" -eq 0 ]; }

apt_install() {
  is_root || die "need root to install $* (apt-get)"
  command -v apt-get >/dev/null 2>&1 || die "cannot install $*: no apt-get here"
  say "installing $* (apt-get)"
  local p new=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || new+=("$p")
  done
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  [ "${#new[@]}" -eq 0 ] || printf '%s\n' "${new[@]}" >>"$installed_list"
}

# ---- a Docker engine ----------------------------------------------------------------------
ensure_docker() {
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    return
  fi
  if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
    apt_install docker.io
    # on a machine with an init system, the package may have started the engine itself
    docker info >/dev/null 2>&1 && return
  fi
  is_root || die "no Docker engine answers (docker info: $(docker info 2>&1 | tail -n 1)); run as root to start one"
  local log="$work/dockerd.log"
  say "no Docker engine answers; starting dockerd (log: $log while it runs)"
  mounts_before=$(awk '{print $2}' /proc/mounts)
  dockerd --iptables=false --ip-masq=false --bridge=none >"$log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 1 120); do
    if docker info >/dev/null 2>&1; then
      return
    fi
    if ! kill -0 "$dockerd_pid" 2>/dev/null; then
      tail -n 30 "$log" >&2 || true
      dockerd_pid=""
      die "dockerd exited at start"
    fi
    sleep 0.5
  done
  tail -n 30 "$log" >&2 || true
  die "dockerd did not answer within 60 s"
}

# ---- a base image -------------------------------------------------------------------------
debian_mirror() {  # the first http(s) Debian mirror in this machine's apt sources
  if [ -n "${TIERFS_DEBIAN_MIRROR:-}" ]; then
    echo "${TIERFS_DEBIAN_MIRROR%/}"
    return
  fi
  local f url
  local files=()
  [ -f /etc/apt/sources.list ] && files+=(/etc/apt/sources.list)
  for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && files+=("$f")
  done
  for f in "${files[@]}"; do
    case "$f" in
      *.sources) urls=$(awk 'tolower($1) == "uris:" { for (i = 2; i <= NF; i++) print $i }' "$f") ;;
      *) urls=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\//) { print $i; break } }' "$f") ;;
    esac
    for url in $urls; do
      case "$url" in http://*|https://*) ;; *) continue ;; esac
      case "$url" in *security*|*ports*) continue ;; esac
      case "${url%/}" in */debian) echo "${url%/}"; return ;; esac
    done
  done
  echo "http://deb.debian.org/debian"
}

build_local_base() {
  is_root || die "need root to build $LOCAL_BASE with debootstrap"
  command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
  local mirror rootfs="$work/rootfs" include=()
  mirror=$(debian_mirror)
  case "$mirror" in https://*) include=(--include=ca-certificates) ;; esac
  say "building $LOCAL_BASE: debootstrap --variant=minbase bookworm from $mirror (a few minutes)"
  if ! debootstrap --variant=minbase "${include[@]}" bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1; then
    tail -n 30 "$work/debootstrap.log" >&2 || true
    [ -f "$rootfs/debootstrap/debootstrap.log" ] && tail -n 30 "$rootfs/debootstrap/debootstrap.log" >&2
    die "debootstrap failed"
  fi
  unmount_under "$rootfs"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/etc/hostname
  : >"$rootfs/etc/resolv.conf"
  tar -C "$rootfs" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - "$LOCAL_BASE" >/dev/null
  rm -rf "$rootfs"
}

choose_base() {
  if [ -n "${BASE_IMAGE:-}" ]; then
    echo "$BASE_IMAGE"
    return
  fi
  if docker image inspect "$DEFAULT_BASE" >/dev/null 2>&1; then
    echo "$DEFAULT_BASE"
    return
  fi
  say "pulling $DEFAULT_BASE"
  if timeout 300 docker pull -q "$DEFAULT_BASE" >&2; then
    echo "$DEFAULT_BASE"
    return
  fi
  say "cannot pull $DEFAULT_BASE; using a local Debian bookworm base ($LOCAL_BASE)"
  if ! docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    build_local_base
  fi
  echo "$LOCAL_BASE"
}

# ---- the build context --------------------------------------------------------------------
make_context() {
  local ctx="$work/context"
  mkdir -p "$ctx"
  if command -v git >/dev/null 2>&1 && git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # what a `docker build .` would see, less what git ignores (.venv, caches, ...)
    git -C "$repo" ls-files -z --cached --others --exclude-standard \
      | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
      | tar -C "$repo" --null -T - -c | tar -C "$ctx" -x
  else
    tar -C "$repo" --exclude=./.git --exclude=./.venv --exclude='*/__pycache__' -c . | tar -C "$ctx" -x
  fi
  local n=0 c name
  if [ -d /usr/local/share/ca-certificates ]; then
    while IFS= read -r -d '' c; do
      name=${c#/usr/local/share/ca-certificates/}
      cp "$c" "$ctx/docker-ca-${name//\//-}"
      n=$((n + 1))
    done < <(find /usr/local/share/ca-certificates -name '*.crt' -type f -print0)
  fi
  [ "$n" -gt 0 ] && say "the image will trust $n CA certificate(s) from /usr/local/share/ca-certificates"
  echo "$ctx"
}

# ---- main ---------------------------------------------------------------------------------
[ -e /dev/fuse ] || { is_root && modprobe fuse 2>/dev/null || true; }
[ -e /dev/fuse ] || say "warning: no /dev/fuse here (fuse kernel module); \`docker run --device /dev/fuse\` needs it on the engine's machine"

ensure_docker
base=$(choose_base)
ctx=$(make_context)

build_args=(--build-arg "BASE_IMAGE=$base")
for v in HTTP_PROXY HTTPS_PROXY NO_PROXY ALL_PROXY http_proxy https_proxy no_proxy all_proxy; do
  if [ -n "${!v:-}" ]; then
    build_args+=(--build-arg "$v")
  fi
done
say "building $IMAGE on $base"
docker build --network=host "${build_args[@]}" -t "$IMAGE" "$ctx"

run_args=(--rm --network=none --device /dev/fuse --cap-add SYS_ADMIN)
if docker info --format '{{json .SecurityOptions}}' 2>/dev/null | grep -q apparmor; then
  run_args+=(--security-opt apparmor=unconfined)
fi
# extra `docker run` options, split on spaces: e.g. TIERFS_DOCKER_RUN_ARGS="-v /tmp" puts the
# tests' temporary directories (hot tiers included) on a volume instead of the overlay root
read -r -a extra_run_args <<<"${TIERFS_DOCKER_RUN_ARGS:-}"
run_args+=("${extra_run_args[@]}")
container="tierfs-test-$$-$RANDOM"
say "running the test suite: docker run ${run_args[*]} $IMAGE"
set +e
docker run --name "$container" "${run_args[@]}" "$IMAGE" sh -c "$PYTEST_CMD" pytest "$@" 2>&1 \
  | tee "$work/pytest.log"
rc=${PIPESTATUS[0]}
set -e
container=""
summary=$(grep -E '^(=+ )?([0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)|no tests ran)' \
  "$work/pytest.log" | tail -n 1 || true)
say "pytest summary: ${summary:-none (see the output above)}"
say "pytest exit status: $rc"
[ "$rc" -eq 5 ] && rc=1
exit "$rc"
