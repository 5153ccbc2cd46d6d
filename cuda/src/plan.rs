//! How the step runs its kernels: which projection kernel each projection takes, whether the
//! RMS norms are folded into the projections, and how attention is split into kernels. Plain
//! data, chosen from the shape and the GPU alone (never from the window's rows, except where
//! both choices give the same bits: every row's sums must run in one order whatever the
//! window, which keeps a window of 8 equal to 8 single steps bit for bit).

use crate::error::{Error, Result};
use crate::shape::Shape;

/// The step's projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proj {
    Qkv,
    O,
    GateUp,
    Down,
    LmHead,
}

impl Proj {
    pub const ALL: [Proj; 5] = [Proj::Qkv, Proj::O, Proj::GateUp, Proj::Down, Proj::LmHead];

    pub fn name(self) -> &'static str {
        match self {
            Proj::Qkv => "qkv",
            Proj::O => "o_proj",
            Proj::GateUp => "gate_up",
            Proj::Down => "down",
            Proj::LmHead => "lm_head",
        }
    }

    /// `(outputs, inputs)` of this projection in `shape`.
    pub fn dims(self, shape: &Shape) -> (usize, usize) {
        match self {
            Proj::Qkv => (shape.qkv_width(), shape.hidden),
            Proj::O => (shape.hidden, shape.heads * shape.head_dim),
            Proj::GateUp => (2 * shape.intermediate, shape.hidden),
            Proj::Down => (shape.hidden, shape.intermediate),
            Proj::LmHead => (shape.vocab, shape.hidden),
        }
    }

    fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| Error::Invalid(format!("unknown projection '{name}'")))
    }
}

/// The kernel of one projection: `Plain` keeps 4 chunks of 32 inputs in flight a warp; `B4`
/// is the same capped at 64 registers so that four blocks fit a multiprocessor (one wave where
/// the plain kernel needs two; more resident blocks to hide the epilogues of short blocks);
/// `Deep` keeps 8 chunks in flight (two blocks a multiprocessor); `X2`/`X4` split K over a
/// cluster of 2 or 4 blocks merged in distributed shared memory (more, evenly spread blocks
/// for grids that leave multiprocessors idle); `W16`/`W16D` take 16 output columns a block
/// (two mma tiles a warp sharing each activation load; 2 or 4 chunks of each in flight). The
/// split changes the order of the sums, and the 16-column kernels the rounding of the sums of
/// squares they hand over (so each is chosen from the shape and the GPU alone); the others give
/// the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPlan {
    Plain,
    B4,
    Deep,
    PlainX2,
    B4X2,
    PlainX4,
    B4X4,
    W16,
    W16D,
}

impl GemmPlan {
    pub const ALL: [GemmPlan; 9] = [
        GemmPlan::Plain,
        GemmPlan::B4,
        GemmPlan::Deep,
        GemmPlan::PlainX2,
        GemmPlan::B4X2,
        GemmPlan::PlainX4,
        GemmPlan::B4X4,
        GemmPlan::W16,
        GemmPlan::W16D,
    ];

    /// Blocks of a cluster that split K.
    pub fn split(self) -> usize {
        match self {
            GemmPlan::Plain | GemmPlan::B4 | GemmPlan::Deep | GemmPlan::W16 | GemmPlan::W16D => 1,
            GemmPlan::PlainX2 | GemmPlan::B4X2 => 2,
            GemmPlan::PlainX4 | GemmPlan::B4X4 => 4,
        }
    }

    /// Output columns a block.
    pub fn columns(self) -> usize {
        match self {
            GemmPlan::W16 | GemmPlan::W16D => 16,
            _ => 8,
        }
    }

    /// The grid over `n` outputs: `(n / columns, split)`.
    pub fn grid(self, n: usize) -> (u32, u32) {
        ((n / self.columns()) as u32, self.split() as u32)
    }

    /// Whether this plan covers `n` outputs in whole blocks and splits a K of `k` (32-wide
    /// chunks) evenly.
    pub fn fits(self, n: usize, k: usize) -> bool {
        n.is_multiple_of(self.columns()) && (k / 32).is_multiple_of(self.split())
    }

    /// `plain`, `b4`, `deep`, `plainx2`, `b4x2`, `plainx4`, `b4x4`, `w16` or `w16d`.
    ///
    /// # Errors
    /// [`Error::Invalid`] for another word.
    pub fn parse(text: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.to_string() == text)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "plan '{text}' (plain, b4, deep, plainx2, b4x2, plainx4, b4x4, w16, w16d)"
                ))
            })
    }
}

