#!/usr/bin/env bash
# The design's own scenario, live: a lock holder is paused (SIGSTOP) past its lease, another client takes
# the lock and writes, the paused holder wakes up and writes with its old token, and the fenced store
# refuses it. Needs a running dev cluster (`holdfast dev`) and `holdfast` on PATH
# (cargo build --release -p holdfast && export PATH=$PWD/target/release:$PATH).
set -euo pipefail
work=$(mktemp -d)
store=127.0.0.1:7399
cleanup() { kill "$store_pid" 2>/dev/null || true; kill -CONT "$a_pid" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

holdfast fence-store --listen "$store" --data "$work/fence.log" 2>/dev/null &
store_pid=$!
sleep 0.5

echo "A: acquires demo/acct with a 3 s TTL, learns its token, then freezes before writing"
holdfast lock demo/acct --ttl 3s -- sh -c "echo \$HOLDFAST_TOKEN > $work/a.token; kill -STOP \$\$; \
    holdfast fence-write demo/acct written-by-A --store $store" &
a_pid=$!
while [ ! -s "$work/a.token" ]; do sleep 0.1; done
kill -STOP "$a_pid"   # A's session holder freezes too: no more keepalives
echo "A: holds token $(cat "$work/a.token") and is now paused (SIGSTOP)"

echo "B: waits for the lock (A's session expires after its TTL), then writes"
holdfast lock demo/acct --wait 30s -- sh -c "echo B: got token \$HOLDFAST_TOKEN; \
    holdfast fence-write demo/acct written-by-B --store $store"

echo "A: wakes up (SIGCONT) and writes with its old token"
writer=$(pgrep -P "$a_pid" sh || true)
[ -n "$writer" ] && kill -CONT "$writer"
kill -CONT "$a_pid"
wait "$a_pid" || echo "A: holdfast lock exited with $? (75: the lease was lost)"

echo "the store now holds: $(holdfast fence-read demo/acct --token 999999999 --store $store)"
