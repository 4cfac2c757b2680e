#!/usr/bin/env bash
# The counts of a pytest log, from pytest's own summary line (the last "=== ... in Ns ===" line), never from
# counting PASSED markers: with -s a test's printed output precedes its PASSED on the same line or pushes it to
# the next one, so a grep of " PASSED" misses some.
#
#   bash recipes/pytest_counts.sh LOG    # prints e.g. "passed 194 failed 0 errors 0 skipped 3" and the summary line
#
# Exit status 1 when the log has no summary line (pytest was killed or crashed before it finished).
set -uo pipefail
log=${1:?usage: pytest_counts.sh LOG}
[ -r "$log" ] || { echo "pytest_counts: cannot read $log"; exit 2; }
summary=$(grep -E '^=+ .* in [0-9.]+s( \([0-9:]+\))? =+$' "$log" | tail -n 1)
if [ -z "$summary" ]; then
  echo "pytest summary: none in $log (pytest did not finish)"
  exit 1
fi
count() {  # $1 = the word pytest uses (passed, failed, error, skipped, ...): its number in the summary, else 0
  local n
  n=$(grep -oE "[0-9]+ $1s?\b" <<<"$summary" | grep -oE '^[0-9]+')
  echo "${n:-0}"
}
echo "passed $(count passed) failed $(count failed) errors $(count error) skipped $(count skipped)"
echo "pytest summary: $summary"
