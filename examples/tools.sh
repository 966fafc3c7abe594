# Sourced first by every script here: the commands `make install` puts in .venv (fairseq-train, fairseq-plugins,
# ...) are on PATH when that venv is active, or under make; otherwise this repository's .venv/bin is put on PATH,
# and where there is none the script stops here, saying what to do.
if ! command -v fairseq-plugins >/dev/null 2>&1; then
  if [[ -x "$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/fairseq-plugins" ]]; then
    PATH="$(CDPATH='' cd -- "$(dirname "${BASH_SOURCE[0]}")/../.venv/bin" >/dev/null && pwd):$PATH"
    export PATH
  else
    echo "$0: fairseq-plugins is neither on PATH nor in this repository's .venv: run make install first" >&2
    [[ $- == *i* ]] && return 2  # sourced by hand into an interactive shell: leave it open
    exit 2
  fi
fi
