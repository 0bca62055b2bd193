#!/usr/bin/env bash
# llama.cpp's own server tests (tools/server/tests of the llama.cpp tree in the llama-cpp-python
# sdist pinned below) against `muser serve`, through scripts/llama_server_wrapper.py.
# Needs PyPI (network); not part of CI. Run from the repository root with muser installed in the
# active Python (`. .venv/bin/activate`). Writes bench/results/llama_server_suite.json.
#   LLAMA_SUITE_DIR  scratch directory (default: ~/.cache/muser/llama-server-suite)
#   PORT             first port the tests' servers use (default: 18080)
#   JOBS             tests run at once (pytest-xdist workers; default: 2)
#   REUSE            1: consecutive tests with the same server flags share one server (see
#                    scripts/llama_server_wrapper.py; for a loaded machine; default: 0); each
#                    worker then runs whole files (pytest-xdist --dist loadfile), so that a
#                    file's tests follow one another
set -euo pipefail

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${LLAMA_SUITE_DIR:-$HOME/.cache/muser/llama-server-suite}
MUSER_PY=$(command -v python)
SDIST=$WORK/llama_cpp_python-$VERSION.tar.gz
mkdir -p "$WORK"

if [ ! -f "$SDIST" ]; then
  python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
fi
echo "$SHA256  $SDIST" | sha256sum --check --quiet

TREE=$WORK/llama.cpp
rm -rf "$TREE" && mkdir -p "$TREE"
tar xzf "$SDIST" -C "$TREE" --strip-components=3 \
  "llama_cpp_python-$VERSION/vendor/llama.cpp/tools/server/tests" \
  "llama_cpp_python-$VERSION/vendor/llama.cpp/models/templates"
TESTS=$TREE/tools/server/tests

if [ ! -x "$WORK/venv/bin/python" ]; then
  python -m venv "$WORK/venv"
  "$WORK/venv/bin/python" -m pip install --quiet -r "$TESTS/requirements.txt"
fi

# NOTE: PYTHONPATH: the servers run this checkout's muser whatever the active Python installed
cat > "$WORK/llama-server" <<EOF
#!/bin/sh
PYTHONPATH="$REPO" exec "$MUSER_PY" "$REPO/scripts/llama_server_wrapper.py" "\$@"
EOF
chmod +x "$WORK/llama-server"

PORT=${PORT:-18080}
export JOBS=${JOBS:-2}  # pytest-xdist workers; worker n's servers listen on PORT + 10 n
# NOTE: a server still listening there (another run's) would answer the tests in place of theirs
for ((n = 0; n < JOBS; n++)); do
  if ! "$MUSER_PY" -c "import socket, sys; socket.create_server(('127.0.0.1', int(sys.argv[1])))" \
      "$((PORT + 10 * n))" 2>/dev/null; then
    echo "port $((PORT + 10 * n)) is in use: stop what listens there or set PORT" >&2
    exit 1
  fi
done
PIDS=$WORK/server.pids
: > "$PIDS"
# NOTE: a server the tests gave up on (a start past their timeout in a session fixture) is
# never stopped by them: end the ones this run started that are still alive
end_servers() {
  while read -r pid; do
    if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q "muser serve"; then
      kill "$pid" 2>/dev/null || true
    fi
  done < "$PIDS"
}
trap end_servers EXIT

mapfile -t FILES < <("$MUSER_PY" "$REPO/scripts/llama_server_wrapper.py" --files)
cd "$TESTS"
# NOTE: the tests poll /health every 10 ms while a server starts, which on a small machine takes
# CPU from the server's startup (about 6 of its 15 CPU seconds on 2 cores): as root the tests run
# at niceness 10 and the wrapper puts each server back at the script's own
NICE=()
if [ "$(id -u)" = 0 ]; then
  NICE=(nice -n 10)
  export LLAMA_SUITE_NICE=10
fi
# NOTE: the wrapper doubles as a pytest plugin that deselects its EXCLUDED list
export LLAMA_SERVER_BIN_PATH=$WORK/llama-server LLAMA_SUITE_PORT=$PORT PYTHONPATH=$REPO/scripts \
  LLAMA_SUITE_PIDS=$PIDS LLAMA_SUITE_REUSE=${REUSE:-0}
START=$(date +%s)
"$WORK/venv/bin/python" -m pytest --collect-only -q -p no:cacheprovider -p llama_server_wrapper \
  "${FILES[@]/#/unit/}" | tail -n 1 > "$WORK/pytest.log"
DIST=load
if [ "${REUSE:-0}" = 1 ]; then DIST=loadfile; fi
"${NICE[@]}" "$WORK/venv/bin/python" -m pytest -v -n "$JOBS" --dist "$DIST" -p no:cacheprovider \
  -p llama_server_wrapper "${FILES[@]/#/unit/}" >> "$WORK/pytest.log" 2>&1 || true
echo "suite wall time: $(( $(date +%s) - START )) s" | tee -a "$WORK/pytest.log"
tail -n 2 "$WORK/pytest.log" | head -n 1
"$MUSER_PY" "$REPO/scripts/llama_server_report.py" "$WORK/pytest.log" \
  "$REPO/bench/results/llama_server_suite.json"
