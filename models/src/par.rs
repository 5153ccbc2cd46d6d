//! The forward's parallel loops: a fork-join pool whose workers spin between loops.
//!
//! A forward runs about ten parallel loops a layer (the projections, attention, the MLP's
//! activation) with short serial parts between them (norms, RoPE, copies). Under rayon the
//! idle worker falls asleep in those gaps and every loop pays a futex wake-up and a
//! `sched_yield` dance: 15% of an eight-sequence SmolLM2 decode step in `perf` (2 cores).
//! These workers spin for [`SPIN`] after each loop, so the next loop of the same forward finds
//! them awake, and only then park; an idle server burns no CPU.
//!
//! - One loop at a time: a loop started while another thread's loop runs (tests, a drafter
//!   and a target in one process) runs on its caller alone, as does a loop nested in a task.
//!   Results never depend on which thread ran a task: every task writes only its own output.
//! - A panic in a task is re-raised on the caller once every task has stopped touching the
//!   caller's data.
//! - Workers: `rayon::current_num_threads() - 1` (so `RAYON_NUM_THREADS` sets both pools),
//!   started at the first loop.

use std::any::Any;
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a worker spins for the next loop before it parks.
pub const SPIN: Duration = Duration::from_micros(200);

/// Runs `f(i)` for every `i` in `0..n`, each exactly once, on the pool's threads and the
/// caller's.
pub fn for_each<F: Fn(usize) + Sync>(n: usize, f: F) {
    match n {
        0 => {}
        1 => f(0),
        _ => match pool() {
            Some(pool) if !IN_TASK.get() => pool.run(n, &f),
            _ => (0..n).for_each(f),
        },
    }
}

/// `f(i, &mut items[i])` for every item (see [`for_each`]).
pub fn for_each_mut<T: Send, F: Fn(usize, &mut T) + Sync>(items: &mut [T], f: F) {
    let base = Base(items.as_mut_ptr());
    for_each(items.len(), |i| {
        // SAFETY: `for_each` calls every index of `items` exactly once, so no two tasks
        // alias an item, and `items` outlives the loop.
        let item = unsafe { &mut *base.at(i) };
        f(i, item)
    });
}

/// `f(c, chunk)` for every chunk `c` of `size` items of `data` (the last may be shorter).
pub fn chunks_mut<T: Send, F: Fn(usize, &mut [T]) + Sync>(data: &mut [T], size: usize, f: F) {
    let mut chunks: Vec<&mut [T]> = data.chunks_mut(size).collect();
    for_each_mut(&mut chunks, |c, chunk| f(c, chunk));
}

/// `[f(0), .., f(n - 1)]` (see [`for_each`]).
pub fn map<T: Send, F: Fn(usize) -> T + Sync>(n: usize, f: F) -> Vec<T> {
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for_each_mut(&mut out, |i, o| *o = Some(f(i)));
    out.into_iter()
        .map(|o| o.expect("invariant: every task ran"))
        .collect()
}

struct Base<T>(*mut T);

impl<T> Clone for Base<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Base<T> {}

// SAFETY: tasks reach disjoint items through it (see `for_each_mut`).
unsafe impl<T: Send> Sync for Base<T> {}

impl<T> Base<T> {
    /// # Safety
    /// `i` is in bounds of the slice the pointer came from.
    unsafe fn at(self, i: usize) -> *mut T {
        unsafe { self.0.add(i) }
    }
}

thread_local! {
    /// Whether this thread is running a task (a nested loop runs inline).
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

/// The published loop. Its fields are written only by the thread holding `submit`, and only
/// while no worker is inside a loop (`active == 0`, `open == false`).
///
/// The counters every task touches, and the generation the idle workers spin on, sit on cache
/// lines of their own, so a claim does not stall on another core's spinning reads.
struct Pool {
    /// Workers and the caller.
    threads: usize,
    submit: Mutex<()>,
    /// Bumped when a loop is published.
    generation: Padded<AtomicU64>,
    /// Whether the published loop still hands out tasks.
    open: AtomicBool,
    /// Workers inside the published loop (they may touch its closure).
    active: Padded<AtomicUsize>,
    data: AtomicPtr<()>,
    call: AtomicUsize,
    n: AtomicUsize,
    next: Padded<AtomicUsize>,
    done: Padded<AtomicUsize>,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    sleeping: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

/// A value alone on its cache lines (two, for the adjacent-line prefetcher).
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

fn pool() -> Option<&'static Pool> {
    static POOL: OnceLock<Option<&'static Pool>> = OnceLock::new();
    *POOL.get_or_init(|| {
        let workers = rayon::current_num_threads().saturating_sub(1);
        if workers == 0 {
            return None;
        }
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            threads: workers + 1,
            submit: Mutex::new(()),
            generation: Padded(AtomicU64::new(0)),
            open: AtomicBool::new(false),
            active: Padded(AtomicUsize::new(0)),
            data: AtomicPtr::new(std::ptr::null_mut()),
            call: AtomicUsize::new(0),
            n: AtomicUsize::new(0),
            next: Padded(AtomicUsize::new(0)),
            done: Padded(AtomicUsize::new(0)),
            panic: Mutex::new(None),
            sleeping: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        }));
        for w in 0..workers {
            let spawned = std::thread::Builder::new()
                .name(format!("specula-par-{w}"))
                .spawn(move || pool.work());
            if spawned.is_err() {
                // Fewer workers only means less parallelism; the caller runs what is left.
                break;
            }
        }
        Some(pool)
    })
}

/// Calls the erased closure of [`Pool::run`].
///
/// # Safety
/// `data` points to a live `F`.
unsafe fn call<F: Fn(usize) + Sync>(data: *const (), i: usize) {
    let f = unsafe { &*(data as *const F) };
    f(i)
}

