//! Run-time choice of the SIMD kernels of [`super::qmatmul`] and [`super::dense`].
//!
//! An [`Isa`] is a token that proves the CPU runs a set of instructions: only [`Isa::detect`],
//! [`Isa::available`] and [`Isa::selected`] make one, each after checking the CPU, so a kernel
//! handed an `Isa` may use its instructions without further checks. The paths, best first:
//!
//! ```text
//!  amx      avx512 + AMX-TILE/INT8, tiles granted by Linux  tdpbsud/tdpbssd, 8+ rows
//!  avx512   avx512f + bw + vl + vnni (+ avx2, fma, f16c)  EVEX vpdpbusd, 512-bit FMA (dense)
//!  avxvnni  avxvnni (+ avx2, fma, f16c)                   256-bit vpdpbusd (VEX)
//!  avx2     avx2 + fma + f16c                             vpmaddubsw + vpmaddwd, 256-bit FMA
//!  scalar   any CPU                                       portable Rust
//! ```
//!
//! On `avx512` every quantized type (`qmatmul/packed.rs`, `kpacked.rs`, `k6packed.rs`) runs
//! 512-bit `vpdpbusd` with one weight row per 32-bit lane. The `avxvnni` level runs the AVX2
//! builds of the packed kernels (bit-identical).
//! The `amx` level is `avx512` plus tile kernels for the quantized matmuls of 8 rows or more
//! (`qmatmul/amx.rs`): the same exact integer sums per block and the same float operations,
//! so its bits equal `avx512`'s; Linux must grant the process the tile state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once), else the level is unavailable. It is
//! opt-in (`SPECULA_ISA=amx`): [`Isa::detect`] stops at `avx512`, which was as fast or faster
//! idle at 2 threads (see its docs).
//!
//! `SPECULA_ISA=scalar|avx2|avxvnni|avx512|amx` forces a path for the whole process (benchmarks,
//! A/B runs, reproducing a CI machine); asking for one this CPU lacks is an error at model load.
//! A row's result is bit-identical whatever the number of rows in the call on every path; two
//! paths may differ from each other in the last bits.

use std::fmt;
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// The environment variable that forces a path.
pub const ENV: &str = "SPECULA_ISA";

/// An instruction-set level this CPU is known to run (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Isa(Level);

/// The levels, worst first. Matching on it is how kernels dispatch; only this module builds
/// an [`Isa`] from one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Level {
    Scalar,
    Avx2,
    AvxVnni,
    Avx512,
    Amx,
}

const LEVELS: [Level; 5] = [
    Level::Scalar,
    Level::Avx2,
    Level::AvxVnni,
    Level::Avx512,
    Level::Amx,
];

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::AvxVnni => "avxvnni",
            Level::Avx512 => "avx512",
            Level::Amx => "amx",
        }
    }

    /// Whether this CPU runs every instruction the level's kernels enable.
    fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            match self {
                Level::Scalar => true,
                Level::Avx2 => avx2,
                Level::AvxVnni => avx2 && is_x86_feature_detected!("avxvnni"),
                Level::Avx512 => {
                    avx2 && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512vnni")
                }
                Level::Amx => Level::Avx512.supported() && amx::usable(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Level::Scalar
        }
    }
}

impl Isa {
    /// The portable path, which every CPU runs.
    pub const SCALAR: Isa = Isa(Level::Scalar);

    /// The default path: the best this CPU runs (512-bit before 256-bit VNNI before AVX2),
    /// except AMX tiles, which only `SPECULA_ISA=amx` turns on. Idle on the one AMX machine
    /// we have (2-core Sapphire Rapids, 2 threads, SmolLM2 at ctx 256, three alternations),
    /// tiles were 6% slower than `avx512` at 8 rows and 1.5% faster at 16, and prefill was
    /// even; under load and on one thread they measured 13–16% cheaper at 16 rows. The bits
    /// are the same either way.
    pub fn detect() -> Isa {
        *Self::available()
            .iter()
            .rfind(|isa| isa.0 != Level::Amx)
            .expect("invariant: scalar is always available")
    }

    /// Every path this CPU runs, worst first (what the identity tests iterate over).
    pub fn available() -> Vec<Isa> {
        LEVELS
            .into_iter()
            .filter(|l| l.supported())
            .map(Isa)
            .collect()
    }

    /// The path named `name` (`scalar`, `avx2`, `avxvnni`, `avx512`, `amx`).
    ///
    /// # Errors
    /// If the name is unknown or this CPU lacks the instructions.
    pub fn named(name: &str) -> Result<Isa> {
        let names = || LEVELS.map(Level::name).join(", ");
        let level = LEVELS
            .into_iter()
            .find(|l| l.name() == name.trim())
            .ok_or_else(|| Error::InvalidRequest {
                op: ENV,
                reason: format!("unknown SIMD path '{name}' (known: {})", names()),
            })?;
        if !level.supported() {
            let have: Vec<_> = Self::available().iter().map(|i| i.name()).collect();
            return Err(Error::InvalidRequest {
                op: ENV,
                reason: format!(
                    "this CPU cannot run the '{name}' path (it runs: {})",
                    have.join(", ")
                ),
            });
        }
        Ok(Isa(level))
    }

