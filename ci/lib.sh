# Shared shell helpers for the CI scripts (sourced, not run).

# need_disk GB DIR: fail with a clear message unless DIR's filesystem has GB gigabytes free.
need_disk() {
  local want=$1 dir=$2 have
  mkdir -p "$dir"
  have=$(df -Pk "$dir" | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$have" -lt "$want" ]; then
    echo "error: $dir has ${have} GB free; this environment needs about ${want} GB. Free some disk and retry." >&2
    exit 3
  fi
}

# stamp_ok VENV KEY: true when VENV was built from the same KEY (so it can be reused).
stamp_ok() { [ -x "$1/bin/python" ] && [ "$(cat "$1/.dash-stamp" 2>/dev/null)" = "$2" ]; }
