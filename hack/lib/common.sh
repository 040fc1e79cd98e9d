# Shared helpers for the hack/ scripts of the local cluster (sourced, not executed).
# Versions, cache and state locations, logging, and idempotent Debian package installation.

K8S_VERSION="${K8S_VERSION:-1.20.2}"
RINGTRAIN_CACHE="${RINGTRAIN_CACHE:-/var/cache/ringtrain}"
K8S_CACHE="$RINGTRAIN_CACHE/kubernetes-$K8S_VERSION"
K8S_BIN="$K8S_CACHE/bin"
STATE="${RINGTRAIN_CLUSTER_DIR:-/var/lib/ringtrain-cluster}"
HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPO_ROOT="$(cd "$HACK_DIR/.." && pwd)"

# Debian packages every part of the local cluster needs.
CLUSTER_PKGS=(containerd runc umoci buildah debootstrap etcd-server etcd-client
  golang-1.19-go golang-github-modern-go-reflect2-dev rsync gcc libc6-dev make dpkg-dev
  iptables conntrack iproute2 openssl ca-certificates containernetworking-plugins)

log() { printf '%s [%s] %s\n' "$(date +%H:%M:%S)" "${LOG_TAG:-hack}" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ensure_pkgs PKG...: install the Debian packages that are not installed yet (idempotent).
ensure_pkgs() {
  local missing=() p
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
  log "installing Debian packages: ${missing[*]}"
  # A lock held by a parallel apt run: wait for it instead of failing.
  $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends "${missing[@]}" >/dev/null
}

# The Debian mirror the system's own apt sources use (deb822 or one-line format).
debian_mirror() {
  local m
  m=$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' \
        | grep -v security | head -n1)
  [ -z "$m" ] && m=$(grep -hE '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' \
        | grep -v security | head -n1)
  echo "${m:-http://deb.debian.org/debian}"
}

# wait_for DESC TIMEOUT_S CMD...: poll CMD until it succeeds or the deadline passes.
wait_for() {
  local desc="$1" timeout="$2"; shift 2
  local deadline=$(( $(date +%s) + timeout ))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "timed out after ${timeout}s waiting for $desc"
      return 1
    fi
    sleep 0.5
  done
}
