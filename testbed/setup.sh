#!/usr/bin/env bash
# Builds the offline Docker test bed: engine, base image, fixture task images, hidden-test
# blobs, submissions. Idempotent: a second run only re-checks hashes (seconds).
# Usage: testbed/setup.sh [--engine-only]   (as root; then `. testbed/.state/env.sh`)
#   --engine-only: just make sure a Docker engine runs (e.g. for CI before anything else).
set -euo pipefail
shopt -s nullglob

TB=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE=$TB/.state
IMAGE_TAG=${PB_TESTBED_IMAGE_TAG:-task_cleanroom_v6}  # another tag only for tests of this script
LABEL=pytest-programbench.testbed   # NOT "pytest-programbench": the plugin sweeps that label
# Which checkout built an image: one engine may serve several, and a tag another one built is never replaced.
CHECKOUT_LABEL=$LABEL.checkout
PYTHON=${PB_PYTHON:-python3}        # the interpreter that has `programbench` installed
export DOCKER_BUILDKIT=0            # the legacy builder is what docker.io 20.10 ships; same on every machine

log() { printf '[setup %4ds] %s\n' "$SECONDS" "$*"; }
die() { printf '[setup %4ds] ERROR: %s\n' "$SECONDS" "$*" >&2; exit 1; }
trap 'die "command failed (line $LINENO): $BASH_COMMAND"' ERR

# Runs "$@" with its output in the file $1, saying every 30 s that it still runs and what it printed last: debootstrap
# is silent for minutes otherwise. `set +e` as the caller's `||` had it (errexit is off in such a list).
run_logged() {
  local out=$1 pid waited=0
  shift
  (set +e; "$@") >"$out" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    waited=$((waited + 1))
    if [ $((waited % 30)) -eq 0 ]; then
      log "  still running after ${waited} s; last: $(tail -n 1 "$out" 2>/dev/null | cut -c1-90)"
    fi
  done
  wait "$pid"
}

[ "$(id -u)" = 0 ] || die "run as root (dockerd, debootstrap and docker import need it)"
mkdir -p "$STATE"

# ---------------------------------------------------------------- a. Docker engine
# No registry and no network here: no bridge, no iptables rules. gVisor's runsc registered as the runtime `runsc`
# (--pb-runtime runsc; its own network stack off, as the bridge is): the suite runs its tests under it for real.
DAEMON_JSON='{"bridge": "none", "iptables": false, "runtimes": {"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none"]}}}'

# Debian's gVisor; a missing one fails here, and the gVisor tests fail (never skip) on an engine without it.
ensure_runsc() {
  [ -x /usr/bin/runsc ] && return
  log "gVisor: installing runsc via apt"
  apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runsc >/dev/null || die "apt-get install runsc failed"
}

write_daemon_json() {
  mkdir -p /etc/docker
  if [ "$(cat /etc/docker/daemon.json 2>/dev/null)" != "$DAEMON_JSON" ]; then
    [ -f /etc/docker/daemon.json ] && cp /etc/docker/daemon.json "/etc/docker/daemon.json.pb-backup.$(date +%s)"
    printf '%s\n' "$DAEMON_JSON" >/etc/docker/daemon.json
  fi
}

# A running engine without runsc (started before this script registered it): dockerd reloads `runtimes` on SIGHUP,
# so the containers of whoever else uses it keep running.
register_runsc() {
  write_daemon_json  # also for the engine's next start
  docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"' && return
  local pid i
  pid=$(cat /var/run/docker.pid 2>/dev/null || true)
  [ -n "$pid" ] && grep -q dockerd "/proc/$pid/comm" 2>/dev/null || die "runsc is not registered and no dockerd pid in /var/run/docker.pid to reload"
  log "docker engine: registering runsc (SIGHUP to dockerd $pid)"
  kill -HUP "$pid"
  for i in $(seq 20); do
    docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"' && return
    sleep 0.5
  done
  die "dockerd $pid did not register runsc after a reload (see /var/log/pb-dockerd.log)"
}

