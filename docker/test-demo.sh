#!/usr/bin/env bash
# The docker-compose demo, for real, on one host: one coordinating centre (docker/server.yml) and three
# hospital sites (docker/site.yml, one compose project each) with TLS, SuperNode authentication, the fleet
# proxy and app signing. It registers the sites, runs a 2-round FedNCA-ML and a tiny FederatedFactory run
# of the signed app to finished:completed with results written, shows that neither a site nor a non-root
# account of the host can reach the Control API (the operator's flwr commands run in server.yml's `operator`
# service) and that every site refuses an unsigned app, then tears everything down (images are kept).
#
# Usage (as root, from anywhere):  bash docker/test-demo.sh
# Needs: python3 with this project and flwr installed (pip install -e .), openssl, ssh-keygen. Installs and
# starts Docker (Debian's docker.io, docker-compose) when absent. Where Docker Hub cannot be reached it
# builds LOCAL STAND-INS for flwr/superlink, flwr/supernode and flwr/superexec (docker/standins/Dockerfile)
# on a Debian base made with debootstrap. Each step prints its duration; a failure names the step.
# Environment: FLEET_PORT (9443), DEMO_KEEP=1 keeps the work folder.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
export FLWR_VERSION=${FLWR_VERSION:-$(python3 -c "import flwr; print(flwr.__version__)")}
export FLEET_PORT=${FLEET_PORT:-9443}
export FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0 COMPOSE_HTTP_TIMEOUT=300
WORK=$(mktemp -d /tmp/fedskew-demo.XXXXXX)
SERVER=fedskew-demo-server
SITE_IDS=(0 1 2)
BASE_IMAGE=fedskew/debian-bookworm:base
STANDIN_NOTE=""
STARTED_DOCKERD=""
HOST_IP=127.0.0.1 SITE_DATASET=fednca APP_SPEC="" RUN_ID="" RUN_STATUS="" RUN_DETAILS=""
current="start"
timings=()

log() { echo "[test-demo] $*"; }
fail() { echo "[test-demo] $*" >&2; return 1; }
NO_ENGINE=77  # the exit status where no Docker engine can run on this host: .ci/run reports the demo skipped
no_engine() { echo "[test-demo] SKIPPED: no Docker engine can run here: $*" >&2; exit "$NO_ENGINE"; }

run_step() {
  local name=$1 t0
  shift
  current=$name
  t0=$(date +%s)
  log "==> $name"
  "$@"
  timings+=("$(printf '%-34s %5d s' "$name" $(($(date +%s) - t0)))")
  log "<== $name: $(($(date +%s) - t0)) s"
}

