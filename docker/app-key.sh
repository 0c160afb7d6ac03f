#!/usr/bin/env bash
# The federation's app-signing key: an Ed25519 key pair whose holder decides which code the sites run.
# Every SuperNode starts with --trusted-entities OUT_DIR/trusted-entities.yaml and then runs only app
# bundles (FABs) signed with OUT_DIR/app-signing (`fedskew sign-app`); an unsigned app, or one signed by
# any other key, is refused at the site before any of its code starts.
#
# Usage: docker/app-key.sh [OUT_DIR] [KEY_ID]     default: docker/app-key fedskew-federation
# Writes OUT_DIR/app-signing (private: keep it with whoever approves code, never on a server or a site),
# OUT_DIR/app-signing.pub and OUT_DIR/trusted-entities.yaml (give it to every site). Refuses to overwrite.
set -euo pipefail

out="${1:-$(cd "$(dirname "$0")" && pwd)/app-key}"
key_id="${2:-fedskew-federation}"
case "$key_id" in
  *[!A-Za-z0-9_.-]*|"") echo "app-key.sh: key id '$key_id' is invalid; valid: letters, digits, '_', '.', '-'" >&2; exit 2 ;;
esac
command -v ssh-keygen >/dev/null || { echo "app-key.sh: ssh-keygen is not installed (package openssh-client)" >&2; exit 2; }
if [ -e "$out/app-signing" ]; then
  echo "app-key.sh: $out/app-signing already exists; remove it to make a new key (and re-sign every app)" >&2
  exit 2
fi
mkdir -p "$out"
ssh-keygen -q -t ed25519 -N "" -C "$key_id" -f "$out/app-signing"
printf '%s: "%s"\n' "$key_id" "$(cut -d' ' -f1,2 "$out/app-signing.pub")" > "$out/trusted-entities.yaml"
echo "wrote $out/app-signing (private), $out/app-signing.pub and $out/trusted-entities.yaml (for every site; key id $key_id)"