ensure_docker() {
  ensure_runsc
  if docker info >/dev/null 2>&1; then log "docker engine: running"; register_runsc; return; fi
  if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
    log "docker engine: installing docker.io via apt"
    apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null || die "apt-get install docker.io failed"
  fi
  # Written BEFORE the first start.
  write_daemon_json
  local pid
  pid=$(cat "$STATE/dockerd.pid" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q dockerd "/proc/$pid/comm" 2>/dev/null; then
    log "docker engine: our dockerd (pid $pid) is still starting"
  else
    log "docker engine: starting dockerd (log: /var/log/pb-dockerd.log)"
    # setsid: the daemon must outlive this script and ignore its Ctrl-C.
    setsid nohup dockerd >>/var/log/pb-dockerd.log 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$STATE/dockerd.pid"
  fi
  local i
  for i in $(seq 60); do
    docker info >/dev/null 2>&1 && { log "docker engine: up after ${i}s (pid $pid)"; return; }
    kill -0 "$pid" 2>/dev/null || { tail -n 20 /var/log/pb-dockerd.log >&2; die "dockerd (pid $pid) exited"; }
    sleep 1
  done
  tail -n 20 /var/log/pb-dockerd.log >&2
  die "docker info still failing after 60 s"
}

# ---------------------------------------------------------------- b. base image
BASE_HASH=$(sha256sum "$TB/base.recipe" | cut -c1-12)
BASE_REF=pb-testbed-base:$BASE_HASH

ensure_base() {
  # shellcheck source=base.recipe
  . "$TB/base.recipe"
  local hash=$BASE_HASH
  if docker image inspect "$BASE_REF" >/dev/null 2>&1; then
    log "base image: $BASE_REF exists"
  else
    if ! command -v debootstrap >/dev/null; then
      log "base image: installing debootstrap via apt"
      apt-get update -qq || die "apt-get update failed"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null \
        || die "apt-get install debootstrap failed"
    fi
    local root
    root=$(mktemp -d /tmp/pb-testbed-rootfs.XXXXXX)
    # The rootfs is big and root-owned: never leave it behind, whatever happens.
    trap 'rm -rf --one-file-system "'"$root"'"' EXIT
    log "base image: debootstrap $BASE_SUITE into $root (a few minutes; log: $STATE/debootstrap.log)"
    run_logged "$STATE/debootstrap.log" build_base_rootfs "$root" \
      || { tail -n 20 "$STATE/debootstrap.log" >&2; die "debootstrap failed (full log: $STATE/debootstrap.log)"; }
    local changes=() c
    for c in "${BASE_CHANGES[@]}"; do changes+=(--change "$c"); done
    log "base image: debootstrap done; docker import -> $BASE_REF"
    tar --numeric-owner -C "$root" -c . | docker import "${changes[@]}" - "$BASE_REF" >/dev/null \
      || die "docker import failed"
    rm -rf --one-file-system "$root"
    trap - EXIT
  fi
  docker tag "$BASE_REF" pb-testbed-base:latest
  # Untag bases of older recipes (layers stay while older images still use them).
  local tag
  for tag in $(docker images pb-testbed-base --format '{{.Tag}}'); do
    case $tag in "$hash" | latest) ;; *) docker rmi "pb-testbed-base:$tag" >/dev/null 2>&1 || true ;; esac
  done
}

# ---------------------------------------------------------------- c. fixture images
image_ref() { echo "programbench/${1//__/_1776_}:$IMAGE_TAG"; }

# Every fixture image, "<instance id> <build context>" (a task dir or testbed/images/<id>).
fixture_images() {
  local d
  for d in "$TB"/tasks/*/ "$TB"/gold_tasks/*/; do echo "$(basename "$d") ${d%/}"; done
  echo "testorg__calculator.abc1234 $TB/images/testorg__calculator.abc1234"
}

