#!/usr/bin/env bash
# FederatedFactory on the textured shapes, on one CUDA GPU: what the CPU cannot train in reasonable time.
#
#   bash bench/gpu_factory.sh OUT SEARCH [SECONDS_PER_GENERATOR]
#
# SEARCH is one in-process search (bench.factory_search) of 10 single-class silos, seed 0 (SEEDS), against the
# same small CNN trained 60 epochs on the pooled real images, the server classifier at 20 and at 60 epochs (the
# guided searches at 60 only, their variants most telling first, so a search stopped early keeps those; every
# unguided variant sets factory.guide-steps=0, as generators wider than the CPU preset are guided by default):
#   gpu32px   32 px, the paper's generator architecture (factory.generator='gpu-32px': 128 channels,
#             4 levels, 3 blocks, ~50 M parameters), each generator trained SECONDS_PER_GENERATOR
#             seconds (default 18; --generator-seconds sets factory.generator-images from the measured
#             images/s; the paper trains 25 M images);
#   cpu64ch   32 px, the CPU preset four times as wide (factory.generator-channels=64), the same seconds;
#   preset64  64 px, every key at its default (the CPU preset: 4.7 CPU hours a library on a 2-core machine);
#   guided16  16 px, the 32-channel library at lr 0.04 (GUIDED_STEPS steps, default 800) with 1,000 images
#             a class and autoguidance (factory.guide-steps=200, factory.guidance-weight=2), each alone and
#             together (an 800-step library takes 49 minutes of one CPU thread);
#   guided32, guided64  the same recipe at 32 px and at 64 px;
#   all       gpu32px, cpu64ch and preset64.
# SEARCH may list several, comma-separated: they run side by side on the one GPU (each slower than alone).
# SEEDS (default 0) are the seeds every search runs, one after another.
# Within a search, SITE_WORKERS sites (default 5) train their generators side by side in worker processes:
# a small generator is bound by its kernel launches, so the GPU has room for several.
# Each search writes OUT/<name>/ (results.json, results.md, sample grids, generator-calibration.json) and
# OUT/<name>.log, and is stopped after SEARCH_TIMEOUT_S seconds (default 480); OUT/factory-gpu.tar.gz
# holds every search's folder without the generator weights.
set -u
usage="usage: bash bench/gpu_factory.sh OUT gpu32px|cpu64ch|preset64|guided16|guided32|guided64|all|A,B,... [SECONDS_PER_GENERATOR]"
out=${1:?$usage}
which=${2:?$usage}
seconds=${3:-18}
[ "$which" = all ] && which=gpu32px,cpu64ch,preset64
IFS=, read -ra searches <<<"$which"
for name in "${searches[@]}"; do
    case $name in
        gpu32px | cpu64ch | preset64 | guided16 | guided32 | guided64) ;;
        *) echo "SEARCH must be gpu32px, cpu64ch, preset64, guided16, guided32, guided64, all or a comma-separated list of them, got '$name'" >&2; exit 2 ;;
    esac
done
[[ ${SEEDS:-0} =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "SEEDS must be comma-separated integers, got '${SEEDS}'" >&2; exit 2; }
[[ ${GUIDED_STEPS:-800} =~ ^[1-9][0-9]*$ ]] || { echo "GUIDED_STEPS must be a positive integer, got '${GUIDED_STEPS}'" >&2; exit 2; }
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.is_available())" >>"$out/gpu.txt" 2>&1
seeds=${SEEDS:-0}
tag=seed${seeds//,/-}
common=(--dataset shapes --seeds "$seeds" --threads 4 --site-workers "${SITE_WORKERS:-5}" --bound-epochs 60)
default_epochs=(--variant "epochs-20:" --variant "epochs-60: factory.classifier-epochs=60")
search() {  # NAME, then factory_search arguments
    local name=$1
    shift
    PYTHONUNBUFFERED=1 timeout "${SEARCH_TIMEOUT_S:-480}" python3 -m bench.factory_search "${common[@]}" "$@" \
        --out "$out/$name" >"$out/$name.log" 2>&1
    echo "$name: exit $?" >>"$out/gpu.txt"
}
gpu32px() { search "shapes-32px-gpu32px-$tag" --image-size 32 --base "factory.generator='gpu-32px' factory.guide-steps=0" --generator-seconds "$seconds" "${default_epochs[@]}"; }
cpu64ch() { search "shapes-32px-cpu64ch-$tag" --image-size 32 --base "factory.generator-channels=64 factory.guide-steps=0" --generator-seconds "$seconds" "${default_epochs[@]}"; }
preset64() { search "shapes-64px-preset-$tag" --image-size 64 "${default_epochs[@]}"; }
guided() {  # IMAGE_SIDE
    local side=$1 guide="factory.guide-steps=200 factory.guidance-weight=2" steps=${GUIDED_STEPS:-800}
    search "shapes-${side}px-wide32-lr0.04-${steps}steps-$tag" --image-size "$side" \
        --base "factory.generator-channels=32 factory.generator-lr=0.04 factory.generator-steps=$steps factory.guide-steps=0" \
        --variant "epochs-60+1000x+guide200-w2: factory.classifier-epochs=60 factory.samples-per-class=1000 $guide" \
        --variant "epochs-60: factory.classifier-epochs=60" \
        --variant "epochs-60+1000x: factory.classifier-epochs=60 factory.samples-per-class=1000" \
        --variant "epochs-60+guide200-w2: factory.classifier-epochs=60 $guide"
}
guided16() { guided 16; }
guided32() { guided 32; }
guided64() { guided 64; }
for name in "${searches[@]}"; do $name & done
wait
compgen -G "$out/shapes-*-$tag/" >/dev/null && (cd "$out" && tar -czf factory-gpu.tar.gz --exclude=generators shapes-*-"$tag")
cat "$out/gpu.txt"
