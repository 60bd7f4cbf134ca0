#!/usr/bin/env bash
# System packages the test suite runs for real, installed from Debian's archive when missing:
#   redis-server  shared rate limits across gateway processes (tests/unit/ratelimit/test_redis_limiter.py, tests/e2e/test_tenancy_e2e.py)
#   chromium      the playground in a headless browser, driven by Playwright (tests/e2e/test_browser_playground.py)
#   nginx-light   SSE through a buffering reverse proxy (tests/e2e/test_filters_http.py)
#   postgresql    the shared tenancy store, change feed and ledger (tests/unit/auth, tests/cluster); the tests run
#                 initdb/pg_ctl from /usr/lib/postgresql/*/bin themselves (the packaged cluster is not used)
#
# Works as root, or as a user with sudo (sudo may ask for a password once). Non-interactive (no debconf
# prompts) and safe to run again: with everything present it prints one line and exits 0.
# Exit status: 0 when all four are present afterwards; 1 when they are missing and cannot be installed
# (not root and no sudo, or apt-get failed).
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)

if [ ${#missing[@]} -eq 0 ]; then
    echo "sysdeps: redis-server, chromium, nginx and postgresql are installed (tests run Redis, PostgreSQL, headless Chromium and an nginx proxy)"
    exit 0
fi

echo "sysdeps: installing ${missing[*]} with apt-get (the tests run a real Redis, PostgreSQL, headless Chromium and an nginx SSE proxy)"

if [ "$(id -u)" -eq 0 ]; then
    as_root=(env)
elif command -v sudo >/dev/null 2>&1; then
    as_root=(sudo env)
else
    echo "sysdeps: not root and no sudo: as root, run: apt-get install -y ${missing[*]}" >&2
    exit 1
fi

# The environment is passed through env(1): a plain `VAR=value` after an empty command prefix would be
# taken as the command name by sh.
"${as_root[@]}" DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${as_root[@]}" DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}" >/dev/null

for exe in redis-server nginx; do
    command -v "$exe" >/dev/null 2>&1 || [ -x "/usr/sbin/$exe" ] || { echo "sysdeps: $exe still missing after apt-get" >&2; exit 1; }
done
[ -x /usr/bin/chromium ] || { echo "sysdeps: /usr/bin/chromium still missing after apt-get" >&2; exit 1; }
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || { echo "sysdeps: PostgreSQL's initdb still missing after apt-get" >&2; exit 1; }
echo "sysdeps: done"
