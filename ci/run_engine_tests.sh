#!/usr/bin/env bash
# Run one engine's test files inside its own virtualenv.  Usage: run_engine_tests.sh VENV MARKER FILES...
set -uo pipefail
venv=$1 marker=$2; shift 2
[ -f "$venv/dash-env.sh" ] && . "$venv/dash-env.sh"  # written by the setup script when the engine needs env vars
exec "$venv/bin/python" -m pytest -q -rs -m "$marker" "$@"
