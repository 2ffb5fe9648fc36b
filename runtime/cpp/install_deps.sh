#!/usr/bin/env bash
# Installs the system packages the C++ runtime build needs (Debian/Ubuntu, run as root).
# Idempotent and quiet: packages already installed are skipped, apt runs only if needed.
#
#   runtime/cpp/install_deps.sh
set -euo pipefail

packages=(nlohmann-json3-dev libpcre2-dev libssl-dev)
# Build tools, unless the image already provides them (possibly not through dpkg).
command -v cmake >/dev/null 2>&1 || packages+=(cmake)
command -v c++ >/dev/null 2>&1 || packages+=(g++)
command -v make >/dev/null 2>&1 || command -v ninja >/dev/null 2>&1 || packages+=(make)
command -v pkg-config >/dev/null 2>&1 || packages+=(pkg-config)

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install_deps.sh: need root to install: ${missing[*]}" >&2
  exit 1
fi

echo "install_deps.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
