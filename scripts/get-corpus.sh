#!/usr/bin/env bash
# Writes the demo corpus: the King James Bible (public domain), from Debian's bible-kjv
# package, as plain text (about 4.3 MB). Usage: scripts/get-corpus.sh OUT_FILE
set -euo pipefail
out=${1:-data/kjv.txt}
[ -s "$out" ] && exit 0
if ! command -v bible >/dev/null 2>&1; then
  echo "get-corpus: installing Debian's bible-kjv (public-domain King James text)"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends bible-kjv
fi
mkdir -p "$(dirname "$out")"
bible 'Gen1:1-Rev22:21' > "$out.tmp"
mv "$out.tmp" "$out"
echo "get-corpus: wrote $out ($(wc -c < "$out") bytes)"
