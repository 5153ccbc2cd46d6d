# On the GPU machine (session 14): gather the parts of one tar bundle (gpu-bin/s14/pNN: the
# stripped, xz'd cuda-generate and ngram, then smollm2-135m.gguf and qwen2.5-coder-0.5b.gguf,
# raw), one part carried per call and copied to /var/tmp/s14, each part's sha256 checked on
# arrival; then join, check both models' sha256 and run cuda-generate on each.
#   bash cuda/results/h200-2026-12-03-s14/run.sh p01 bins     # then p02 ... and: ... p19 real
set -u
here=$(dirname "$0")
b=/var/tmp/s14; R=$b/out; mkdir -p $b/bin $R
libs=$(python3 -c 'import glob, os, nvidia
print(":".join(d for p in nvidia.__path__ for d in sorted(glob.glob(os.path.join(p, "*", "lib")))))' 2>/dev/null)
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
gen() { # name, model file, then cuda-generate's other arguments
  local name=$1 model=$2; shift 2
  date -u +"== $name %H:%M:%S" | tee -a $R/all.txt
  RUST_LOG=warn timeout 240 $b/bin/cuda-generate --model $b/$model --max-tokens 128 \
    --transport doorbell:1000 --out $R/$name.json "$@" >$R/$name.txt 2>&1
  echo "rc $?" >>$R/$name.txt
  grep -v "^ *$" $R/$name.txt | cut -c1-400 | tail -n 40 | tee -a $R/all.txt
}
for part in "$@"; do
  date -u +"== $part %H:%M:%S" | tee -a $R/all.txt
  case $part in
    p[0-9][0-9])
      cp gpu-bin/s14/$part $b/
      (cd $b && grep " $part\$" $OLDPWD/$here/parts.sha256 | sha256sum -c) | tee -a $R/all.txt ;;
    bins) # p01 holds the binaries whole: tar stops at the part's end, after them
      tar -xf $b/p01 -C $b bin 2>/dev/null
      for f in $b/bin/*.xz; do xz -dc "$f" >"${f%.xz}" && chmod +x "${f%.xz}" && rm "$f"; done
      ls -l $b/bin | tee -a $R/all.txt
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
      echo "cpus $(nproc); $(grep -m1 'model name' /proc/cpuinfo)" | tee -a $R/gpu.txt
      ldd $b/bin/cuda-generate | grep -E "not found" ;;
    real)
      ls $b/p[0-9][0-9] | wc -l | tee -a $R/all.txt
      cat $b/p[0-9][0-9] | tar -x -C $b smollm2-135m.gguf qwen2.5-coder-0.5b.gguf || exit 1
      rm -f $b/p[0-9][0-9]
      (cd $b && sha256sum -c $OLDPWD/$here/models.sha256) | tee -a $R/all.txt || exit 1
      nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu --format=csv,noheader | tee -a $R/gpu.txt
      gen qwen05 qwen2.5-coder-0.5b.gguf --check --drafter $b/bin/ngram:4 --drafter $b/bin/ngram:2
      gen smollm2 smollm2-135m.gguf --check --drafter $b/bin/ngram:4 --drafter $b/bin/ngram:2
      gen qwen05-again qwen2.5-coder-0.5b.gguf --drafter $b/bin/ngram:4 ;;
  esac
done
date -u +"== end %H:%M:%S" | tee -a $R/all.txt
tar -C $R -cf $OUT/results.tar .
