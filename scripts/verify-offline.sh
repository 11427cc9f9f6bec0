#!/bin/sh
# Check a k3ft bundle archive with stock tools only: OpenSSH's ssh-keygen, sha256sum (or
# shasum), GNU tar and POSIX sh/sed/sort/find. No Python, no k3ft.
#
#   scripts/verify-offline.sh BUNDLE.tar.gz ALLOWED_SIGNERS [PRINCIPAL]
#
# Exit 0 and "OK" when the archive holds exactly the signed files: every member a folder or a
# regular file under bundle/, each name once (even past the end-of-archive blocks or in a
# second gzip member, which GNU tar would otherwise extract silently over a signed file),
# manifest.json signed by a key of ALLOWED_SIGNERS (namespace k3ft-bundle), and every file
# on disk hashing to the manifest's root digest, which covers each file's sha256 and path, so
# a changed, missing or extra file fails. Exit 1 with "REJECTED: <reason>" otherwise.
# It checks files and signature; recomputing the verdict from them needs `k3ft verify`.
set -eu

fail() { echo "verify-offline: REJECTED: $*" >&2; exit 1; }
[ $# -ge 2 ] || { echo "usage: $0 BUNDLE.tar.gz ALLOWED_SIGNERS [PRINCIPAL]" >&2; exit 2; }
archive=$1 signers=$2 principal=${3-}
case $signers in /*) ;; *) signers=$PWD/$signers ;; esac
if command -v sha256sum >/dev/null 2>&1; then sha256() { sha256sum "$@"; }
else sha256() { shasum -a 256 "$@"; }; fi
work=$(mktemp -d) && trap 'rm -rf "$work"' EXIT

# 1. Every member GNU tar can find (-i: also after end-of-archive blocks), before extracting.
tar -tvzif "$archive" >"$work/long" 2>"$work/err" || fail "tar cannot read it: $(head -n1 "$work/err")"
tar -tzif "$archive" >"$work/names" 2>/dev/null || fail "tar cannot list it"
[ -s "$work/err" ] && fail "tar warns: $(head -n1 "$work/err")"
odd=$(cut -c1 "$work/long" | grep -v '^[-d]$' | head -n1) || true
[ -z "$odd" ] || fail "a member is not a folder or regular file (type '$odd')"
bad=$(grep -v '^bundle/' "$work/names" | head -n1) || true
[ -z "$bad" ] || fail "member outside bundle/: $bad"
grep -q -E '(^|/)\.\.(/|$)' "$work/names" && fail "a member name climbs out with '..'"
dup=$(sed 's:/$::' "$work/names" | LC_ALL=C sort | uniq -d | head -n1)
[ -z "$dup" ] || fail "member appears twice: $dup"

# 2. Extract, then check the signature over manifest.json.
mkdir "$work/x"
tar -xzif "$archive" -C "$work/x" --no-same-owner 2>"$work/err" || fail "tar cannot extract it"
cd "$work/x/bundle" || fail "no bundle/ folder"
[ -f manifest.json ] || fail "no manifest.json"
sig=attestations/manifest.json.sig
if [ -z "$principal" ]; then
  principal=$(ssh-keygen -Y find-principals -f "$signers" -n k3ft-bundle -s "$sig" \
    <manifest.json 2>/dev/null | head -n1) || fail "no key in $signers signed manifest.json"
fi
ssh-keygen -Y verify -f "$signers" -I "$principal" -n k3ft-bundle -s "$sig" \
  <manifest.json >/dev/null 2>&1 || fail "bad or untrusted signature on manifest.json"

# 3. Nothing else in attestations/, and every other file against the signed root digest.
extra=$(find attestations -type f | LC_ALL=C sort | grep -v -x \
  -e attestations/manifest.json.sig -e attestations/statement.dsse.json | head -n1) || true
[ -z "$extra" ] || fail "unsigned file $extra"
want=$(sed -n 's/.*"root_digest":"\([0-9a-f]\{64\}\)".*/\1/p' manifest.json)
[ -n "$want" ] || fail "manifest.json names no root digest"
got=$(find . -type f ! -path ./manifest.json ! -path './attestations/*' | sed 's:^\./::' |
  LC_ALL=C sort | while IFS= read -r f; do sha256 "$f"; done | sha256 | cut -d' ' -f1)
[ "$got" = "$want" ] || fail "files differ from the signed manifest (root sha256 $got, signed $want)"
echo "verify-offline: OK: files match manifest.json (root sha256 $want), signed by $principal"
