#!/usr/bin/env bash
# A certificate authority and a SuperLink server certificate for TLS, for demos and tests.
# In production use your organisation's CA; what matters is that the server certificate's
# subject alternative names (SANs) cover every name the SuperNodes, SuperExecs and the flwr CLI
# use to reach the SuperLink, or TLS verification fails with a hostname mismatch.
#
# Usage: docker/certs.sh [OUT_DIR] [EXTRA_SAN ...]
#   OUT_DIR    default: docker/certs (next to this script)
#   EXTRA_SAN  more names, e.g. DNS:link.hospital-network.org IP:10.1.2.3
# Writes OUT_DIR/ca.crt (give it to every site and user), OUT_DIR/ca.key (keep it offline),
# OUT_DIR/server.pem + OUT_DIR/server.key (the SuperLink's). Refuses to overwrite an existing CA.
set -euo pipefail

out="${1:-$(cd "$(dirname "$0")" && pwd)/certs}"
shift || true
sans="DNS:superlink,DNS:localhost,IP:127.0.0.1"
for extra in "$@"; do
  case "$extra" in
    DNS:?*|IP:?*) sans="$sans,$extra" ;;
    *) echo "certs.sh: extra SAN '$extra' is invalid; valid: DNS:<name> or IP:<address>" >&2; exit 2 ;;
  esac
done
command -v openssl >/dev/null || { echo "certs.sh: openssl is not installed" >&2; exit 2; }
if [ -e "$out/ca.crt" ] || [ -e "$out/ca.key" ]; then
  echo "certs.sh: $out already holds a CA; remove $out to make new certificates" >&2
  exit 2
fi
mkdir -p "$out"
umask 077  # private keys readable by their owner only

# P-384 EC keys; the extensions are the ones strict verifiers (Python >= 3.13) require.
openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-384 -sha384 -days 3650 \
  -subj "/CN=fedskew federation CA" -keyout "$out/ca.key" -out "$out/ca.crt" \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -addext "subjectKeyIdentifier=hash" 2>/dev/null

openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-384 -sha384 \
  -subj "/CN=superlink" -keyout "$out/server.key" -out "$out/server.csr" 2>/dev/null
cat > "$out/server.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=$sans
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid,issuer
EXT
openssl x509 -req -sha384 -days 825 -in "$out/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
  -CAcreateserial -extfile "$out/server.ext" -out "$out/server.pem" 2>/dev/null
rm -f "$out/server.csr" "$out/server.ext" "$out/ca.srl"
chmod 644 "$out/ca.crt" "$out/server.pem"

echo "wrote $out/ca.crt, $out/ca.key, $out/server.pem, $out/server.key (SANs: $sans)"
