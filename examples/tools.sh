# Sourced first by every recipe: the commands `make install` puts in .venv (fairseq-train, fairseq-plugins, ...)
# are on PATH when that venv is active, or under make; otherwise this repository's .venv/bin is put on PATH,
# and where there is none the recipe stops here, saying what to do.
if ! command -v fairseq-plugins >/dev/null 2>&1; then
  if [[ -x "$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/fairseq-plugins" ]]; then
    PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.venv/bin" && pwd):$PATH"
    export PATH
  else
    echo "$0: fairseq-plugins is neither on PATH nor in this repository's .venv: run make install first" >&2
    exit 2
  fi
fi