compose_server() { docker-compose -p "$SERVER" -f docker/server.yml "$@"; }
# The operator's flwr CLI: server.yml's `operator` service on the centre's private network, working in
# OPERATOR_DIR (default: the work folder, for keys/*.pub) as this user, so that it reads this user's files.
operator() {
  OPERATOR_DIR=${OPERATOR_DIR:-$WORK} OPERATOR_USER="$(id -u):$(id -g)" compose_server run --rm -T operator flwr "$@"
}
compose_site() { local k=$1; shift; site_env "$k"; docker-compose -p "fedskew-demo-site-$k" -f docker/site.yml "$@"; }
site_env() {
  export SUPERLINK_ADDRESS="$HOST_IP:$FLEET_PORT" SITE_KEY="$WORK/keys/site-$1" CA_CERT="$WORK/certs/ca.crt"
  export TRUSTED_ENTITIES="$WORK/app-key/trusted-entities.yaml" SITE_ID=$1 NUM_SITES=${#SITE_IDS[@]}
  export SITE_DATA="$WORK/$SITE_DATASET/site-$1"
}

teardown() {
  local rc=$?
  set +eu
  server_env
  if [ "$rc" -ne 0 ] && [ "$rc" -ne "$NO_ENGINE" ]; then
    echo "[test-demo] FAILED at step: $current (exit $rc)" >&2
    if command -v docker-compose >/dev/null && docker info >/dev/null 2>&1; then
      compose_server logs --tail 40 2>&1 | tail -120 >&2
      for k in "${SITE_IDS[@]}"; do compose_site "$k" logs --tail 20 2>&1 | tail -40 >&2; done
    fi
  fi
  if command -v docker-compose >/dev/null && docker info >/dev/null 2>&1; then
    for k in "${SITE_IDS[@]}"; do compose_site "$k" down -v >/dev/null 2>&1; done
    compose_server down -v >/dev/null 2>&1
  fi
  [ -n "$STARTED_DOCKERD" ] && kill "$STARTED_DOCKERD" 2>/dev/null
  if [ "$rc" -ne 0 ] || [ -n "${DEMO_KEEP:-}" ]; then log "work folder kept: $WORK"; else rm -rf "$WORK"; fi
  log "step durations:"
  printf '  %s\n' "${timings[@]}"
  [ -n "$STANDIN_NOTE" ] && log "$STANDIN_NOTE"
  exit "$rc"
}
trap teardown EXIT
trap 'exit 143' TERM INT  # so that the EXIT trap tears down after a kill too

# --- steps ---------------------------------------------------------------------------------------------

docker_ready() {
  if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null; then
    [ "$(id -u)" = 0 ] || no_engine "Docker is not installed and this is not root: install docker.io and docker-compose"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose >/dev/null
  fi
  if ! docker info >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || no_engine "the Docker daemon is not running and this is not root: start dockerd"
    nohup dockerd >"$WORK/dockerd.log" 2>&1 &
    STARTED_DOCKERD=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || no_engine "dockerd did not start; its log: $(tail -5 "$WORK/dockerd.log")"
  fi
  HOST_IP=$(hostname -I 2>/dev/null | awk '{print $1}')
  [ -n "$HOST_IP" ] || fail "cannot tell this host's IP address (hostname -I)"
  log "docker $(docker version --format '{{.Server.Version}}'), $(docker-compose version --short); sites reach the server at $HOST_IP:$FLEET_PORT"
}

debian_base() {  # a Debian 12 root filesystem as a docker image, trusting what this host trusts
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return 0
  command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
  local root=$WORK/rootfs
  nice debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" \
    http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 || fail "debootstrap failed: $(tail -3 "$WORK/debootstrap.log")"
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then  # e.g. a TLS-inspecting proxy's CA
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
  fi
  rm -rf "$root"/var/cache/apt/archives/*.deb
  tar -C "$root" -c . | docker import - "$BASE_IMAGE" >/dev/null
  rm -rf "$root"
}

flower_images() {
  local missing=()
  for kind in superlink supernode superexec; do
    docker image inspect "flwr/$kind:$FLWR_VERSION" >/dev/null 2>&1 && continue
    timeout 120 docker pull -q "flwr/$kind:$FLWR_VERSION" >/dev/null 2>&1 || missing+=("$kind")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  STANDIN_NOTE="flwr/{${missing[*]}}:$FLWR_VERSION could not be pulled: the demo ran on LOCAL STAND-INS (docker/standins/Dockerfile), not the official images"
  log "$STANDIN_NOTE"
  debian_base
  for kind in "${missing[@]}"; do
    nice docker build -q --network host --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg FLWR_VERSION="$FLWR_VERSION" \
      --target "$kind" -t "flwr/$kind:$FLWR_VERSION" docker/standins >/dev/null
  done
}

torch_source() {  # PyTorch's CPU wheels when download.pytorch.org answers, else PyPI's (CUDA-enabled) wheels
  if timeout 20 python3 -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/torch/', timeout=15)" 2>/dev/null; then
    return 0
  fi
  # The pair installed here, so that torchvision matches torch (PyPI has no CPU-only torchvision for Linux).
  local pair
  pair=$(python3 -c "import torch, torchvision as v; print(f'torch=={torch.__version__.split(\"+\")[0]} torchvision=={v.__version__.split(\"+\")[0]}')")
  export TORCH_INDEX_URL=https://pypi.org/simple TORCH_REQUIREMENTS="$pair"
  log "download.pytorch.org is unreachable: $pair from PyPI (the CUDA build, about 2 GB more than the CPU wheels)"
}

app_images() {
  torch_source
  docker image inspect debian:bookworm-slim >/dev/null 2>&1 || timeout 120 docker pull -q debian:bookworm-slim >/dev/null 2>&1 \
    || { debian_base; export PROXY_BASE_IMAGE=$BASE_IMAGE; }
  server_env
  nice docker-compose -p "$SERVER" -f docker/server.yml build -q
}

server_env() {
  export CERTS_DIR="$WORK/certs" APP_INDEX_DIR="$WORK/app-index" SERVER_TEST_DATA="$WORK/server-test"
}

pki_and_data() {
  docker/certs.sh "$WORK/certs" "IP:$HOST_IP" >/dev/null
  docker/keys.sh "$WORK/keys" site-0 site-1 site-2 >/dev/null
  docker/app-key.sh "$WORK/app-key" >/dev/null
  # What the containers read (uid 49999); ca.key and the app-signing key stay root's and are never mounted.
  chown 49999:49999 "$WORK/certs/ca.crt" "$WORK/certs/server.pem" "$WORK/certs/server.key" "$WORK/keys"/site-? \
    "$WORK/app-key/trusted-entities.yaml"
  python3 -m fedskew.cli prepare-sites --sites 3 --dataset digits --mosaic-grid 2 --partition multilabel-skew \
    --alpha 0.1 --missing-classes 3 --seed 0 --out "$WORK/fednca" >/dev/null
  python3 -m fedskew.cli prepare-sites --sites 3 --dataset digits --mosaic-grid 0 --partition classes-per-site \
    --classes-per-site 4 --seed 0 --out "$WORK/factory" >/dev/null
  mkdir -p "$WORK/server-test"
  mv "$WORK/fednca/server-test" "$WORK/server-test/fednca"
  mv "$WORK/factory/server-test" "$WORK/server-test/factory"
  python3 -m fedskew.cli sign-app "$REPO" --key "$WORK/app-key/app-signing" --index "$WORK/app-index"
  APP_SPEC=$(python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); print(f\"@{p['tool']['flwr']['app']['publisher']}/{p['project']['name']}=={p['project']['version']}\")")
  # A site's view: the fleet proxy, with the CA certificate only (Flower wants its absolute path).
  mkdir -p "$WORK/site-home"
  python3 -c "import sys; from fedskew.testing.deploy import connection_toml; print(connection_toml(*sys.argv[1:]), end='')" \
    fedskew "$HOST_IP:$FLEET_PORT" "$WORK/certs/ca.crt" >"$WORK/site-home/config.toml"
}

server_up() {
  server_env
  compose_server up -d
  for _ in $(seq 60); do operator ls >/dev/null 2>&1 && return 0; sleep 2; done
  fail "the SuperLink's Control API did not answer the operator service: $(operator ls 2>&1 | tail -5)"
}

register_sites() {
  for k in "${SITE_IDS[@]}"; do operator supernode register "keys/site-$k.pub"; done
}

online_sites() {
  operator supernode list --format json |
    python3 -c "import json, sys; print(sum(n['status'] == 'online' for n in json.load(sys.stdin)['nodes']))"
}

sites_up() {
  SITE_DATASET=$1
  for k in "${SITE_IDS[@]}"; do compose_site "$k" up -d; done
  for _ in $(seq 90); do [ "$(online_sites)" = "${#SITE_IDS[@]}" ] && return 0; sleep 2; done
  fail "only $(online_sites) of ${#SITE_IDS[@]} SuperNodes online"
}

site_position_refused() {
  local out
  for args in "ls fedskew" "supernode register $WORK/keys/site-0.pub fedskew" "run $REPO fedskew"; do
    # shellcheck disable=SC2086
    if out=$(FLWR_HOME=$WORK/site-home flwr $args 2>&1); then fail "a site could run 'flwr $args': $out"; fi
    grep -q "403 Forbidden" <<<"$out" || fail "'flwr $args' from a site failed, but not with 403: $out"
  done
  log "a site's flwr ls / supernode register / run: 403 Forbidden from the fleet proxy"
}

control_call() {  # folder, IP, port: as user nobody, with the CA certificate in folder, a Control API call to
  # the server certificate's name `superlink` at IP:port; prints the HTTP status (000: no HTTP answer). Any HTTP
  # status from a SuperLink means its Control API was reached.
  runuser -u nobody -- curl -sS -o /dev/null -w '%{http_code}' --max-time 10 --http2 --cacert "$1/ca.crt" \
    --resolve "superlink:$3:$2" -X POST -H 'content-type: application/grpc' \
    "https://superlink:$3/flwr.proto.Control/ListRuns" 2>>"$1/curl.log" || true
}

local_user_refused() {
  local published superlink_ip code nobody state
  # Only the fleet proxy's port is published on the host.
  published=$(docker ps --filter "label=com.docker.compose.project=$SERVER" --format '{{.Names}} {{.Ports}}' | grep -- '->' || true)
  [ "$(wc -l <<<"$published")" = 1 ] && grep -q "fleet-proxy.*:$FLEET_PORT->9443/tcp" <<<"$published" \
    || fail "the centre publishes more than the fleet proxy's port $FLEET_PORT: $published"
  nobody=$(mktemp -d /tmp/fedskew-demo-nobody.XXXXXX)  # what user nobody holds: the CA certificate
  chmod 755 "$nobody" && install -m 644 "$WORK/certs/ca.crt" "$nobody/ca.crt" && install -m 666 /dev/null "$nobody/curl.log"
  # The call reaches what is reachable: the fleet proxy answers it with its 403.
  code=$(control_call "$nobody" "$HOST_IP" "$FLEET_PORT")
  [ "$code" = 403 ] || fail "user nobody's call through the fleet proxy got $code, not 403: $(cat "$nobody/curl.log")"
  superlink_ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$(compose_server ps -q superlink)")
  for address in "127.0.0.1 9093" "$superlink_ip 8000"; do
    # shellcheck disable=SC2086  # IP and port
    code=$(control_call "$nobody" $address)
    [ "$code" = 000 ] || fail "user nobody reached the SuperLink's Control API at $address (HTTP $code)"
  done
  # The SuperLink runs as the Flower images' user, its state theirs alone.
  state=$(compose_server exec -T superlink sh -c 'id -u; stat -c "%a %u" /app/state' | tr '\n' ' ')
  [ "$state" = "49999 700 49999 " ] || fail "the SuperLink's uid, then its state folder's mode and owner: $state"
  log "user nobody: 403 from the fleet proxy; no answer from 127.0.0.1:9093 nor from the SuperLink's container address $superlink_ip:8000 ($(grep '^curl:' "$nobody/curl.log" | sort -u | paste -sd ';'))"
  rm -rf "$nobody"
}

run_status() {  # status and details of run $1
  operator ls --run-id "$1" --format json |
    python3 -c "import json, sys; r = json.load(sys.stdin)['runs'][0]; print(r['status']); print(r['status-details'])"
}

flwr_run() {  # app, run config: starts the run, waits until it finished; sets RUN_ID, RUN_STATUS, RUN_DETAILS
  local out status
  out=$(operator run "$1" --run-config "$2" --format json)
  RUN_ID=$(python3 -c "import json, sys; print(json.loads(sys.argv[1])['run-id'])" "$out") || fail "flwr run: $out"
  for _ in $(seq 400); do
    status=$(run_status "$RUN_ID")
    case "$status" in finished:*) break ;; esac
    sleep 3
  done
  RUN_STATUS=$(head -1 <<<"$status")
  RUN_DETAILS=$(tail -n +2 <<<"$status")
}

results_completed() {  # results sub-folder of the ServerApp's results volume, which is its user's alone
  local summary volume
  summary=$(compose_server exec -T superexec-serverapp sh -c "cat /app/results/$1/*/summary.json")
  grep -q '"status": "completed"' <<<"$summary" || fail "no completed summary.json under /app/results/$1: $summary"
  volume=$(compose_server exec -T superexec-serverapp stat -c "%a %u" /app/results)
  [ "$volume" = "700 49999" ] || fail "the results volume's mode and owner: $volume, not 700 49999"
}

fednca_run() {
  flwr_run "$APP_SPEC" "method='fednca' num-server-rounds=2 batch-size=64 min-site-size=5 local-epochs=1 \
val-fraction=0.0 min-available-sites=3 test-data='/data/server-test/fednca' results-dir='/app/results/fednca'"
  [ "$RUN_STATUS" = "finished:completed" ] || fail "fednca run $RUN_ID: $RUN_STATUS $RUN_DETAILS"
  results_completed fednca
  log "fednca run $RUN_ID: finished:completed, results in the ServerApp's results volume"
}

factory_run() {
  flwr_run "$APP_SPEC" "$FACTORY_CONFIG results-dir='/app/results/factory'"
  [ "$RUN_STATUS" = "finished:completed" ] || fail "factory run $RUN_ID: $RUN_STATUS $RUN_DETAILS"
  results_completed factory
  log "factory run $RUN_ID: finished:completed"
}
# A generous round-timeout: on a busy 2-core host one site trained one 4-step generator in 113 s, and
# 300 s ran out before the sites uploaded.
FACTORY_CONFIG="method='factory' mosaic-grid=0 partition='classes-per-site' factory.generator-steps=4 \
factory.audit-samples=8 factory.sampler-steps=3 factory.samples-per-class=24 factory.classifier='small-cnn' \
factory.classifier-epochs=2 min-available-sites=3 round-timeout=1800.0 test-data='/data/server-test/factory'"

unsigned_refused() {
  local refusals
  OPERATOR_DIR=$REPO flwr_run . "$FACTORY_CONFIG results-dir='/app/results/unsigned'"
  [ "$RUN_STATUS" = "finished:failed" ] || fail "the unsigned run $RUN_ID was not refused: $RUN_STATUS $RUN_DETAILS"
  refusals="every site (${#SITE_IDS[@]}) failed the survey: The FAB could not be verified. Cause: the run's app carries no signature"
  grep -qF "$refusals" <<<"$RUN_DETAILS" || fail "unsigned run $RUN_ID: not refused by every site with the cause: $RUN_DETAILS"
  log "unsigned run $RUN_ID refused by every site: $RUN_DETAILS"
}

run_step "docker ready" docker_ready
run_step "Flower images (pull or stand-ins)" flower_images
run_step "certificates, keys, site data, signed app" pki_and_data
run_step "app, SuperLink and proxy images" app_images
run_step "server up" server_up
run_step "register 3 sites" register_sites
run_step "3 sites up (fednca data)" sites_up fednca
run_step "Control API refused to a site" site_position_refused
run_step "Control API refused to local users" local_user_refused
run_step "fednca, 2 rounds" fednca_run
run_step "3 sites switch to factory data" sites_up factory
run_step "factory, tiny" factory_run
run_step "unsigned app refused" unsigned_refused
current="teardown"
log "all steps passed"
