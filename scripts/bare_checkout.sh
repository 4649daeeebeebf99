# Sourced by the device scripts: makes `import sglang_dflash` work from a bare checkout (no install). pyproject.toml
# maps sglang_dflash.kernels to kernels/ and sglang_dflash.scheduler to scheduler/, which only an install applies;
# this rebuilds that mapping with symlinks in a temp dir ($PKG_ROOT, removed on exit), puts it first on PYTHONPATH
# and changes into it: `python -m` puts the working directory first on sys.path, so the checkout's own
# sglang_dflash/ must not be the working directory. Needs $ROOT (the checkout).
PKG_ROOT=$(mktemp -d)
trap 'rm -rf "$PKG_ROOT"' EXIT
mkdir "$PKG_ROOT/sglang_dflash"
ln -s "$ROOT"/sglang_dflash/* "$ROOT/kernels" "$ROOT/scheduler" "$PKG_ROOT/sglang_dflash/"
export PYTHONPATH="$PKG_ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$PKG_ROOT" || exit 1
