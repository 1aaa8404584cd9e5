#!/usr/bin/env bash
# End-to-end test of `atlas serve` with the official openai Python client, on the tiny fixture
# model. Uses the binary the build already made (target/release/atlas); it does not build.
set -euo pipefail
cd "$(dirname "$0")/.."

bin=target/release/atlas
model=tests/fixtures/models/chat_tiny
if [ ! -x "$bin" ]; then
    echo "$bin is missing: run cargo build --release first" >&2
    exit 1
fi
pip install --quiet --disable-pip-version-check --root-user-action=ignore openai

log=$(mktemp -t atlas-serve.XXXXXX.log)
# Port 0: the server takes a free port and prints it.
"$bin" serve --model "$model" --port 0 2>"$log" &
server=$!
stop_server() {
    if kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server" 2>/dev/null || true
        wait "$server" 2>/dev/null || true
    fi
}
trap 'stop_server; rm -f "$log"' EXIT

healthy() {
    python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=2)" "$1" 2>/dev/null
}
base=
for _ in $(seq 1 300); do
    if ! kill -0 "$server" 2>/dev/null; then
        echo "the server exited:" >&2
        cat "$log" >&2
        exit 1
    fi
    base=$(sed -n 's|^listening on \(http://[^ ]*\).*|\1|p' "$log" | head -n 1)
    if [ -n "$base" ] && healthy "$base"; then
        break
    fi
    base=
    sleep 0.1
done
if [ -z "$base" ]; then
    echo "the server did not become healthy in 30 s:" >&2
    cat "$log" >&2
    exit 1
fi

status=0
ATLAS_BASE_URL="$base/v1" ATLAS_SERVER_LOG="$log" ATLAS_BIN="$bin" ATLAS_MODEL="$model" \
    python3 tests/serve_openai.py || status=$?

# A clean stop on SIGTERM is part of the test.
kill -TERM "$server"
if ! wait "$server"; then
    echo "the server did not exit cleanly on SIGTERM" >&2
    status=1
fi
if [ "$status" -ne 0 ]; then
    echo "--- server log ---" >&2
    cat "$log" >&2
fi
exit "$status"
