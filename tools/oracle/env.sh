#!/usr/bin/env bash
# tools/oracle/env.sh RELEASE: build, once, the environment in which the key oracle runs the real
# server code for RELEASE (a release of tools/releases/manifest.toml: its three wheels, its lock),
# and print its Python. Idempotent: a stamp of this script, the lock and the wheel hashes says the
# venv is current, and then nothing is downloaded or installed (well under a second).
#
# What it installs, all from the registry: the server's three wheels with --no-deps, each checked
# against the sha256 the manifest gives (vLLM's is the registry's CUDA wheel: the same Python source
# as the +cpu build vllm-rbln pins, and nothing compiled of it is imported to build a
# configuration), and every other package exactly as the release's lock pins it, with --no-deps.
# The RBLN compiler (`rebel`) and torch-rbln are not on the registry: the stand-in's import surface
# (standin/cachemgr_standin/pymods) takes their place; tools/oracle/identity.py puts it on the path.
#
# Where: $CACHEMGR_ORACLE_DIR (default .oracle/ in the checkout, which git ignores)/RELEASE/venv.
# Time on this machine kind (2 cores): about 2 minutes the first time.
# Exit 64: the manifest names no such release.
set -euo pipefail
release=${1:?usage: tools/oracle/env.sh RELEASE (a release of tools/releases/manifest.toml)}
here=$(cd "$(dirname "$0")/../.." && pwd)
manifest=(env PYTHONPATH="$here/testkit" python3 -m cachemgr_testkit.manifest)
rc=0
listed=$("${manifest[@]}" wheels "$release" 2>/dev/null) || rc=$?
if [ "$rc" = 64 ]; then
  echo "tools/oracle/env.sh: no oracle environment for release $release (known: $("${manifest[@]}" names -))" >&2
  exit 64
elif [ "$rc" != 0 ]; then
  "${manifest[@]}" wheels "$release" >/dev/null  # says why
  exit 1
fi
mapfile -t wheels <<<"$listed"
lock=$("${manifest[@]}" lock "$release")
root=${CACHEMGR_ORACLE_DIR:-$here/.oracle}/$release
venv=$root/venv
stamp=$venv/.cachemgr-oracle-stamp
# The stamp is of what the venv holds (the recipe's number, the lock, the wheels and their sums),
# never of this script's text: an edit here that installs the same must not delete a venv that
# other checkouts and running servers use (.oracle is shared). Bump recipe when the way of
# installing changes what ends up in the venv.
recipe=2
want=$( (echo "recipe $recipe"; cat "$lock"; printf '%s\n' "${wheels[@]}") | sha256sum | cut -c1-32)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "$venv/bin/python"
  exit 0
fi
# A completed build (it has a stamp) of another recipe or script text: current when it holds
# exactly the lock's pins and the three wheels, each installed from a file of the pinned sha256
# (pip's direct_url.json); -I: the caller's directory and PYTHONPATH (a checkout's own egg-info) are
# not the venv's. The stamp is left as it is (a checkout of another revision sharing this
# .oracle still reads its own), which costs this check, a third of a second, on every call.
if [ -f "$stamp" ] && "$venv/bin/python" -I - "$lock" "${wheels[@]}" <<'PY'; then
import importlib.metadata as md, json, re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
want = {}
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if line:
        name, _, version = line.partition("==")
        want[norm(name)] = (version, None)
for item in sys.argv[2:]:
    spec, _, sha = item.partition(" ")
    name, _, version = spec.partition("==")
    want[norm(name)] = (version, sha)
have = {norm(d.metadata["Name"]): d for d in md.distributions()}
for seed in ("pip", "setuptools", "wheel"):  # what `python -m venv` and the pip upgrade put in
    if seed not in want:
        have.pop(seed, None)
if set(have) != set(want):
    sys.exit(1)
for name, (version, sha) in want.items():
    dist = have[name]
    if dist.version != version:
        sys.exit(1)
    if sha is not None:
        url = json.loads(dist.read_text("direct_url.json") or "{}")
        if url.get("archive_info", {}).get("hashes", {}).get("sha256") != sha:
            sys.exit(1)
PY
  echo "$venv/bin/python"
  exit 0
fi
echo "tools/oracle/env.sh: building the oracle environment for $release in $venv" >&2
mkdir -p "$root/wheels"
rm -rf "$venv"
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --upgrade pip >&2
files=()
for item in "${wheels[@]}"; do
  spec=${item% *}
  sum=${item#* }
  "${pip[@]}" download --no-deps -d "$root/wheels" "$spec" >&2
  name=${spec%%==*}
  version=${spec#*==}
  file=$(find "$root/wheels" -maxdepth 1 -name "${name//-/_}-${version}-*.whl" | head -n 1)
  if [ -z "$file" ] || [ "$(sha256sum "$file" | cut -d' ' -f1)" != "$sum" ]; then
    echo "tools/oracle/env.sh: ${file:-$spec} is not the wheel the oracle was pinned to (sha256 $sum)" >&2
    exit 1
  fi
  files+=("$file")
done
"${pip[@]}" install --no-deps -r "$lock" >&2
"${pip[@]}" install --no-deps "${files[@]}" >&2
echo "$want" >"$stamp"
echo "$venv/bin/python"
