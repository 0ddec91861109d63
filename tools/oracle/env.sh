#!/usr/bin/env bash
# tools/oracle/env.sh RELEASE: build, once, the environment in which the key oracle runs the real
# server code for RELEASE (0.12.0: vllm-rbln 0.12.0, optimum-rbln 0.12.0, vLLM 0.30.0; 0.11.2:
# vllm-rbln 0.11.2, optimum-rbln 0.11.2, vLLM 0.24.0), and print
# its Python. Idempotent: a stamp of this script, the lock and the wheel hashes says the venv is
# current, and then nothing is downloaded or installed (well under a second).
#
# What it installs, all from the registry: the server's three wheels with --no-deps, each checked
# against the sha256 below (vLLM's is the registry's CUDA wheel: the same Python source as the
# +cpu build vllm-rbln pins, and nothing compiled of it is imported to build a configuration), and
# every other package exactly as tools/oracle/requirements-RELEASE.txt pins it, with --no-deps.
# The RBLN compiler (`rebel`) and torch-rbln are not on the registry: the stand-in's import surface
# (standin/cachemgr_standin/pymods) takes their place; tools/oracle/identity.py puts it on the path.
#
# Where: $CACHEMGR_ORACLE_DIR (default .oracle/ in the checkout, which git ignores)/RELEASE/venv.
# Time on this machine kind (2 cores): about 2 minutes the first time.
set -euo pipefail
release=${1:?usage: tools/oracle/env.sh RELEASE (0.12.0 or 0.11.2)}
here=$(cd "$(dirname "$0")/../.." && pwd)
lock=$here/tools/oracle/requirements-$release.txt
case "$release" in
  0.12.0)
    wheels=(
      "vllm==0.30.0 ef52ee58c410ead0b8afb190838fa4cbcb52075596f67862a03859d984966ac4"
      "vllm-rbln==0.12.0 0af77bcf84421b15ffbb9625b880ce2184f6afa4cc720e91dd2c904d19ee2263"
      "optimum-rbln==0.12.0 f41708005ff2233a5611bf4c38d914549403a70c9f5bd05dd6b52409ee6d20fd"
    )
    ;;
  0.11.2)
    wheels=(
      "vllm==0.24.0 2d2831aeba311292250df0132dbc4d8e9f42c654536eaec48e6fe58acb1822cf"
      "vllm-rbln==0.11.2 8d2a336776e7ae15011f4f0d928195ee1fb0fdb3d6cec5e7e6796c91278dd8b1"
      "optimum-rbln==0.11.2 b8e3802ce08d91b5e02ba917224c96e015c7cf9f6be6f124c1147d3a582e3c00"
    )
    ;;
  *)
    echo "tools/oracle/env.sh: no oracle environment for release $release (known: 0.12.0, 0.11.2)" >&2
    exit 64
    ;;
esac
root=${CACHEMGR_ORACLE_DIR:-$here/.oracle}/$release
venv=$root/venv
stamp=$venv/.cachemgr-oracle-stamp
want=$( (cat "$0" "$lock"; printf '%s\n' "${wheels[@]}") | sha256sum | cut -c1-32)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
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
