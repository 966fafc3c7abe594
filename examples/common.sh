# Shell helpers shared by the recipes in examples/ (sourced; defines functions only).
#   record CMD...  run CMD and append it (once) to $COMMANDS, the provenance bench reads with --provenance
#   stage NAME     true when NAME is one of the words of $STAGES

record() {
  local line
  line=$(printf '%q ' "$@")
  grep -qxF -- "$line" "$COMMANDS" 2>/dev/null || echo "$line" >> "$COMMANDS"
  "$@"
}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