impl std::fmt::Display for GemmPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GemmPlan::Plain => "plain",
            GemmPlan::B4 => "b4",
            GemmPlan::Deep => "deep",
            GemmPlan::PlainX2 => "plainx2",
            GemmPlan::B4X2 => "b4x2",
            GemmPlan::PlainX4 => "plainx4",
            GemmPlan::B4X4 => "b4x4",
            GemmPlan::W16 => "w16",
            GemmPlan::W16D => "w16d",
        })
    }
}

/// What the GPU offers the plan: multiprocessors, how many blocks of the plain and the
/// 64-register projection kernels fit one, and the memory's peak bandwidth (GB/s, from the
/// driver's memory clock and bus width).
#[derive(Debug, Clone, Copy)]
pub struct Occupancy {
    pub sms: usize,
    pub fit: usize,
    pub fit_b4: usize,
    pub mem_gbps: f64,
}

/// Peak memory bandwidth (GB/s) from which the 16-column kernels pay: on the H200 (4.8 TB/s)
/// the 8-column kernels keep too few bytes in flight a warp for wide grids, on the H100
/// (3.35 TB/s) they already stream at the copy rate and the 16-column ones lose 1-2%.
pub const W16_MIN_GBPS: f64 = 4000.0;

/// Blocks of the deep kernel that fit a multiprocessor (126 registers × 256 threads).
const DEEP_FIT: usize = 2;
/// Inputs up to which a projection's blocks are short (6 chunks a warp at 1536).
const SHORT_K: usize = 2048;

/// The kernel for an `n × k` projection (`cuda-bench`'s table on the H200): on memory of at
/// least [`W16_MIN_GBPS`], 16 columns a block (`W16`, four blocks an SM) where even that grid
/// takes more than one wave (gate|up and the lm_head of both presets: 1.5B gate|up 22.2 ->
/// 19.5 µs and lm_head 147 -> 123 µs at 16 rows, the same or a little less at one); else the
/// 64-register one where its fourth block an SM fits every output tile into one wave that would
/// otherwise take two or more, and for short blocks over many waves; for grids of at most two
/// blocks a multiprocessor, K split over clusters of 2 where K is long and the doubled grid
/// still fits one wave (1.5B's down: 12.2 -> 10.4 µs), else the deep one (more loads in
/// flight); the plain one otherwise.
pub fn auto_plan(n: usize, k: usize, occ: Occupancy) -> GemmPlan {
    let tiles = n / 8;
    let waves = |fit: usize| tiles.div_ceil(fit * occ.sms);
    if occ.mem_gbps >= W16_MIN_GBPS && GemmPlan::W16.fits(n, k) && n / 16 > occ.fit_b4 * occ.sms {
        GemmPlan::W16
    } else if waves(occ.fit_b4) == 1 && waves(occ.fit) > 1 {
        GemmPlan::B4
    } else if waves(DEEP_FIT) == 1 {
        match k > SHORT_K && 2 * tiles <= occ.fit * occ.sms && GemmPlan::PlainX2.fits(n, k) {
            true => GemmPlan::PlainX2,
            false => GemmPlan::Deep,
        }
    } else if k <= SHORT_K {
        GemmPlan::B4
    } else {
        GemmPlan::Plain
    }
}

/// Windows of at most this many rows merge attention's splits inside the attention kernel
/// (one launch fewer), wider ones in a kernel of their own (one block per row and head, faster
/// from 4 rows on); both give the same bits. 0 by default: merging in the kernel at 1–2 rows
/// makes the one-row step 3-4% faster on the H200 (1.5B: 1.584 -> 1.524 ms) but the 16-row
/// window 1.32x that step instead of 1.27x (#17 asks for <= 1.3x).
pub const MERGE_IN_KERNEL_ROWS: usize = 0;

/// Everything the step's kernel sequence can vary.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOptions {
    /// The RMS norms before attention and MLP folded into the qkv and gate|up projections:
    /// embed and the residual adds (o_proj, down) hand the next projection bf16(x * w) and the
    /// rows' sums of squares (else a norm kernel each).
    pub fold_norm: bool,
    /// Rope and the K/V write inside the attention kernel (else a rope_kv kernel first).
    pub fused_attn: bool,
    /// With `fused_attn`, windows of up to this many rows merge the splits in the same kernel.
    pub merge_rows: usize,
    /// Per projection, in [`Proj::ALL`]'s order.
    pub plans: [GemmPlan; 5],
}