# $1 build context. Hashes what the build can see (hidden tests and metadata are excluded, also via
# .dockerignore) plus the base tag, so a new base recipe rebuilds every fixture.
context_hash() {
  { echo "$BASE_REF"
    cd "$1" && find . -type f ! -path './tests/*' ! -path '*/__pycache__/*' \
      ! -name tests.json ! -name task.yaml -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-16
}

# $1 image ref, $2 the content hash we would tag it with. Prints why the tag is someone else's (nothing: ours to
# set). `programbench/...` names are global on an engine: the packaged calculator's is also the name of
# programbench's own image of that task, and another checkout of this project on the same engine (other content)
# tags the same names. Re-tagging either would change what their runs evaluate.
foreign_owner() {
  local ref=$1 chash=$2 labels have by
  labels=$(docker image inspect -f "{{index .Config.Labels \"$LABEL\"}}|{{index .Config.Labels \"$CHECKOUT_LABEL\"}}" \
    "$ref" 2>/dev/null) || return 0  # no such tag
  IFS='|' read -r have by <<<"$labels" || true
  if [ -z "$have" ]; then
    echo "it has no label $LABEL, so it is not the test bed's (another process owns it, e.g. programbench's own image)"
  elif [ "$have" != "$chash" ] && [ -n "$by" ] && [ "$by" != "$TB" ] && [ "${PB_TESTBED_REPLACE:-}" != 1 ]; then
    echo "the test bed of another checkout ($by) built it with other content"
  fi
}

# Checked before anything is built or tagged: a refusal leaves the engine as it was.
check_owners() {
  local id ctx ref why refused=0
  while read -r id ctx; do
    ref=$(image_ref "$id")
    why=$(foreign_owner "$ref" "$(context_hash "$ctx")")
    [ -z "$why" ] && continue
    printf '[setup %4ds] REFUSED: %s exists and %s; re-tagging it would break its runs.\n' "$SECONDS" "$ref" "$why" >&2
    refused=1
  done < <(fixture_images)
  [ "$refused" = 0 ] && return
  # Pasteable: a second dockerd (the same /etc/docker/daemon.json, its own socket, data and exec roots) and the
  # variable that points this script and the test suite at it.
  cat >&2 <<HINT
Give the test bed an engine of its own: paste these two lines, then run this script again in the same shell:
  setsid nohup dockerd --host unix:///run/pb-testbed.sock --data-root /var/lib/pb-testbed --exec-root /run/pb-testbed --pidfile /run/pb-testbed.pid >>/var/log/pb-testbed-dockerd.log 2>&1 </dev/null &
  export DOCKER_HOST=unix:///run/pb-testbed.sock
Or replace another checkout's images on this engine: PB_TESTBED_REPLACE=1 bash $TB/setup.sh
Or remove those tags if nothing needs them: docker image rm REF
HINT
  die "nothing was changed"
}

# $1 instance id, $2 build context
ensure_image() {
  local id=$1 ctx=$2 ref chash have old
  ref=$(image_ref "$id")
  chash=$(context_hash "$ctx")
  have=$(docker image inspect -f "{{index .Config.Labels \"$LABEL\"}}" "$ref" 2>/dev/null || true)
  if [ "$have" = "$chash" ]; then log "image: $ref up to date"; return; fi
  [ -z "$(foreign_owner "$ref" "$chash")" ] || die "$ref changed owner while setup.sh ran"
  old=$(docker image inspect -f '{{.Id}}' "$ref" 2>/dev/null || true)
  log "image: building $ref"
  docker build -q --network none --build-arg "BASE=$BASE_REF" --label "$LABEL=$chash" \
    --label "$CHECKOUT_LABEL=$TB" -t "$ref" "$ctx" </dev/null >"$STATE/build-$id.log" 2>&1 \
    || { tail -n 30 "$STATE/build-$id.log" >&2; die "docker build of $ref failed"; }
  # Drop the image this one replaced, if it was ours and nothing uses it any more (best effort).
  if [ -n "$have" ] && [ -n "$old" ]; then docker rmi "$old" >/dev/null 2>&1 || true; fi
}

# ---------------------------------------------------------------- d/e. deterministic archives
# $1 source dir (becomes the archive root), $2 output .tar.gz. Rewritten only when the bytes change;
# PACKED=1 then. (Always returns 0: `set -e` must stay effective inside.)
pack() {
  local src=$1 out=$2 tmp
  PACKED=0
  mkdir -p "$(dirname "$out")"
  tmp=$(mktemp "$out.XXXXXX"); chmod 644 "$tmp"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --mode=u+rwX,go=rX \
      --exclude=__pycache__ --exclude='*.pyc' --exclude=.pytest_cache --exclude=.benchmarks --exclude=results.xml \
      -C "$src" -cf - . | gzip -n -9 >"$tmp"
  if cmp -s "$tmp" "$out"; then rm -f "$tmp"; else mv "$tmp" "$out"; PACKED=1; fi
}

ensure_archives() {
  local pkg calc n_new=0 n_all=0 id d b v
  pkg=$("$PYTHON" -c 'import programbench, os; print(os.path.dirname(programbench.__file__))' 2>/dev/null) \
    || die "'$PYTHON' cannot import programbench (set PB_PYTHON to the right interpreter)"
  calc=testorg__calculator.abc1234
  # Hidden test blobs: every fixture's tests/<branch>/ (ignored branches too) + the packaged calculator.
  for d in "$TB"/tasks/*/ "$TB"/gold_tasks/*/ "$pkg/data/tasks/$calc/"; do
    id=$(basename "$d")
    for b in "$d"tests/*/; do
      n_all=$((n_all + 1))
      pack "$b" "$STATE/blobs/$id/tests/$(basename "$b").tar.gz"; n_new=$((n_new + PACKED))
    done
  done
  log "blobs: $n_all branch archives ($n_new rewritten) in $STATE/blobs"
  # Submissions: one run directory per variant: good/ from solutions/, <variant>/ from bad/<id>/<variant>/.
  n_all=0 n_new=0
  for d in "$TB"/solutions/*/; do
    id=$(basename "$d"); n_all=$((n_all + 1))
    pack "$d" "$STATE/submissions/good/$id/submission.tar.gz"; n_new=$((n_new + PACKED))
  done
  for d in "$TB"/bad/*/*/; do
    v=$(basename "$d"); id=$(basename "$(dirname "$d")"); n_all=$((n_all + 1))
    pack "$d" "$STATE/submissions/$v/$id/submission.tar.gz"; n_new=$((n_new + PACKED))
  done
  log "submissions: $n_all archives ($n_new rewritten) in $STATE/submissions/<variant>/<id>/"
  CALC_PKG_DIR=$pkg/data/tasks/$calc
}

# ---------------------------------------------------------------- main
log "testbed: $TB"
ensure_docker
[ "${1:-}" = --engine-only ] && exit 0
check_owners
ensure_base
while read -r id ctx; do ensure_image "$id" "$ctx"; done < <(fixture_images)
ensure_archives

# Written whole, then moved into place: a concurrent session's tests may be reading it.
cat >"$STATE/env.sh.tmp" <<EOF
# Written by testbed/setup.sh. Source it: . $STATE/env.sh
export BLOB_DIR=$STATE/blobs
export TASKS_DIR=$TB/tasks
export SUBMISSIONS=$STATE/submissions/good
export BASE=$BASE_REF
# Same values under collision-free names, plus the root holding the bad variants' run dirs.
export PB_TESTBED_BLOB_DIR=$STATE/blobs
export PB_TESTBED_TASKS_DIR=$TB/tasks
export PB_TESTBED_SUBMISSIONS=$STATE/submissions/good
export PB_TESTBED_BASE=$BASE_REF
export PB_TESTBED_RUNS=$STATE/submissions
export PB_TESTBED_CALCULATOR_TASK_DIR=$CALC_PKG_DIR
export PB_TESTBED_GOLD_TASKS_DIR=$TB/gold_tasks
EOF
mv "$STATE/env.sh.tmp" "$STATE/env.sh"
log "wrote $STATE/env.sh"
echo "testbed ready: BLOB_DIR=$STATE/blobs TASKS_DIR=$TB/tasks SUBMISSIONS=$STATE/submissions/good BASE=$BASE_REF"
