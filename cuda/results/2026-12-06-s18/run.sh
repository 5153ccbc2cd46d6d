# On the GPU machine: unpack this call's binaries and run the named parts.
#   bash gpu-bin/s18/run.sh PART...
set -u
R=/var/tmp/s18/out; rm -rf $R; mkdir -p $R
d=gpu-bin/s18
b=/var/tmp/s18; mkdir -p $b
for f in $d/*.xz; do n=$b/$(basename "$f" .xz); xz -dc "$f" > "$n" && chmod +x "$n"; done
libs=$(python3 -c 'import glob, os, nvidia
print(":".join(d for p in nvidia.__path__ for d in sorted(glob.glob(os.path.join(p, "*", "lib")))))' 2>/dev/null)
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee $R/gpu.txt
V15=${V15:-auto}
V8=${V8:-auto}
N=0
NCU="ncu --clock-control none --metrics gpu__time_duration.sum --csv"
for part in "$@"; do
  N=$((N+1))
  date -u +%H:%M:%S
  case $part in
    check) $b/cuda-check 2>&1 | tee $R/cuda-check.txt | grep -v '^PASS' ; tail -1 $R/cuda-check.txt ;;
    base15) $b/cuda-bench-base --config qwen2.5-1.5b --out $R/base-15-$N.json > $R/base-15-$N.txt 2>&1; grep -v '^gemm' $R/base-15-$N.txt ;;
    base8) $b/cuda-bench-base --config qwen3-8b --out $R/base-8-$N.json > $R/base-8-$N.txt 2>&1; grep -v '^gemm' $R/base-8-$N.txt ;;
    new15) $b/cuda-bench --config qwen2.5-1.5b --variants $V15 --out $R/new-15-$N.json > $R/new-15-$N.txt 2>&1; grep -v '^gemm' $R/new-15-$N.txt ;;
    new8) $b/cuda-bench --config qwen3-8b --variants $V8 --out $R/new-8-$N.json > $R/new-8-$N.txt 2>&1; grep -v '^gemm' $R/new-8-$N.txt ;;
    gemm15) grep '^gemm' $R/new-15-*.txt | grep -E 'w16|<- step' | head -80 ;;
    gemm8) grep '^gemm' $R/new-8-*.txt | grep -E 'w16|<- step' | head -80 ;;
    ncu15) # one 1-row forward at 512 and one 16-row window, every kernel timed alone
      S="--config qwen2.5-1.5b --skip-gemm --variants auto --decode-tokens 2 --windows 1,16 --reps 1 --copy-mib 64"
      $NCU -k regex:"attn|skinny|argmax|embed|rmsnorm" --launch-skip 5504 --launch-count 172 $b/cuda-bench $S > $R/ncu-15-1.csv 2>$R/ncu-15-1.err
      $NCU -k regex:"attn|skinny|argmax|embed|rmsnorm" --launch-skip 6708 --launch-count 172 $b/cuda-bench $S > $R/ncu-15-16.csv 2>$R/ncu-15-16.err
      tail -3 $R/ncu-15-1.err; python3 gpu-bin/s18/ncu_sum.py $R/ncu-15-1.csv $R/ncu-15-16.csv ;;
    ncubase15)
      $NCU -k regex:"attn|argmax|embed|rmsnorm" --launch-skip 1888 --launch-count 59 $b/cuda-bench-base --config qwen2.5-1.5b --decode-tokens 2 --windows 1,16 --reps 1 --copy-mib 64 --variants auto > $R/ncub-15-1.csv 2>$R/ncub-15-1.err
      tail -3 $R/ncub-15-1.err; python3 gpu-bin/s18/ncu_sum.py $R/ncub-15-1.csv ;;
  esac
done
date -u +%H:%M:%S
tar -C $R -cJf $OUT/results.tar.xz .
