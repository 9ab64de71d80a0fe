# shellcheck shell=bash
# Sourced by scripts/bench and scripts/chaos: exports ORCA_PUSH_BUILD_REVISION, the checked-out
# commit ("-dirty" with uncommitted changes), for a release build of the gateway to name in
# `orca-push --version` and the bench to record as the JSON's `gateway_revision`. Without git it
# exports nothing, and the build names no revision. Only release builds get it: the tests' debug
# builds would otherwise be rebuilt after every commit.
export_build_revision() {
  local revision
  if revision=$(git rev-parse --short HEAD 2>/dev/null); then
    git diff --quiet HEAD 2>/dev/null || revision="$revision-dirty"
    export ORCA_PUSH_BUILD_REVISION="$revision"
  fi
}
