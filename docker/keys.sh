#!/usr/bin/env bash
# SuperNode authentication keys, one ECDSA P-384 key pair per site.
# Each site keeps its private key (OUT_DIR/<site>); the coordinating centre registers the public
# key (OUT_DIR/<site>.pub) with `flwr supernode register OUT_DIR/<site>.pub <connection>`.
# A SuperLink started with --enable-supernode-auth refuses any SuperNode whose key is not registered.
#
# Usage: docker/keys.sh [OUT_DIR] [SITE ...]     default: docker/keys site-0 site-1 site-2
# Refuses to overwrite an existing key.
set -euo pipefail

out="${1:-$(cd "$(dirname "$0")" && pwd)/keys}"
shift || true
sites=("$@")
[ ${#sites[@]} -gt 0 ] || sites=(site-0 site-1 site-2)
command -v ssh-keygen >/dev/null || { echo "keys.sh: ssh-keygen is not installed (package openssh-client)" >&2; exit 2; }
mkdir -p "$out"
for site in "${sites[@]}"; do
  case "$site" in
    *[!A-Za-z0-9_.-]*|"") echo "keys.sh: site name '$site' is invalid; valid: letters, digits, '_', '.', '-'" >&2; exit 2 ;;
  esac
  if [ -e "$out/$site" ]; then
    echo "keys.sh: $out/$site already exists; remove it to make a new key" >&2
    exit 2
  fi
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "$site" -f "$out/$site"
  echo "wrote $out/$site (private: stays at the site) and $out/$site.pub (register it)"
done
