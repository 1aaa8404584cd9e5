#!/usr/bin/env python3
"""Writes the third-party notice of a release artefact: every crate compiled into libatlas and
atlas for one target (normal dependencies, transitively, from `cargo metadata`; build tools such
as cbindgen are not compiled in), with its SPDX licence expression and the licence and NOTICE
files the crate ships (from cargo's registry sources, which `cargo metadata` fetches).

    scripts/third_party.py [--target TRIPLE] [--out FILE]

Defaults: the host target, dist/THIRD-PARTY-<target>.txt. scripts/build_windows.sh puts the
Windows one into its zip. cargo-deny (deny.toml) checks that every licence is one of the allowed.
"""
import argparse
import json
import os
import subprocess
import sys

NAMES = ("LICENSE", "LICENCE", "COPYING", "NOTICE", "UNLICENSE", "COPYRIGHT")


def host_target():
    out = subprocess.run(["rustc", "-vV"], check=True, capture_output=True, text=True).stdout
    return next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("host: "))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    target = args.target or host_target()
    out_path = args.out or os.path.join(root_dir, "dist", f"THIRD-PARTY-{target}.txt")

    meta = json.loads(subprocess.run(
        ["cargo", "metadata", "--locked", "--format-version", "1", "--filter-platform", target],
        check=True, capture_output=True, text=True, cwd=root_dir).stdout)
    packages = {p["id"]: p for p in meta["packages"]}
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    root = meta["resolve"]["root"]
    # Normal (not build or dev) dependencies, transitively: what is compiled into the artefacts.
    seen, todo = set(), [root]
    while todo:
        for dep in nodes[todo.pop()]["deps"]:
            if any(k["kind"] is None for k in dep["dep_kinds"]) and dep["pkg"] not in seen:
                seen.add(dep["pkg"])
                todo.append(dep["pkg"])

    me = packages[root]
    out = [
        f"Atlas {me['version']} ({target}) is licensed under {me['license']}: LICENSE-MIT, LICENSE-APACHE.",
        f"It contains the following {len(seen)} third-party crates, under their own licences (texts below).",
        "",
    ]
    for pid in sorted(seen, key=lambda i: (packages[i]["name"], packages[i]["version"])):
        p = packages[pid]
        out.append(f"  {p['name']} {p['version']}: {p.get('license') or 'see its licence file'}")
    out.append("")
    missing = []
    for pid in sorted(seen, key=lambda i: (packages[i]["name"], packages[i]["version"])):
        p = packages[pid]
        folder = os.path.dirname(p["manifest_path"])
        files = sorted(f for f in os.listdir(folder)
                       if f.upper().startswith(NAMES) and os.path.isfile(os.path.join(folder, f)))
        out.append("=" * 100)
        out.append(f"{p['name']} {p['version']}: {p.get('license') or p.get('license_file') or 'see below'}")
        if p.get("repository"):
            out.append(p["repository"])
        for f in files:
            out.append("-" * 40 + f" {f}")
            out.append(open(os.path.join(folder, f), encoding="utf-8", errors="replace").read().rstrip())
        if not files:
            missing.append(p["name"])
            out.append("(the crate ships no licence file; its licence is the SPDX expression above)")
        out.append("")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")
    note = f"; without a licence file: {', '.join(missing)}" if missing else ""
    shown = os.path.relpath(out_path, root_dir) if os.path.abspath(out_path).startswith(root_dir + os.sep) else out_path
    print(f"third_party: {len(seen)} crates in {shown}{note}", file=sys.stderr)


if __name__ == "__main__":
    main()
