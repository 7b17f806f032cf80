#!/usr/bin/env bash
# The Debian packages of the services the tests start themselves, installed when missing.
#
# Called by ./scripts/test.sh and .ci/run. Idempotent: a package whose check succeeds is
# skipped, and nothing is installed (no apt-get update either) when all are present. Installing
# needs root; otherwise the missing packages and the command to install them are printed, and
# the tests that need them skip (locally) or fail (when CI is set).
#
# To add a package, add one line to PACKAGES: the Debian package, a "|", then a shell command
# that succeeds when it is present. Arguments of the same form replace the list (for tests).
set -euo pipefail

PACKAGES=(
  "openssh-server|test -x /usr/sbin/sshd"
  "rsync|command -v rsync"
  "tmux|command -v tmux"
  "postgresql|ls /usr/lib/postgresql/*/bin/initdb"
  "chromium|command -v chromium"
  "docker-compose|command -v docker-compose || docker compose version"
  "slurm-wlm|test -x /usr/sbin/slurmctld && test -x /usr/sbin/slurmd && command -v sbatch"
  "munge|test -x /usr/sbin/munged"
  "iproute2|command -v ip"
  "libegl1|ls /usr/lib/*/libEGL.so.1"
  "libgl1-mesa-dri|ls /usr/lib/*/dri/swrast_dri.so"
)
[ $# -eq 0 ] || PACKAGES=("$@")

missing=()
for entry in "${PACKAGES[@]}"; do
  package="${entry%%|*}"
  check="${entry#*|}"
  bash -c "$check" >/dev/null 2>&1 || missing+=("$package")
done

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "dpflow system packages: missing ${missing[*]}; not root, so not installed." >&2
    echo "  install them with: sudo apt-get install -y ${missing[*]}" >&2
    echo "  (the tests that need them skip, or fail when CI is set)" >&2
  else
    echo "dpflow system packages: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

# sshd's privilege-separation folder (/run is a tmpfs: it is gone after a reboot)
if [ -x /usr/sbin/sshd ] && [ ! -d /run/sshd ]; then
  if [ "$(id -u)" -eq 0 ]; then
    mkdir -p /run/sshd
  else
    echo "dpflow system packages: /run/sshd is missing; create it with: sudo mkdir -p /run/sshd" >&2
  fi
fi
