#!/usr/bin/env bash
# What a host relies on, checked on the built library (docs/security.md, "Runtime behaviour"):
#   1. libatlas.so imports no socket or name-resolution function (nm -D --undefined-only). The
#      `atlas` binary does, for `atlas serve`; the library must not. And it exports exactly the
#      functions include/atlas.h declares (nm -D --defined-only): no dependency's C API.
#   2. The C host test (tests/c/host.c: load, chat, stream, cancel, unload...) run under strace
#      makes no network system call, opens every file read-only, and creates, renames or deletes
#      nothing outside $ATLAS_CACHE. Without strace: run in an empty network namespace
#      (unshare -n) if possible, else only step 1 runs (a note says so).
# Usage: scripts/check_runtime_behaviour.sh LIB HOST MODEL_DIR
set -euo pipefail
lib=$1 host=$2 model=$3

forbidden='^(socket|socketpair|connect|bind|listen|accept4?|getaddrinfo|getnameinfo|gethostbyname2?(_r)?|gethostbyaddr(_r)?|getifaddrs|send|sendto|sendmsg|sendmmsg|recv|recvfrom|recvmsg|recvmmsg|setsockopt|getsockopt|getpeername|getsockname|inet_[a-z_]+|res_[a-z_]+|__res_[a-z_]+)$'
imports=$(nm -D --undefined-only "$lib" | awk '{print $NF}' | sed 's/@.*//' | sort -u)
bad=$(grep -E "$forbidden" <<<"$imports" || true)
if [[ -n $bad ]]; then
    echo "$lib imports network functions: $(echo $bad)" >&2
    exit 1
fi
echo "runtime: $lib imports $(wc -l <<<"$imports") functions, none for sockets or name resolution"
exports=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TtWwDdBbRr]$/ {print $NF}' | sed 's/@.*//' | sort -u)
declared=$(grep -o '\batlas_[a-z_]*(' "$(dirname "$0")/../include/atlas.h" | tr -d '(' | sort -u)
if [[ $exports != "$declared" ]]; then
    echo "$lib exports [$(echo $exports)], include/atlas.h declares [$(echo $declared)]" >&2
    exit 1
fi
echo "runtime: $lib exports the $(wc -l <<<"$exports") functions of include/atlas.h and nothing else"

cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
if command -v strace >/dev/null && strace -f -qq -o /dev/null true 2>/dev/null; then
    ATLAS_CACHE=$cache/cache strace -f -qq -o "$cache/trace" \
        -e trace=%network,open,openat,openat2,creat,mkdir,mkdirat,rename,renameat,renameat2,unlink,unlinkat,rmdir,truncate,link,linkat,symlink,symlinkat,chmod,fchmodat \
        "$host" "$lib" "$model" >"$cache/out" 2>&1 || {
        cat "$cache/out" >&2
        exit 1
    }
    python3 - "$cache/trace" "$cache/cache" <<'EOF'
import re, sys
trace, cache = sys.argv[1], sys.argv[2]
network = {"socket", "socketpair", "connect", "bind", "listen", "accept", "accept4", "sendto", "sendmsg",
           "sendmmsg", "recvfrom", "recvmsg", "recvmmsg", "setsockopt", "getsockopt", "getpeername",
           "getsockname", "shutdown"}
problems, opens = [], 0
for line in open(trace):
    m = re.match(r"\d+\s+(\w+)\((.*)", line)
    if not m:
        continue
    call, args = m.groups()
    paths = re.findall(r'"((?:[^"\\]|\\.)*)"', args)
    outside = [p for p in paths if not p.startswith(cache)]
    if call in network:
        problems.append("network: " + line.strip())
    elif call in ("open", "openat", "openat2", "creat"):
        opens += 1
        if call == "creat" or re.search(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC|O_APPEND", args):
            if outside:
                problems.append("opened for writing: " + line.strip())
    elif outside:
        problems.append("changed a file: " + line.strip())
if problems:
    print("\n".join(problems), file=sys.stderr)
    sys.exit(1)
print(f"runtime: the C host test under strace: no network call, {opens} opens all read-only, nothing changed outside ATLAS_CACHE")
EOF
elif unshare -n true 2>/dev/null || unshare -rn true 2>/dev/null; then
    flag=-n
    unshare -n true 2>/dev/null || flag=-rn
    ATLAS_CACHE=$cache/cache unshare $flag "$host" "$lib" "$model" >"$cache/out" 2>&1 || {
        cat "$cache/out" >&2
        exit 1
    }
    echo "runtime: no strace here; the C host test passed in an empty network namespace (unshare $flag)"
else
    echo "runtime: note: neither strace nor unshare works here; only the library's imports were checked"
fi
