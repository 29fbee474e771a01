#!/usr/bin/env bash
# Install tandem as systemd services on this host, stage the same tree for a package, or undo.
#
#   sudo ops/install.sh --system [--python PATH] [--no-venv] [--no-model] [--start "ROLES"]
#       Install into /: the package into /opt/tandem/venv, the units into /etc/systemd/system,
#       /etc/tandem/tandem.toml (kept if present), a fresh /etc/tandem/cluster-secret (kept if
#       present; services read it via LoadCredential=), a `tandem` system user, and the
#       default model into /var/cache/tandem. Starts nothing unless --start names the roles,
#       e.g. --start "broker edge prefill@0 decode@5600".
#   ops/install.sh --stage DIR [--python PATH] [--no-venv]
#       Build the same /opt/tandem and /etc tree under DIR for a package or an image. Its venv
#       already names /opt/tandem/venv, so it works once DIR's contents are copied to /; it has
#       no user, secret or model: on the host, `install.sh --system --no-venv` adds those.
#   sudo ops/install.sh --uninstall [--purge]
#       Stop and disable the tandem units, remove them and /opt/tandem. --purge also removes
#       /etc/tandem (config and secret), /var/lib/tandem, /var/cache/tandem and the user.
#
# --python: the interpreter the venv is built on (default /usr/bin/python3, not the first
# python3 on PATH): the service user must be able to run it, which a pyenv or conda under a
# private home is not; install.sh checks that before it changes anything.
# Nothing happens without --system, --stage or --uninstall. A failed --system run removes
# what it created.
set -Eeuo pipefail

src=$(cd "$(dirname "$0")/.." && pwd)
mode=""
stage=""
python=/usr/bin/python3
venv=1
model=1
purge=0
start=""
usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "install.sh: $*" >&2; exit 2; }
say() { echo "install.sh: $*"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --system) mode=system; shift ;;
    --stage) mode=stage; stage=${2:?--stage needs a directory}; shift 2 ;;
    --uninstall) mode=uninstall; shift ;;
    --python) python=${2:?--python needs a path}; shift 2 ;;
    --no-venv) venv=0; shift ;;
    --no-model) model=0; shift ;;
    --purge) purge=1; shift ;;
    --start) start=${2:?--start needs a list of roles}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ -n "$mode" ] || { usage >&2; die "choose --system, --stage DIR or --uninstall; nothing was done"; }
[ "$mode" = stage ] || [ "$(id -u)" = 0 ] || die "--$mode must run as root"
has_systemd() { [ -d /run/systemd/system ] && command -v systemctl >/dev/null; }

