#!/usr/bin/env bash
# `make demo` as a new user's machine runs it: in a throwaway copy of the tree
# (what git tracks plus untracked files it does not ignore, so no .venv and no
# build output), with no pip cache, and with pkg-config, mysql_config and
# pg_config shadowed by stubs that answer "not found". A demo dependency that
# needs a compiler or C headers fails here. Passes when the demo exits 0 and
# prints fencing tokens.
set -euo pipefail
cd "$(dirname "$0")/.."

work=$(mktemp -d "${TMPDIR:-/tmp}/dlock-fresh-check.XXXXXX")
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/tree"
# A file deleted in the work tree but still tracked is left out, as a clone of
# the committed tree would lack it too once committed.
git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [[ -e $f ]] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - | tar -xf - -C "$work/tree"

mkdir -p "$work/stubs"
for tool in pkg-config mysql_config pg_config; do
    printf '#!/bin/sh\necho "%s: not found (fresh-check stub)" >&2\nexit 127\n' "$tool" \
        >"$work/stubs/$tool"
    chmod +x "$work/stubs/$tool"
done

echo "fresh-check: make demo in $work/tree (no pip cache; pkg-config, mysql_config, pg_config stubbed)"
start=$SECONDS
if ! (cd "$work/tree" &&
      env -u VIRTUAL_ENV PATH="$work/stubs:$PATH" PIP_NO_CACHE_DIR=1 \
          make demo) >"$work/demo.log" 2>&1; then
    cat "$work/demo.log" >&2
    echo "fresh-check: FAILED: make demo exited non-zero" >&2
    exit 1
fi
if ! grep -Eq 'token [0-9]+' "$work/demo.log"; then
    cat "$work/demo.log" >&2
    echo "fresh-check: FAILED: the demo printed no fencing token" >&2
    exit 1
fi
grep -E 'token [0-9]+' "$work/demo.log" | head -n 3
echo "fresh-check: ok, make demo took $((SECONDS - start)) s"
