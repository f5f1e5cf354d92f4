# Sourced first by the GPU-machine scripts, before gpu_env.sh writes anything.
# Variables a script reads from the environment, refused as arguments (after
# the script's name make would take them, replacing the script's own):
#   refuse_env_args "$0" BENCH_EXTRA "$@"
refuse_env_args() {
  local script=$1 name=$2; shift 2
  for a in "$@"; do
    case "$a" in "$name"=*|EXTRA=*) echo "error: $a is read from the environment, not as an argument | got it after the script's name | expected: $name=\"...\" bash $script MODEL=..." >&2; return 2;; esac
  done
}
