#!/usr/bin/env bash
# Installs what the demo and the tests need on a fresh Debian/Ubuntu machine (as root):
# systemd-nspawn and debootstrap for the real-systemd container, and a virtualenv with guardian.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v systemd-nspawn >/dev/null || need_apt+=(systemd-container)
command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] || need_apt+=(debootstrap)
command -v nsenter >/dev/null || need_apt+=(util-linux)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
command -v lintian >/dev/null || need_apt+=(lintian)
command -v dpkg-deb >/dev/null || need_apt+=(dpkg-dev)
# the arm64 package is run under emulation in an arm64 Debian root (tests/arm64_root.py)
[ -x /usr/bin/qemu-aarch64-static ] || need_apt+=(qemu-user-static)
# a real 3-member etcd cluster on loopback for the fleet tests (tests/etcd_cluster.py)
command -v etcd >/dev/null || need_apt+=(etcd-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: need root to install ${need_apt[*]} (run with sudo)" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  # The package enables an etcd of its own on this machine: the tests start their own cluster.
  if [[ " ${need_apt[*]} " == *" etcd-server "* ]] && command -v systemctl >/dev/null; then
    systemctl disable --now etcd.service >/dev/null 2>&1 || true
  fi
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
