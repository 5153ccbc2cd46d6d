# On the GPU machine: unpack this call's binaries and run the named parts.
#   bash .carry/gpu/s8/run.sh PART...   (check, bench15, bench8, base15, base8)
set -u
R=/var/tmp/s8/out; rm -rf $R; mkdir -p $R
d=.carry/gpu/s8
b=/var/tmp/s8; mkdir -p $b
for f in $d/*.xz; do n=$b/$(basename "$f" .xz); xz -dc "$f" > "$n" && chmod +x "$n"; done
libs=$(python3 -c 'import glob, os, nvidia
print(":".join(d for p in nvidia.__path__ for d in sorted(glob.glob(os.path.join(p, "*", "lib")))))' 2>/dev/null)
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee $R/gpu.txt
V15=${V15:-auto,unfused}
V8=${V8:-auto,unfused}
for part in "$@"; do
  date -u +%H:%M:%S
  case $part in
    check) $b/cuda-check 2>&1 | tee $R/cuda-check.txt | grep -v '^PASS' ; tail -1 $R/cuda-check.txt ;;
    base15) $b/cuda-bench-base --config qwen2.5-1.5b --out $R/base-15.json > $R/base-15.txt 2>&1; grep -v '^gemm' $R/base-15.txt ;;
    base8) $b/cuda-bench-base --config qwen3-8b --out $R/base-8.json > $R/base-8.txt 2>&1; grep -v '^gemm' $R/base-8.txt ;;
    bench15) $b/cuda-bench --config qwen2.5-1.5b --variants $V15 --out $R/new-15.json > $R/new-15.txt 2>&1; grep -v '^gemm' $R/new-15.txt ;;
    bench8) $b/cuda-bench --config qwen3-8b --variants $V8 --out $R/new-8.json > $R/new-8.txt 2>&1; grep -v '^gemm' $R/new-8.txt ;;
  esac
done
date -u +%H:%M:%S
tar -C $R -cf $OUT/results.tar .