impl StepOptions {
    /// The default: the norms folded into the projections (the residual adds hand them over:
    /// 1.5B 1.671 -> 1.524 ms, 8B 5.39 -> 4.71 ms on the H200), rope inside attention, the
    /// merge in it up to [`MERGE_IN_KERNEL_ROWS`] rows, [`auto_plan`].
    pub fn auto(shape: &Shape, occ: Occupancy) -> Self {
        Self {
            fold_norm: true,
            fused_attn: true,
            merge_rows: MERGE_IN_KERNEL_ROWS,
            plans: Proj::ALL.map(|p| {
                let (n, k) = p.dims(shape);
                auto_plan(n, k, occ)
            }),
        }
    }

    /// Last session's sequence: 9 kernels a layer (norms, rope_kv, two attention passes), for
    /// A/B runs.
    pub fn unfused(shape: &Shape, occ: Occupancy) -> Self {
        Self {
            fold_norm: false,
            fused_attn: false,
            merge_rows: 0,
            ..Self::auto(shape, occ)
        }
    }

    pub fn plan(&self, p: Proj) -> GemmPlan {
        self.plans[Proj::ALL.iter().position(|&q| q == p).expect("in ALL")]
    }

    /// Whether a window of `rows` merges attention inside the attention kernel.
    pub fn merges_in_kernel(&self, rows: usize) -> bool {
        self.fused_attn && rows <= self.merge_rows
    }

    /// A variant by name, for benchmarks: `auto` or `unfused`, then `+` separated changes:
    /// `fold`, `nofold`, `fuse`, `nofuse`, `merge=ROWS` (the widest window merging in the
    /// attention kernel), or `PROJ=PLAN` (`down=b4`, `lm_head=plain`, `qkv=deep`).
    ///
    /// # Errors
    /// [`Error::Invalid`] for an unknown name or change.
    pub fn parse(spec: &str, shape: &Shape, occ: Occupancy) -> Result<Self> {
        let mut parts = spec.split('+');
        let mut o = match parts.next().unwrap_or("") {
            "auto" => Self::auto(shape, occ),
            "unfused" => Self::unfused(shape, occ),
            other => {
                return Err(Error::Invalid(format!(
                    "variant '{other}' (auto or unfused, then +changes)"
                )))
            }
        };
        for part in parts {
            match part {
                "fold" => o.fold_norm = true,
                "nofold" => o.fold_norm = false,
                "fuse" => o.fused_attn = true,
                "nofuse" => o.fused_attn = false,
                change => {
                    let (what, value) = change.split_once('=').ok_or_else(|| {
                        Error::Invalid(format!("change '{change}' in variant '{spec}'"))
                    })?;
                    if what == "merge" {
                        o.merge_rows = value.parse().map_err(|_| {
                            Error::Invalid(format!("merge={value}: a number of rows"))
                        })?;
                        continue;
                    }
                    let proj = Proj::parse(what)?;
                    let i = Proj::ALL.iter().position(|&q| q == proj).expect("in ALL");
                    o.plans[i] = GemmPlan::parse(value)?;
                }
            }
        }
        o.check(shape)?;
        Ok(o)
    }

    /// Whether every plan covers its projection's outputs and splits its inputs evenly in
    /// `shape`.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the first that does not.
    pub fn check(&self, shape: &Shape) -> Result<()> {
        for (p, plan) in Proj::ALL.iter().zip(&self.plans) {
            let (n, k) = p.dims(shape);
            if !plan.fits(n, k) {
                return Err(Error::Invalid(format!(
                    "plan {plan} cannot cover {}'s {n} x {k} evenly",
                    p.name()
                )));
            }
        }
        Ok(())
    }

