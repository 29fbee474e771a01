#!/usr/bin/env bash
# Install tandem as systemd services on this host.
#
#   sudo ops/install.sh [--root DIR] [--no-venv] [--no-systemctl] [--roles "broker edge prefill@0 decode@5600"]
#
# Installs the package into /opt/tandem/venv, the units into /etc/systemd/system, an
# example /etc/tandem/tandem.toml (kept if present), a fresh cluster secret in
# /etc/tandem/cluster-secret (kept if present; services read it via LoadCredential=),
# a `tandem` system user, and fetches the default model into /var/cache/tandem.
# --root installs into a staging directory instead of / (for packaging and tests).
set -euo pipefail

src=$(cd "$(dirname "$0")/.." && pwd)
root=""
venv=1
systemctl=1
roles="broker edge prefill@0 decode@5600"
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root=${2:?--root needs a directory}; shift 2 ;;
    --no-venv) venv=0; shift ;;
    --no-systemctl) systemctl=0; shift ;;
    --roles) roles=${2:?--roles needs a list}; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$root" ] && [ "$(id -u)" != 0 ]; then
  echo "install.sh: run as root (or use --root DIR to stage the files)" >&2
  exit 2
fi

say() { echo "install.sh: $*"; }
install -d -m 0755 "$root/opt/tandem" "$root/etc/systemd/system"
install -d -m 0750 "$root/etc/tandem"

if [ "$venv" = 1 ]; then
  say "installing the package into $root/opt/tandem/venv"
  python3 -m venv "$root/opt/tandem/venv"
  "$root/opt/tandem/venv/bin/pip" install -q --upgrade pip
  "$root/opt/tandem/venv/bin/pip" install -q "$src"
fi
rm -rf "$root/opt/tandem/src"
mkdir -p "$root/opt/tandem/src"
cp -r "$src/docs" "$src/ops" "$src/README.md" "$root/opt/tandem/src/"

if [ ! -e "$root/etc/tandem/tandem.toml" ]; then
  install -m 0644 "$src/ops/tandem.toml.example" "$root/etc/tandem/tandem.toml"
  say "wrote $root/etc/tandem/tandem.toml (edit addresses before starting multi-host roles)"
fi
if [ ! -e "$root/etc/tandem/cluster-secret" ]; then
  (umask 077 && head -c 32 /dev/urandom | od -An -v -tx1 | tr -d ' \n' > "$root/etc/tandem/cluster-secret")
  say "generated $root/etc/tandem/cluster-secret: copy the same file to every host of the cluster"
fi
chmod 0600 "$root/etc/tandem/cluster-secret"

for unit in "$src"/ops/systemd/*.service; do
  install -m 0644 "$unit" "$root/etc/systemd/system/$(basename "$unit")"
done
say "installed units: $(cd "$src/ops/systemd" && echo *.service)"

if [ -z "$root" ]; then
  if ! id tandem >/dev/null 2>&1; then
    useradd --system --home-dir /var/lib/tandem --no-create-home --shell /usr/sbin/nologin tandem
    say "created system user tandem"
  fi
  install -d -o tandem -g tandem -m 0750 /var/cache/tandem /var/lib/tandem
  say "fetching the default model into /var/cache/tandem/models"
  runuser -u tandem -- env XDG_CACHE_HOME=/var/cache /opt/tandem/venv/bin/tandem model fetch
fi

if [ "$systemctl" = 1 ] && [ -z "$root" ] && command -v systemctl >/dev/null; then
  systemctl daemon-reload
  for r in $roles; do
    systemctl enable --now "tandem-$r.service"
  done
  say "started: $(for r in $roles; do printf 'tandem-%s ' "$r"; done)"
else
  say "not starting services; enable them with: systemctl enable --now $(for r in $roles; do printf 'tandem-%s ' "$r"; done)"
fi
