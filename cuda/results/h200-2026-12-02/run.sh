# On the GPU machine: unpack this session's binaries, gather the SmolLM2 parts, run the named
# parts. bash cuda/results/h200-2026-12-02/run.sh PART... (bins, p1..p4, rtt, peer, real)
set -u
b=/var/tmp/s9; R=$b/out; mkdir -p $b/bin $R
libs=$(python3 -c 'import glob, os, nvidia
print(":".join(d for p in nvidia.__path__ for d in sorted(glob.glob(os.path.join(p, "*", "lib")))))' 2>/dev/null)
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
for part in "$@"; do
  date -u +"== $part %H:%M:%S"
  case $part in
    bins)
      for f in gpu-bin/s9/bin/*.xz; do n=$b/bin/$(basename "$f" .xz); xz -dc "$f" >"$n" && chmod +x "$n"; done
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee $R/gpu.txt
      echo "cpus $(nproc); $(grep -m1 'model name' /proc/cpuinfo)" | tee -a $R/gpu.txt ;;
    p[1-4]) cp gpu-bin/s9/$part/* $b/ ;;
    rtt)
      $b/bin/drafter-rtt --drafter $b/bin/ngram --drafter $b/bin/echo-drafter \
        --transport socket,doorbell:0,doorbell:50,doorbell:1000 --rounds 2000 --forward-us 700 \
        --json $R/rtt.json 2>&1 | tee $R/rtt.txt ;;
    peer)
      PYTHONUNBUFFERED=1 timeout 100 python3 scripts/gpu/torch_step.py --out $R/torch.json \
        --context 512 --decode-tokens 128 --presets qwen2.5-1.5b >$R/torch.txt 2>&1; tail -8 $R/torch.txt
      timeout 60 $b/bin/cuda-bench --config qwen2.5-1.5b --variants auto --out $R/cuda-15.json >$R/cuda-15.txt 2>&1
      grep -v '^gemm' $R/cuda-15.txt | tail -12 ;;
    real)
      cat $b/smollm2.part1 $b/smollm2.part2 $b/smollm2.part3 $b/smollm2.part4 >$b/smollm2-135m.gguf
      echo "$SHA  $b/smollm2-135m.gguf" | sha256sum -c || exit 1
      SPECULA_DRAFTER_WEIGHTS=$PWD/drafters/weights timeout 200 $b/bin/cuda-generate \
        --model $b/smollm2-135m.gguf --check --drafter $b/bin/ngram:4 --drafter $b/bin/mtp:2 \
        --drafter $b/bin/dflash:4 --transport socket,doorbell --max-tokens 128 \
        --out $R/real-smollm2.json >$R/real-smollm2.txt 2>&1; echo "rc $?"; cat $R/real-smollm2.txt ;;
  esac
done
date -u +"== end %H:%M:%S"
tar -C $R -cf $OUT/results.tar .