    /// One line for reports: the switches and every plan.
    pub fn describe(&self) -> String {
        let plans: Vec<String> = Proj::ALL
            .iter()
            .zip(&self.plans)
            .map(|(p, plan)| format!("{}={plan}", p.name()))
            .collect();
        format!(
            "fold_norm={} fused_attn={} merge_rows={} {}",
            self.fold_norm,
            self.fused_attn,
            self.merge_rows,
            plans.join(" ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200: Occupancy = Occupancy {
        sms: 132,
        fit: 3,
        fit_b4: 4,
        mem_gbps: 4800.0,
    };
    const H100: Occupancy = Occupancy {
        mem_gbps: 3350.0,
        ..H200
    };

    #[test]
    fn each_projection_gets_the_kernel_its_grid_needs() {
        let s8 = Shape::preset("qwen3-8b").unwrap();
        let o = StepOptions::auto(&s8, H200);
        // 4096 outputs: 512 tiles, one wave at 4 blocks an SM, two at 3.
        assert_eq!(o.plan(Proj::O), GemmPlan::B4);
        assert_eq!(o.plan(Proj::Down), GemmPlan::B4);
        // gate|up's 1536 and the lm_head's 9496 16-column tiles: more than one wave of W16.
        for p in [Proj::GateUp, Proj::LmHead] {
            assert_eq!(o.plan(p), GemmPlan::W16, "{p:?}");
        }
        assert_eq!(o.plan(Proj::Qkv), GemmPlan::Plain);
        // Not on the H100's slower memory.
        let o100 = StepOptions::auto(&s8, H100);
        for p in [Proj::GateUp, Proj::LmHead, Proj::Qkv] {
            assert_eq!(o100.plan(p), GemmPlan::Plain, "{p:?}");
        }
        let s15 = Shape::preset("qwen2.5-1.5b").unwrap();
        let o15 = StepOptions::auto(&s15, H200);
        // 192-256 tiles: one wave of the deep kernel, the long down split in 2 (384 blocks);
        // gate|up (1120 16-column tiles) and the lm_head: more than one wave of W16.
        for p in [Proj::Qkv, Proj::O] {
            assert_eq!(o15.plan(p), GemmPlan::Deep, "{p:?}");
        }
        assert_eq!(o15.plan(Proj::Down), GemmPlan::PlainX2);
        assert_eq!(o15.plan(Proj::GateUp), GemmPlan::W16);
        assert_eq!(o15.plan(Proj::LmHead), GemmPlan::W16);
        assert!(o15.fold_norm && o15.fused_attn && !o15.merges_in_kernel(1));
        let m2 = StepOptions::parse("auto+merge=2", &s15, H200).unwrap();
        assert!(m2.merges_in_kernel(1) && m2.merges_in_kernel(2) && !m2.merges_in_kernel(4));
        // The plan never depends on anything but the shape and the GPU.
        assert_eq!(o, StepOptions::auto(&s8, H200));
    }

    #[test]
    fn variants_parse_and_bad_ones_are_refused() {
        let s = Shape::preset("qwen2.5-1.5b").unwrap();
        let v = StepOptions::parse("auto+fold+merge=16+down=plain", &s, H200).unwrap();
        assert!(v.fold_norm && v.fused_attn && v.merges_in_kernel(16));
        assert_eq!(v.plan(Proj::Down), GemmPlan::Plain);
        assert_eq!(v.plan(Proj::Qkv), GemmPlan::Deep);
        let u = StepOptions::parse("unfused", &s, H200).unwrap();
        assert!(!u.fold_norm && !u.fused_attn && !u.merges_in_kernel(1));
        let err = |spec: &str| StepOptions::parse(spec, &s, H200).unwrap_err().to_string();
        assert!(err("auto+mlp=b4").contains("unknown projection"));
        assert!(err("auto+down=b8").contains("plain, b4, deep"));
        // 96 inputs are 3 chunks: no even split in 2.
        let tiny = Shape {
            hidden: 96,
            heads: 1,
            kv_heads: 1,
            head_dim: 64,
            ..s.clone()
        };
        let e = StepOptions::parse("auto+qkv=b4x2", &tiny, H200)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot cover"), "{e}");
        // 16-column blocks need outputs in multiples of 16.
        assert!(GemmPlan::W16.fits(2048, 1536) && !GemmPlan::W16D.fits(136, 96));
        assert_eq!(GemmPlan::W16.grid(17920), (1120, 1));
        let w = StepOptions::parse("auto+gate_up=w16+lm_head=w16d", &s, H200).unwrap();
        assert_eq!(w.plan(Proj::LmHead), GemmPlan::W16D);
        // Options built by hand are checked as well (Step::set_options calls this).
        let mut hand = StepOptions::auto(&tiny, H200);
        hand.check(&tiny).unwrap();
        hand.plans[0] = GemmPlan::PlainX4;
        assert!(hand.check(&tiny).unwrap_err().to_string().contains("qkv"));
        assert!(err("auto+merge=all").contains("number of rows"));
        assert!(err("auto+faster").contains("change 'faster'"));
        assert!(err("fast").contains("variant"));
    }
}