    /// The process's path: [`ENV`] when set, else [`Isa::detect`]; decided once.
    ///
    /// # Errors
    /// If [`ENV`] names an unknown path or one this CPU lacks (every call reports it).
    pub fn selected() -> Result<Isa> {
        static SELECTED: OnceLock<std::result::Result<Isa, String>> = OnceLock::new();
        let chosen = SELECTED.get_or_init(|| match std::env::var(ENV) {
            Ok(name) => Isa::named(&name).map_err(|e| e.to_string()),
            Err(_) => Ok(Isa::detect()),
        });
        chosen
            .clone()
            .map_err(|reason| Error::InvalidRequest { op: ENV, reason })
    }

    /// The path's name, as [`ENV`] spells it.
    pub fn name(self) -> &'static str {
        self.0.name()
    }

    /// The level, for the kernels' dispatch.
    pub(crate) fn level(self) -> Level {
        self.0
    }
}

/// Whether this CPU has AMX-TILE and AMX-INT8 and the kernel lets this process use the tiles.
#[cfg(target_arch = "x86_64")]
mod amx {
    use std::sync::OnceLock;

    /// CPUID leaf 7, EDX: AMX-TILE (bit 24) and AMX-INT8 (bit 25).
    fn cpu_has_amx() -> bool {
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        edx >> 24 & 1 == 1 && edx >> 25 & 1 == 1
    }

    /// Asks Linux once for the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
    /// XFEATURE_XTILEDATA)`); the grant holds for every thread of the process. Other systems,
    /// and kernels that refuse, leave the `amx` path unavailable.
    pub(super) fn usable() -> bool {
        static GRANTED: OnceLock<bool> = OnceLock::new();
        *GRANTED.get_or_init(|| cpu_has_amx() && request_tiles())
    }

    #[cfg(target_os = "linux")]
    fn request_tiles() -> bool {
        const SYS_ARCH_PRCTL: i64 = 158;
        const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
        const XFEATURE_XTILEDATA: i64 = 18;
        let ret: i64;
        // SAFETY: the arch_prctl system call with these arguments only changes this process's
        // permitted extended-state set; it reads and writes no memory of ours.
        unsafe {
            std::arch::asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret == 0
    }

    #[cfg(not(target_os = "linux"))]
    fn request_tiles() -> bool {
        false
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod amx {
    pub(super) fn usable() -> bool {
        false
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detect_is_the_best_available_and_scalar_always_runs() {
        let all = Isa::available();
        assert_eq!(all[0], Isa::SCALAR);
        let best = *all.iter().rfind(|i| i.level() != Level::Amx).unwrap();
        assert_eq!(Isa::detect(), best, "the best path, AMX only when asked");
        assert!(all.windows(2).all(|w| w[0] < w[1]));
        for isa in &all {
            assert_eq!(Isa::named(isa.name()).unwrap(), *isa);
        }
    }

    #[test]
    fn unknown_or_missing_paths_are_refused_with_the_reason() {
        let err = Isa::named("sse9").unwrap_err().to_string();
        assert!(err.contains("unknown SIMD path 'sse9'"), "{err}");
        assert!(err.contains("avx512"), "{err}");
        for level in LEVELS.into_iter().filter(|l| !l.supported()) {
            let err = Isa::named(level.name()).unwrap_err().to_string();
            assert!(err.contains("cannot run"), "{err}");
        }
    }

    /// The choice follows the CPU: `avx512` needs avx512f as well as VNNI (the EVEX kernels
    /// enable it), and it wins over 256-bit AVX-VNNI when a CPU has both; `amx` is available
    /// where the tiles are usable, but never the default.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_512_bit_path_needs_avx512f_and_wins() {
        let has = |f: &str| match f {
            "avx512f" => is_x86_feature_detected!("avx512f"),
            "avx512vnni" => is_x86_feature_detected!("avx512vnni"),
            "avx512bw" => is_x86_feature_detected!("avx512bw"),
            "avx512vl" => is_x86_feature_detected!("avx512vl"),
            "avx2" => is_x86_feature_detected!("avx2"),
            _ => unreachable!(),
        };
        let full = ["avx2", "avx512f", "avx512bw", "avx512vl", "avx512vnni"]
            .iter()
            .all(|f| has(f));
        let best = Isa::detect().level();
        assert_eq!(best == Level::Avx512, full);
        let offered = Isa::available().iter().any(|i| i.level() == Level::Amx);
        assert_eq!(offered, full && amx::usable());
    }
}