# ---- undo ---------------------------------------------------------------------------------
uninstall() {
  if has_systemd; then
    mapfile -t units < <(cd /etc/systemd/system && ls -d tandem-*.service */tandem-*.service 2>/dev/null | xargs -rn1 basename | sort -u)
    [ ${#units[@]} -eq 0 ] || systemctl disable --now "${units[@]}" 2>/dev/null || true
  fi
  rm -f /etc/systemd/system/tandem-*.service /etc/systemd/system/*.wants/tandem-*.service
  has_systemd && systemctl daemon-reload || true
  rm -rf /opt/tandem
  say "removed the tandem units and /opt/tandem"
  if [ "$purge" = 1 ]; then
    rm -rf /etc/tandem /var/lib/tandem /var/cache/tandem
    if id tandem >/dev/null 2>&1; then userdel tandem; fi
    say "purged /etc/tandem, /var/lib/tandem, /var/cache/tandem and the tandem user"
  else
    say "kept /etc/tandem, /var/lib/tandem, /var/cache/tandem and the tandem user (--purge removes them)"
  fi
}
if [ "$mode" = uninstall ]; then uninstall; exit 0; fi

# ---- the interpreter ----------------------------------------------------------------------
# Checked as the service user (nobody until that user exists): a venv's python is a link to
# this interpreter, so whoever runs the services must be able to run it too.
if [ "$venv" = 1 ]; then
  runner=tandem
  id tandem >/dev/null 2>&1 || runner=nobody
  if ! runuser -u "$runner" -- "$python" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    die "user $runner cannot run $python as Python >= 3.11 with venv (a private home, or too old?); pass --python with a system interpreter such as /usr/bin/python3.11; nothing was done"
  fi
fi

# Shebangs, activate scripts and compiled files name the directory a venv was built in;
# a staged venv is built in DIR/opt/tandem/venv and rewritten to name /opt/tandem/venv.
relocate_venv() {
  local built=$1 final=$2
  grep -rlI --null -F "$built" "$built/bin" "$built/pyvenv.cfg" 2>/dev/null | xargs -0r sed -i "s#$built#$final#g"
  find "$built" -name __pycache__ -type d -prune -exec rm -rf {} +
  "$built/bin/python" -m compileall -q -j 0 -s "$(dirname "$(dirname "$(dirname "$built")")")" -p / "$built/lib" >/dev/null || true
}
build_venv() {
  local dir=$1
  say "installing the package into $dir with $python"
  "$python" -m venv "$dir"
  "$dir/bin/pip" install -q "$src"
}
lay_out() {  # the files common to --system and --stage, under root $1
  local root=$1
  install -d -m 0755 "$root/opt/tandem" "$root/etc/systemd/system"
  rm -rf "$root/opt/tandem/src"
  mkdir -p "$root/opt/tandem/src"
  cp -r "$src/docs" "$src/ops" "$src/README.md" "$root/opt/tandem/src/"
  for unit in "$src"/ops/systemd/*.service; do
    install -m 0644 "$unit" "$root/etc/systemd/system/$(basename "$unit")"
  done
}

if [ "$mode" = stage ]; then
  mkdir -p "$stage"
  stage=$(cd "$stage" && pwd)
  lay_out "$stage"
  install -d -m 0750 "$stage/etc/tandem"
  [ -e "$stage/etc/tandem/tandem.toml" ] || install -m 0640 "$src/ops/tandem.toml.example" "$stage/etc/tandem/tandem.toml"
  if [ "$venv" = 1 ]; then
    build_venv "$stage/opt/tandem/venv"
    relocate_venv "$stage/opt/tandem/venv" /opt/tandem/venv
  fi
  say "staged $stage for /: copy its contents to / on the host (the venv names /opt/tandem/venv and $python),"
  say "then run ops/install.sh --system --no-venv there for the user, the secret, permissions and the model"
  exit 0
fi

# ---- --system -----------------------------------------------------------------------------
created=()  # what this run made, undone in reverse if a later step fails
rollback() {
  local rc=$?
  trap - ERR
  echo "install.sh: failed (status $rc); removing what this run created" >&2
  for ((i = ${#created[@]} - 1; i >= 0; i--)); do
    case "${created[$i]}" in
      user:*) userdel "${created[$i]#user:}" 2>/dev/null || true ;;
      *) rm -rf "${created[$i]}" ;;
    esac
  done
  exit "$rc"
}
trap rollback ERR
new() { [ -e "$1" ] || created+=("$1"); }

if ! id tandem >/dev/null 2>&1; then
  useradd --system --home-dir /var/lib/tandem --no-create-home --shell /usr/sbin/nologin tandem
  created+=("user:tandem")
  say "created system user tandem"
fi
new /opt/tandem
for unit in "$src"/ops/systemd/*.service; do new "/etc/systemd/system/$(basename "$unit")"; done
lay_out ""
# The units run as tandem and systemd leaves an existing ConfigurationDirectory's mode as
# it is: the group must be tandem for the services to read tandem.toml.
new /etc/tandem
install -d -o root -g tandem -m 0750 /etc/tandem
chown root:tandem /etc/tandem && chmod 0750 /etc/tandem
if [ ! -e /etc/tandem/tandem.toml ]; then
  install -o root -g tandem -m 0640 "$src/ops/tandem.toml.example" /etc/tandem/tandem.toml
  say "wrote /etc/tandem/tandem.toml (set the broker's addresses before starting multi-host roles)"
else
  chgrp tandem /etc/tandem/tandem.toml && chmod g+r,o-rwx /etc/tandem/tandem.toml
fi
if [ ! -e /etc/tandem/cluster-secret ]; then
  (umask 077 && head -c 32 /dev/urandom | od -An -v -tx1 | tr -d ' \n' > /etc/tandem/cluster-secret)
  say "generated /etc/tandem/cluster-secret: copy the same file to every host of the cluster"
fi
# systemd reads it as root for LoadCredential=; the services see their private copy.
chown root:root /etc/tandem/cluster-secret && chmod 0600 /etc/tandem/cluster-secret
for d in /var/cache/tandem /var/lib/tandem; do new "$d"; done
install -d -o tandem -g tandem -m 0750 /var/cache/tandem /var/lib/tandem

if [ "$venv" = 1 ]; then
  rm -rf /opt/tandem/venv
  build_venv /opt/tandem/venv
fi
if ! runuser -u tandem -- /opt/tandem/venv/bin/tandem --version >/dev/null; then
  echo "install.sh: user tandem cannot run /opt/tandem/venv/bin/tandem" >&2
  false
fi
# The services' own view: the config must load as user tandem.
runuser -u tandem -- /opt/tandem/venv/bin/python -c 'import tandem.config as c; c.load("/etc/tandem/tandem.toml")'
if [ "$model" = 1 ]; then
  say "fetching the default model into /var/cache/tandem/models"
  runuser -u tandem -- env XDG_CACHE_HOME=/var/cache /opt/tandem/venv/bin/tandem model fetch
fi
trap - ERR

units=$(for r in ${start:-broker edge prefill@0 decode@5600}; do printf 'tandem-%s ' "$r"; done)
if [ -n "$start" ] && has_systemd; then
  systemctl daemon-reload
  # shellcheck disable=SC2086
  systemctl enable --now $units
  say "started: $units"
else
  if has_systemd; then systemctl daemon-reload; fi
  say "installed; nothing started. Edit /etc/tandem/tandem.toml, then: systemctl enable --now $units"
fi
