#!/usr/bin/env bash
# Rewrite constraints/cpu.txt: the exact versions that a fresh CPU install of the project resolves to
# today (torch 2.13.0, the test and interop extras, sglang 0.5.23 without its dependencies), as CI and
# the README install them; and constraints/gpu.txt: the same less torch and triton, which a GPU host's
# CUDA build of torch brings (the nightly GPU workflow installs with it). Run it from anywhere; it builds
# its own venv in a temporary folder and leaves the project's .venv alone. Review the diff, run
# `pytest`, and commit both files.
set -euo pipefail
cd "$(dirname "$0")/.."
out=constraints/cpu.txt
gpu_out=constraints/gpu.txt
torch_version=2.13.0
sglang_version=0.5.23

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet "torch==$torch_version"  # first: a CPU build (see the README)
"$py" -m pip install --quiet -e ".[test,interop]"
"$py" -m pip install --quiet --no-deps "sglang==$sglang_version"

{
    echo "# Exact versions for CI and the README's CPU set-up: pip install -c $out ..."
    echo "# Written by tools/refresh-constraints.sh on $(date -u +%Y-%m-%d) with $("$py" --version) on $(uname -m);"
    echo "# do not edit by hand. pyproject.toml keeps the ranges users install from."
    echo "# torch's local label (+cpu) is dropped so that the pin matches the CPU build where an index offers"
    echo "# it and the plain release elsewhere."
    "$py" -m pip freeze --all --exclude-editable \
        | grep -viE '^(setuptools|wheel)==' \
        | sed -E 's/^(torch==[^+]+)\+.*/\1/' \
        | LC_ALL=C sort -f
} > "$out.tmp"
mv "$out.tmp" "$out"
{
    echo "# constraints/cpu.txt less torch and triton, for GPU hosts whose CUDA build of torch brings both:"
    echo "# pip install -c $gpu_out -e '.[test,gpu]' after that torch. Written by tools/refresh-constraints.sh"
    echo "# with $out; do not edit by hand."
    grep -v '^#' "$out" | grep -vE '^(torch|triton)=='
} > "$gpu_out"
echo "wrote $out ($(grep -vc '^#' "$out") pins) and $gpu_out ($(grep -vc '^#' "$gpu_out") pins)"
