#!/usr/bin/env bash
# Staging payloads larger than one device call (tools/gpu/README.md#staging): a payload (wheels, a
# GGUF) is packed here into parts that each fit beside the working tree in a call, the parts travel
# in consecutive calls to the warm machine (each call carries some parts and the manifest), and the
# last call unpacks them there, every part and the whole checked against their sha256.
#
#   stage.sh pack NAME [--part-size SIZE] FILE...   here: tar FILE... (files or folders, by their
#                                                   base names), split into $STAGE_DIR/NAME/part-NN of
#                                                   at most SIZE (split's units: 40M = 40 MiB; default
#                                                   $PART_SIZE or 40M), write $STAGE_DIR/NAME/NAME.sha256
#                                                   (the whole tar, then each part)
#   stage.sh unpack NAME DEST                       on the device: every part present (a missing one is
#                                                   named, exit 3 at once), each part's and the whole's
#                                                   sha256 as packed (exit 4), then extract into DEST
#   stage.sh install DIR                            on the device: pip-installs the wheels in DIR offline
#                                                   (DIR/requirements.txt when packed with one, else
#                                                   every wheel in DIR) into the running python3
#   stage.sh calls NAME [TREE_BYTES]                here: which parts each device call carries so that
#                                                   the tree (default: the tracked files) + parts <= 64 MiB
#
# $STAGE_DIR defaults to .stage at the repository root (git-ignored): a device call names
# .stage/NAME/... in its carry and finds it at the same path there.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
STAGE_DIR="${STAGE_DIR:-$ROOT/.stage}"
PY="${PYTHON:-python3}"
CALL_LIMIT=$((64 * 1024 * 1024))

die() { local rc="$1"; shift; echo "stage: $*" >&2; exit "$rc"; }
usage() { sed -n '7,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

pack() {
  local name="$1"; shift
  local size="${PART_SIZE:-40M}"
  if [ "${1:-}" = "--part-size" ]; then size="$2"; shift 2; fi
  [ $# -gt 0 ] || die 2 "pack $name: no files given"
  local dir="$STAGE_DIR/$name" args=() f
  for f in "$@"; do
    [ -e "$f" ] || die 2 "pack $name: $f does not exist"
    args+=(-C "$(cd "$(dirname "$f")" && pwd)" "$(basename "$f")")
  done
  rm -rf "$dir"
  mkdir -p "$dir"
  tar -cf - "${args[@]}" | split -b "$size" -d -a 2 - "$dir/part-"
  (
    cd "$dir"
    echo "$(cat part-* | sha256sum | cut -d' ' -f1)  $name.tar"
    sha256sum part-*
  ) > "$dir/$name.sha256.tmp"
  mv "$dir/$name.sha256.tmp" "$dir/$name.sha256"
  local n total
  n=$(ls "$dir"/part-* | wc -l)
  total=$(cat "$dir"/part-* | wc -c)
  echo "stage: $name: $n part(s) of at most $size, $total bytes in all, under $dir"
}

unpack() {
  local name="$1" dest="$2"
  local dir="$STAGE_DIR/$name" manifest="$STAGE_DIR/$name/$name.sha256"
  [ -f "$manifest" ] || die 3 "unpack $name: no manifest $manifest (carry it with every call)"
  local parts missing=() p
  parts=$(tail -n +2 "$manifest" | awk '{print $2}')
  for p in $parts; do
    [ -f "$dir/$p" ] || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    die 3 "unpack $name: missing ${missing[*]} of $(echo $parts | wc -w) part(s) under $dir"
  fi
  (cd "$dir" && tail -n +2 "$name.sha256" | sha256sum --quiet -c -) \
    || die 4 "unpack $name: a part's sha256 differs from the packed one (above)"
  local whole want
  want=$(head -1 "$manifest" | cut -d' ' -f1)
  whole=$(cd "$dir" && cat $parts | sha256sum | cut -d' ' -f1)
  [ "$whole" = "$want" ] || die 4 "unpack $name: the reassembled payload's sha256 $whole is not $want"
  mkdir -p "$dest"
  (cd "$dir" && cat $parts) | tar -xf - -C "$dest"
  echo "stage: $name: $(echo $parts | wc -w) part(s) checked (sha256 $want), extracted into $dest"
}

install_wheels() {
  local dir="$1"
  [ -d "$dir" ] || die 3 "install: no folder $dir"
  ls "$dir"/*.whl >/dev/null 2>&1 || die 3 "install: no wheels in $dir"
  if [ -f "$dir/requirements.txt" ]; then
    "$PY" -m pip install --quiet --no-index --find-links "$dir" -r "$dir/requirements.txt"
  else
    "$PY" -m pip install --quiet --no-index --find-links "$dir" "$dir"/*.whl
  fi
  echo "stage: installed from $dir into $("$PY" -c 'import sys; print(sys.prefix)')"
}

calls() {
  local name="$1" tree="${2:-}"
  local dir="$STAGE_DIR/$name"
  [ -f "$dir/$name.sha256" ] || die 3 "calls $name: not packed (no $dir/$name.sha256)"
  if [ -z "$tree" ]; then
    tree=$(cd "$ROOT" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  fi
  local room=$((CALL_LIMIT - tree - $(wc -c < "$dir/$name.sha256"))) call=1 used=0 line="" p s
  echo "stage: $name: tree $tree bytes, $room bytes left per call for parts"
  for p in $(tail -n +2 "$dir/$name.sha256" | awk '{print $2}'); do
    s=$(wc -c < "$dir/$p")
    [ "$s" -le "$room" ] || die 5 "calls $name: $p ($s bytes) does not fit beside the tree: pack with a smaller --part-size"
    if [ $((used + s)) -gt "$room" ]; then
      echo "call $call: carry .stage/$name/$name.sha256$line"
      call=$((call + 1)); used=0; line=""
    fi
    used=$((used + s)); line="$line .stage/$name/$p"
  done
  echo "call $call: carry .stage/$name/$name.sha256$line"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  pack) [ $# -ge 2 ] || usage; pack "$@" ;;
  unpack) [ $# -eq 2 ] || usage; unpack "$@" ;;
  install) [ $# -eq 1 ] || usage; install_wheels "$@" ;;
  calls) [ $# -ge 1 ] || usage; calls "$@" ;;
  *) usage ;;
esac