impl Pool {
    fn run<F: Fn(usize) + Sync>(&self, n: usize, f: &F) {
        let Ok(_held) = self.submit.try_lock() else {
            // Another thread's loop is running: this one runs on its caller.
            return (0..n).for_each(f);
        };
        self.data.store(f as *const F as *mut (), SeqCst);
        self.call
            .store(call::<F> as unsafe fn(*const (), usize) as usize, SeqCst);
        self.n.store(n, SeqCst);
        self.next.store(0, SeqCst);
        self.done.store(0, SeqCst);
        self.open.store(true, SeqCst);
        self.generation.fetch_add(1, SeqCst);
        if self.sleeping.load(SeqCst) > 0 {
            let _park = self.park.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
        self.tasks();
        while self.done.load(SeqCst) < n {
            std::hint::spin_loop();
        }
        // No worker may enter the loop from here on; wait for those inside to leave it, since
        // they hold a reference to `f`, which lives on this stack frame.
        self.open.store(false, SeqCst);
        while self.active.load(SeqCst) > 0 {
            std::hint::spin_loop();
        }
        let payload = self.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(payload) = payload {
            panic::resume_unwind(payload);
        }
    }

    /// Claims and runs tasks of the published loop until none is left.
    fn tasks(&self) {
        let n = self.n.load(SeqCst);
        let data = self.data.load(SeqCst) as *const ();
        let call = self.call.load(SeqCst);
        // SAFETY: `call` was stored from a `call::<F>` function pointer by `run`, and is only
        // read while the loop is open.
        let call: unsafe fn(*const (), usize) = unsafe { std::mem::transmute(call) };
        let was = IN_TASK.replace(true);
        // Guided self-scheduling: each claim takes a share of what is left, so a loop of
        // thousands of small tasks (a 151936-row head in tasks of 32 rows) costs a few dozen
        // atomic claims, not one per task, and the last claims are small enough to balance.
        let mut at = self.next.load(SeqCst);
        while at < n {
            let take = ((n - at) / (2 * self.threads)).max(1);
            if let Err(now) = self
                .next
                .compare_exchange_weak(at, at + take, SeqCst, SeqCst)
            {
                at = now;
                continue;
            }
            // SAFETY: the loop is open, so `data` is the live closure `call` expects.
            let ran = panic::catch_unwind(AssertUnwindSafe(|| {
                (at..at + take).for_each(|i| unsafe { call(data, i) })
            }));
            if let Err(payload) = ran {
                let mut first = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                first.get_or_insert(payload);
            }
            self.done.fetch_add(take, SeqCst);
            at = self.next.load(SeqCst);
        }
        IN_TASK.set(was);
    }

    fn work(&self) {
        let mut seen = self.generation.load(SeqCst);
        loop {
            seen = self.wait(seen);
            self.active.fetch_add(1, SeqCst);
            // Checked after `active` is raised: `run` closes the loop before it waits for
            // `active` to drop, so a worker that sees it open is waited for.
            if self.open.load(SeqCst) {
                self.tasks();
            }
            self.active.fetch_sub(1, SeqCst);
        }
    }

    /// Waits for a generation after `seen`: spinning for [`SPIN`], then parked.
    fn wait(&self, seen: u64) -> u64 {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            let now = self.generation.load(SeqCst);
            if now != seen {
                return now;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && started.elapsed() > SPIN {
                break;
            }
        }
        let mut park = self.park.lock().unwrap_or_else(|e| e.into_inner());
        self.sleeping.fetch_add(1, SeqCst);
        let now = loop {
            // Checked after `sleeping` is raised: `run` bumps the generation before it looks
            // at `sleeping`, so either this sees the new generation or `run` notifies.
            let now = self.generation.load(SeqCst);
            if now != seen {
                break now;
            }
            park = self.wake.wait(park).unwrap_or_else(|e| e.into_inner());
        };
        self.sleeping.fetch_sub(1, SeqCst);
        now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_runs_once_whatever_the_size() {
        for n in [0, 1, 2, 3, 17, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for_each(n, |i| {
                hits[i].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "n = {n}");
        }
    }

    #[test]
    fn map_keeps_the_order_and_chunks_cover_the_data() {
        assert_eq!(
            map(100, |i| i * i),
            (0..100).map(|i| i * i).collect::<Vec<_>>()
        );
        let mut data = vec![0usize; 1003];
        chunks_mut(&mut data, 10, |c, chunk| {
            for (j, x) in chunk.iter_mut().enumerate() {
                *x = c * 10 + j;
            }
        });
        assert_eq!(data, (0..1003).collect::<Vec<_>>());
    }

    #[test]
    fn loops_from_many_threads_and_nested_loops_all_complete() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        for_each(8, |_| {
                            for_each(3, |_| {
                                total.fetch_add(1, SeqCst);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(SeqCst), 4 * 200 * 8 * 3);
    }

    #[test]
    fn a_panic_in_a_task_reaches_the_caller_and_the_pool_keeps_working() {
        let caught = panic::catch_unwind(|| {
            for_each(64, |i| {
                if i == 37 {
                    panic!("task 37");
                }
            })
        });
        let payload = caught.expect_err("the panic reaches the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"task 37"));
        assert_eq!(
            map(50, |i| i + 1).iter().sum::<usize>(),
            (1..=50).sum::<usize>()
        );
    }

    #[test]
    fn a_loop_after_the_workers_parked_completes() {
        std::thread::sleep(SPIN * 4);
        let hits = AtomicUsize::new(0);
        for_each(10_000, |_| {
            hits.fetch_add(1, SeqCst);
        });
        assert_eq!(hits.load(SeqCst), 10_000);
    }
}
