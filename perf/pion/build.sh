#!/usr/bin/env bash
# Builds perf/pion/main.go offline against Debian's pion/turn v2 (golang-github-pion-turn.v2-dev)
# in GOPATH mode. Debian installs import paths ending in /v2 without the /v2 directory, so a
# small GOPATH of symlinks maps them. Usage: build.sh OUTPUT
set -euo pipefail
out=${1:?output path}
here=$(cd "$(dirname "$0")" && pwd)
gopath=$(mktemp -d)
trap 'rm -rf "$gopath"' EXIT
mkdir -p "$gopath/src/github.com/pion/transport" "$gopath/src/pionturn"
ln -s /usr/share/gocode/src/github.com/pion/transport "$gopath/src/github.com/pion/transport/v2"
cp "$here/main.go" "$gopath/src/pionturn/"
cd "$gopath/src/pionturn"
GO111MODULE=off GOPATH="$gopath:/usr/share/gocode" GOCACHE="${GOCACHE:-$gopath/cache}" GOFLAGS= \
  go build -o "$out" .
