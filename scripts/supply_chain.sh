#!/usr/bin/env bash
# Supply-chain checks with cargo-deny (deny.toml), as CI runs them:
#   licenses   every crate's licence is one of deny.toml's allowed list (all compatible with
#              MIT OR Apache-2.0); cbindgen (MPL-2.0) is a build tool, excepted by name
#   bans       two versions of one crate are reported (warnings: they come from our dependencies)
#   sources    crates.io only: no git dependencies, no other registry
#   advisories the RustSec database (github.com/rustsec/advisory-db) when it can be fetched; else
#              a copy fetched earlier ($CARGO_HOME/advisory-dbs), offline; else skipped with a note
# Installs cargo-deny (cargo install --locked, from crates.io) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo deny --version >/dev/null 2>&1; then
    echo "supply_chain: installing cargo-deny" >&2
    cargo install --locked --quiet cargo-deny
fi
cargo deny --locked check --hide-inclusion-graph licenses bans sources

if timeout 30 git ls-remote --exit-code https://github.com/rustsec/advisory-db HEAD >/dev/null 2>&1; then
    timeout 300 cargo deny --locked check --hide-inclusion-graph advisories
elif compgen -G "${CARGO_HOME:-$HOME/.cargo}/advisory-dbs/*/crates" >/dev/null; then
    echo "supply_chain: note: github.com is unreachable; advisories checked against the copy of the RustSec database in ${CARGO_HOME:-$HOME/.cargo}/advisory-dbs"
    cargo deny --locked --offline check --hide-inclusion-graph advisories
else
    echo "supply_chain: note: advisories NOT checked: the RustSec database (github.com/rustsec/advisory-db) is unreachable from here and no copy exists"
fi
