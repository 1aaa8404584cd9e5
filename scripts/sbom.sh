#!/usr/bin/env bash
# Software bill of materials and third-party notices for the release artefacts, into dist/
# (git-ignored): for Linux x86_64 and Windows x86_64,
#   dist/atlas-<version>-<target>.cdx.json   CycloneDX 1.5 JSON (cargo-cyclonedx): every crate
#                                            compiled into libatlas/atlas, with version, licence,
#                                            crates.io purl and checksum; build tools left out
#   dist/THIRD-PARTY-<target>.txt            their licence texts (scripts/third_party.py)
# Installs cargo-cyclonedx (cargo install --locked, from crates.io) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo cyclonedx --version >/dev/null 2>&1 || cargo install --locked --quiet cargo-cyclonedx
version=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' Cargo.toml | head -n1)
mkdir -p dist
for target in x86_64-unknown-linux-gnu x86_64-pc-windows-gnu; do
    name=atlas-$version-$target
    # SOURCE_DATE_EPOCH: the last commit's time, so the same tree gives the same file.
    SOURCE_DATE_EPOCH=$(git log -1 --format=%ct) cargo cyclonedx --quiet --format json --spec-version 1.5 \
        --no-build-deps --target "$target" --override-filename "$name.cdx"
    mv "$name.cdx.json" "dist/$name.cdx.json"
    python3 - "dist/$name.cdx.json" <<'PY'
import hashlib, json, sys, uuid
path = sys.argv[1]
bom = json.load(open(path))
assert bom["bomFormat"] == "CycloneDX", path
# cargo-cyclonedx draws a random serial number: derive it from the content instead, so the same
# tree gives the same file (and the release archives that carry it the same checksums).
bom.pop("serialNumber", None)
digest = hashlib.sha256(json.dumps(bom, sort_keys=True).encode()).hexdigest()
bom["serialNumber"] = f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, 'atlas-sbom:' + digest)}"
json.dump(bom, open(path, "w"), indent=2)
print(f"sbom: {path}: {len(bom['components'])} components")
PY
    python3 scripts/third_party.py --target "$target" --out "dist/THIRD-PARTY-$target.txt"
done
