#!/usr/bin/env bash
# Fills DIR (default .gpu) with what travels to a bare CUDA machine without network for the GPU checks
# (benchmarks/gpu_checks.sh installs it there; docs/megablocks.md). `make gpu-carry` runs it.
#   DIR/whl  wheels, for that image's Python 3.12, of what it lacks or holds too old: hydra and omegaconf, antlr4
#            (built here from its only source package, pure Python), transformers at the lock's version and what that
#            version needs beyond the image's (huggingface-hub 2.x and its HTTP stack, kernels)
#   DIR/src  MegaBlocks' three source packages, built there against its CUDA torch. Fetched from the index as files:
#            `pip download` would prepare their metadata, which runs their setup.py, which needs CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu}
PIP=${PIP:-.venv/bin/pip}
INDEX=${INDEX:-https://pypi.org/simple}
WHEELS=(transformers==5.25.0 huggingface-hub==2.4.0 kernels==0.19.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
        click==8.5.1 anyio==4.16.0 idna==3.20 h11==0.16.0 typing-extensions==4.16.0 tomlkit==0.15.3 hydra-core==1.3.8
        omegaconf==2.3.1)
SOURCES=(megablocks==0.10.0 stanford-stk==0.7.1 grouped_gemm==0.3.0)
mkdir -p "$DIR/whl" "$DIR/src"
"$PIP" download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR/whl" "${WHEELS[@]}"
"$PIP" wheel --quiet --no-deps -w "$DIR/whl" antlr4-python3-runtime==4.9.3
for spec in "${SOURCES[@]}"; do
  name=${spec%%==*} version=${spec##*==}
  # the index's JSON page: the source package of that version, its URL and sha256
  read -r url sha256 < <(curl -sSf -H "Accept: application/vnd.pypi.simple.v1+json" "$INDEX/$name/" | python3 -c '
import json, re, sys
name, version = sys.argv[1:]
stem = re.sub(r"[-_.]+", "_", name) + "-" + version + ".tar.gz"
found = [f for f in json.load(sys.stdin)["files"] if re.sub(r"[-_.]+", "_", f["filename"].rsplit("-", 1)[0]) + "-"
         + f["filename"].rsplit("-", 1)[1] == stem]
if not found:
    sys.exit(f"error: the index has no source package {stem}")
print(found[0]["url"], found[0]["hashes"]["sha256"])' "$name" "$version")
  file=$DIR/src/$(basename "$url")
  curl -sSf -o "$file" "$url"
  echo "$sha256  $file" | sha256sum --check --quiet
done
du -sh "$DIR"
