#!/usr/bin/env bash
# The layering check must fail on what it forbids: a scratch tree with the real layer table and
# (1) an include from a lower folder to a higher one, (2) a folder missing from the table,
# (3) two sub-folders of one folder that include each other; and pass on a clean tree.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
check() { python3 "$here/scripts/check_layers.py" --root "$tmp"; }
mkdir -p "$tmp/docs" "$tmp/src/core" "$tmp/src/train" "$tmp/src/engine/cpu" "$tmp/src/engine/cuda"
cp "$here/docs/architecture.md" "$tmp/docs/"
echo '#include "core/a.h"' > "$tmp/src/train/t.h"
echo '#pragma once' > "$tmp/src/core/a.h"
check >/dev/null || { echo "FAIL: a clean tree was refused"; exit 1; }

echo '#include "train/t.h"' >> "$tmp/src/core/a.h"
out=$(check || true)
grep -q 'src/core/a.h:2: core/ includes train/t.h from a higher layer' <<<"$out" \
    || { echo "FAIL: an upward include passed: $out"; exit 1; }
echo '#pragma once' > "$tmp/src/core/a.h"

mkdir -p "$tmp/src/elsewhere" && echo '#pragma once' > "$tmp/src/elsewhere/x.h"
out=$(check || true)
grep -q 'folder elsewhere/ is not in the layer table' <<<"$out" \
    || { echo "FAIL: an unlisted folder passed: $out"; exit 1; }
rm -r "$tmp/src/elsewhere"

echo '#include "engine/cuda/g.h"' > "$tmp/src/engine/cpu/c.h"
echo '#include "engine/cpu/c.h"' > "$tmp/src/engine/cuda/g.h"
out=$(check || true)
grep -q 'include cycle between folders: engine/cpu <-> engine/cuda' <<<"$out" \
    || { echo "FAIL: a cycle passed: $out"; exit 1; }
echo "check_layers_test: the check refuses an upward include, an unlisted folder and a cycle"
