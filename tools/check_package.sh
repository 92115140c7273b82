#!/usr/bin/env bash
# learncb as a user installs it, not as an editable checkout: build the wheel, install it in a new venv (torch first,
# from the pinned CPU build), import every module of learncb by name and run `learncb-demo` from a folder outside the
# source tree. An editable install hides a subpackage the wheel leaves out. (`pip install .` builds this same wheel
# with the same backend, so it is not installed a second time.)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python -m pip wheel -q --no-deps -w "$work/dist" "$root"
wheel=$(ls "$work"/dist/learncb-*.whl)
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --no-compile torch==2.13.0     # no .pyc for each of torch's files: 40 s less (two imports here)
modules=$(cd "$root" && find learncb -name '*.py' ! -name '_*.py' | sed 's/\.py$//; s#/#.#g' | sort | tr '\n' ' ')

check() {   # $1: how it was installed
  cd "$work"                                   # not the checkout: its learncb/ must not be the one imported
  "$py" - "$modules" <<'EOF'
import importlib, sys, learncb
where = learncb.__file__
assert 'site-packages' in where, f"learncb was imported from {where}, not from the installed package"
names = sys.argv[1].split()
for name in names: importlib.import_module(name)
import learncb.all
print(f"   {len(names)} modules imported from {where.rsplit('/learncb/', 1)[0]}")
EOF
  "$work/venv/bin/learncb-demo" --epochs 3 --target 0.5 --plot "$work/loss.png" | tail -1
  echo "ok: $1"
}

"$py" -m pip install -q --no-compile "$wheel"
check "the wheel ($(basename "$wheel"))"
