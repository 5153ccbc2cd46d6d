# On the GPU machine (session 11): unpack the binaries, gather the SmolLM2 parts, run the named
# parts. Carried as gpu-bin/s11 (this script, bin/*.xz, the parts of smollm2-135m.gguf.xz).
#   bash gpu-bin/s11/run.sh bins p1      # then p2, p3 ... and: bash gpu-bin/s11/run.sh pN real
set -u
b=/var/tmp/s11; R=$b/out; mkdir -p $b/bin $R
libs=$(python3 -c 'import glob, os, nvidia
print(":".join(d for p in nvidia.__path__ for d in sorted(glob.glob(os.path.join(p, "*", "lib")))))' 2>/dev/null)
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
gen() { # name, then cuda-generate's drafter arguments
  local name=$1; shift
  date -u +"== $name %H:%M:%S" | tee -a $R/all.txt
  RUST_LOG=info DFLASH_PROFILE=1 SPECULA_DRAFTER_WEIGHTS=$PWD/drafters/weights timeout 150 $b/bin/cuda-generate \
    --model $b/smollm2-135m.gguf --transport doorbell --max-tokens 128 --out $R/$name.json "$@" \
    >$R/$name.txt 2>&1
  echo "rc $?" >>$R/$name.txt
  grep -v "^ *$" $R/$name.txt | grep -E "tok/s|speed-up|rc |profile|error|Error|panic|warn|drafter:" | cut -c1-400 | tail -n 40 | tee -a $R/all.txt
}
for part in "$@"; do
  date -u +"== $part %H:%M:%S"
  case $part in
    bins)
      for f in gpu-bin/s11/bin/*.xz; do n=$b/bin/$(basename "$f" .xz); xz -dc "$f" >"$n" && chmod +x "$n"; done
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee $R/gpu.txt
      echo "cpus $(nproc); $(grep -m1 'model name' /proc/cpuinfo)" | tee -a $R/gpu.txt
      ldd $b/bin/dflash | grep -E "not found|cublas|curand|nvrtc|libcuda" ;;
    p[1-9]) cp gpu-bin/s11/$part $b/ ;;
    real)
      [ -f $b/smollm2-135m.gguf ] || cat $b/p[1-9] | xz -dc >$b/smollm2-135m.gguf
      echo "$SHA  $b/smollm2-135m.gguf" | sha256sum -c || exit 1
      export CUDA_CACHE_PATH=/var/tmp/nvcache CUDA_CACHE_MAXSIZE=4294967296
      ls ~/.nv 2>&1 | head -3
      gen dflash-cuda-first --drafter $b/bin/dflash:4 --drafter-arg=--device=cuda
      du -sh /var/tmp/nvcache 2>&1
      gen dflash-cuda --drafter $b/bin/dflash:4 --drafter-arg=--device=cuda
      gen dspark-cuda --drafter $b/bin/dflash:4 --drafter-arg=--kind=dspark --drafter-arg=--device=cuda
;;
  esac
done
date -u +"== end %H:%M:%S"
tar -C $R -cf $OUT/results.tar .
