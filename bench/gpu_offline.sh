#!/bin/bash
# Packs what `bench/gpu_smoke.py` and `bench/precision.py --gpu` need for a GPU machine that has Python 3.12,
# CUDA PyTorch, transformers and peft but no package index and a small upload (64 MiB): this project's other
# dependencies as a Python 3.12 site folder, xz-compressed (about 55 MB: ray without its Java jar, dashboard
# UI, rllib, serve, data and llm; the packages such an image already has are left out), plus `.gpu/run.sh`,
# which unpacks it beside the image's torch, points .venv at the image's Python and runs both benches, each
# under a deadline, logs and results to $OUT (or .gpu/out). Build here (about 3 minutes), copy the repository
# with .gpu/ there, run `bash .gpu/run.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
plat=(--python-version 3.12 --implementation cp --only-binary=:all:)
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
pin() { grep -o "\"$1[^\"]*\"" pyproject.toml | tr -d '"'; }
.venv/bin/python -m pip download -q "${plat[@]}" -d "$work/wheels" "$(pin prefect==)" "$(pin prefect-ray)" \
    "$(pin 'ray\[default\]')" "$(pin pydantic)" "$(pin math-verify)" "$(pin datasets)"
# already in a CUDA PyTorch image (or not needed for a local run: virtualenv and py-spy serve Ray's runtime
# environments and profiler)
rm -f "$work"/wheels/{virtualenv,py_spy,numpy,pyarrow,pandas,grpcio,sympy,mpmath,hf_xet,huggingface_hub}-*.whl
.venv/bin/python -m pip install -q --no-deps --no-compile "${plat[@]}" --target "$work/site" "$work"/wheels/*.whl
rm -rf "$work"/site/ray/{jars,dashboard/client/build,rllib,serve,llm,data} "$work/site/bin"
mkdir -p .gpu
tar cf - -C "$work/site" . | xz -T0 -9 > .gpu/site312.tar.xz
rm -rf "$work"
cat > .gpu/run.sh <<'RUN'
#!/bin/bash
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-.gpu/out}; mkdir -p "$OUT"
PREFIX=$(python3 -c 'import sys; print(sys.prefix)')
mkdir -p /tmp/site && tar xJf .gpu/site312.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
rm -rf .venv && ln -s "$PREFIX" .venv
[ -x .venv/bin/python ] || ln -s python3 "$PREFIX/bin/python"
printf '#!%s/bin/python3\nimport sys\nfrom chatlearn.cli import main\nsys.exit(main())\n' "$PREFIX" > "$PREFIX/bin/chatlearn"
chmod +x "$PREFIX/bin/chatlearn"
nvidia-smi -L
python3 -c "import torch, transformers, ray, prefect, peft; print('torch', torch.__version__, torch.cuda.is_available(),
 'transformers', transformers.__version__, 'ray', ray.__version__, 'prefect', prefect.__version__)"
echo "set up in $SECONDS s"
timeout "${SMOKE_S:-320}" python3 bench/gpu_smoke.py 2>&1 | tee "$OUT/gpu_smoke.log"
cp bench/results/gpu_smoke.json "$OUT/" 2>/dev/null
echo "smoke done at $SECONDS s"
timeout "${PREC_S:-220}" python3 bench/precision.py --gpu --episodes "${EPISODES:-20}" 2>&1 | tee "$OUT/precision.log"
cp bench/results/precision-gpu.json bench/results/precision-gpu.png "$OUT/" 2>/dev/null
echo "all done at $SECONDS s"
RUN
chmod +x .gpu/run.sh
ls -la .gpu
