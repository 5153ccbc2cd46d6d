//! The doorbell (1.3): session messages through two shared-memory rings instead of the socket.
//!
//! A socket round trip (send, wake the peer, its reply, wake us) costs 40-125 µs, several percent
//! of a GPU target's forward. With a doorbell the host writes every request as a postcard frame
//! into a ring in a memfd it shares with the drafter, and the drafter writes its replies into a
//! second ring. Each side polls its incoming ring for a short while (`spin`), then sleeps on a
//! futex word in the same memory, which the writer wakes only when the reader said it sleeps: a
//! round trip is then a few cache-line transfers, plus one wake-up when the peer had gone to sleep.
//!
//! ```text
//! region: [ header 64 B | ring 0 control 128 B | ring 1 control 128 B | data 0 | data 1 ]
//! header:  magic u64 | ring bytes u64
//! control: tail u64, seq u32 (futex) | (next cache line) head u64, sleeping u32
//! ring 0: host → drafter (HostMsg frames); ring 1: drafter → host (DrafterMsg frames)
//! frame:   length u32 LE, then the postcard bytes; length 0 = "the next message is on the socket"
//! ```
//!
//! The socket stays: the handshake, every message that carries a file descriptor (`MapRegion`,
//! `MapDonors`) and any frame larger than half a ring travel on it, each announced by an empty
//! frame in the ring at its place in the order, so the reader takes exactly one message from the
//! socket there. Order is the ring's.
//!
//! Positions (`head`, `tail`) only grow; `tail - head` bytes are readable. The writer owns `tail`
//! and `seq`, the reader `head` and `sleeping`. Neither trusts the other's words: a position out
//! of range or a frame longer than what is readable is a [`Error::Violation`].

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ipc_channel::ipc::IpcSharedMemory;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};

const MAGIC: u64 = u64::from_le_bytes(*b"SPECBEL1");
const HEADER: usize = 64;
const CONTROL: usize = 128;
/// Offsets inside a ring's control block.
const TAIL: usize = 0;
const SEQ: usize = 8;
const HEAD: usize = 64;
const SLEEPING: usize = 72;
const FRAME_HEADER: usize = 4;
/// How long a reader sleeps at most before it looks at the socket (a peer that died never rings).
pub const SLICE: Duration = Duration::from_millis(20);

/// Which ring of a doorbell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ring {
    /// Host → drafter.
    ToDrafter = 0,
    /// Drafter → host.
    ToHost = 1,
}

/// One end of a doorbell region: writes one ring, reads the other.
#[derive(Debug)]
pub struct Doorbell {
    shm: IpcSharedMemory,
    /// The start of this process's mapping of `shm` (writable: both processes write it).
    base: *mut u8,
    ring_bytes: u64,
    /// The ring this end writes.
    out: Ring,
    /// How long a reader polls before it sleeps.
    spin: Duration,
}

// SAFETY: `base` points into `shm`, which the struct owns and which stays mapped while it lives;
// all access through it is atomic or to ring bytes the protocol hands to one side at a time.
unsafe impl Send for Doorbell {}

/// What [`Doorbell::recv`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    /// A message, as postcard bytes.
    Message(Vec<u8>),
    /// The next message travels on the socket: take one from there now.
    OnSocket,
}

impl Doorbell {
    /// Creates a region with two rings of `ring_bytes` each (rounded up to 64): the host's end.
    ///
    /// # Errors
    /// [`Error::TooLarge`] when `ring_bytes` is below 64 bytes.
    pub fn host(ring_bytes: usize, spin: Duration) -> Result<Self> {
        if ring_bytes < 64 {
            return Err(Error::TooLarge {
                bytes: ring_bytes,
                capacity: 64,
            });
        }
        let ring_bytes = (ring_bytes as u64).div_ceil(64) * 64;
        let shm = IpcSharedMemory::from_byte(0, HEADER + 2 * CONTROL + 2 * ring_bytes as usize);
        let bell = Doorbell::map(shm, ring_bytes, Ring::ToDrafter, spin);
        bell.u64_at(8).store(ring_bytes, Ordering::Relaxed);
        bell.u64_at(0).store(MAGIC, Ordering::Release);
        Ok(bell)
    }

    /// Maps the host's region: the drafter's end. `spin` is what the host asked for.
    ///
    /// # Errors
    /// [`Error::Violation`] when the region is not a doorbell or its size does not match.
    pub fn drafter(shm: IpcSharedMemory, spin: Duration) -> Result<Self> {
        let bad = |reason: String| Err(Error::Violation { reason });
        if shm.len() < HEADER + 2 * CONTROL {
            return bad(format!("doorbell region of {} bytes", shm.len()));
        }
        let mut bell = Doorbell::map(shm, 0, Ring::ToHost, spin);
        if bell.u64_at(0).load(Ordering::Acquire) != MAGIC {
            return bad("doorbell region without its magic".to_string());
        }
        let ring_bytes = bell.u64_at(8).load(Ordering::Relaxed);
        let want = (HEADER + 2 * CONTROL) as u64 + ring_bytes.saturating_mul(2);
        if ring_bytes < 64 || want != bell.shm.len() as u64 {
            return bad(format!(
                "doorbell rings of {ring_bytes} bytes in a region of {} bytes",
                bell.shm.len()
            ));
        }
        bell.ring_bytes = ring_bytes;
        Ok(bell)
    }

    fn map(mut shm: IpcSharedMemory, ring_bytes: u64, out: Ring, spin: Duration) -> Self {
        // SAFETY: the slice is used only to take the mapping's address; every later access goes
        // through that pointer (atomics for the words, copies for the rings), never through a
        // Rust reference that assumes no one else writes.
        let base = unsafe { shm.deref_mut() }.as_mut_ptr();
        Doorbell {
            shm,
            base,
            ring_bytes,
            out,
            spin,
        }
    }

    /// The region, to send to the drafter.
    pub fn handle(&self) -> IpcSharedMemory {
        self.shm.clone()
    }

    /// How long a reader polls before it sleeps.
    pub fn spin(&self) -> Duration {
        self.spin
    }

    /// The largest message that travels in the ring; larger ones take the socket.
    pub fn max_frame(&self) -> usize {
        self.ring_bytes as usize / 2 - FRAME_HEADER
    }

    fn u64_at(&self, at: usize) -> &AtomicU64 {
        assert!(at.is_multiple_of(8) && at + 8 <= HEADER + 2 * CONTROL);
        // SAFETY: the mapping is page-aligned and at least HEADER + 2 * CONTROL bytes long
        // (checked at construction), `at` is 8-aligned and inside it, and the borrow of `self`
        // keeps the mapping alive. Header and control words are only accessed atomically, by
        // both processes.
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    fn u32_at(&self, at: usize) -> &AtomicU32 {
        assert!(at.is_multiple_of(4) && at + 4 <= HEADER + 2 * CONTROL);
        // SAFETY: as in `u64_at`, for a 4-aligned word.
        unsafe { &*(self.base.add(at) as *const AtomicU32) }
    }

    fn control(ring: Ring) -> usize {
        HEADER + CONTROL * ring as usize
    }

    fn data(&self, ring: Ring) -> *mut u8 {
        let at = HEADER + 2 * CONTROL + self.ring_bytes as usize * ring as usize;
        // SAFETY: inside the mapping (its length was checked against the ring size).
        unsafe { self.base.add(at) }
    }

    fn input(&self) -> Ring {
        match self.out {
            Ring::ToDrafter => Ring::ToHost,
            Ring::ToHost => Ring::ToDrafter,
        }
    }

    /// Head and tail of `ring`, checked: the other process may write nonsense.
    fn positions(&self, ring: Ring) -> Result<(u64, u64)> {
        let c = Self::control(ring);
        let head = self.u64_at(c + HEAD).load(Ordering::Acquire);
        let tail = self.u64_at(c + TAIL).load(Ordering::Acquire);
        if head > tail || tail - head > self.ring_bytes {
            return Err(Error::Violation {
                reason: format!("doorbell ring positions head {head}, tail {tail}"),
            });
        }
        Ok((head, tail))
    }

    /// Copies `bytes` into `ring` at stream position `pos`, wrapping at the end.
    fn copy_in(&self, ring: Ring, pos: u64, bytes: &[u8]) {
        let cap = self.ring_bytes as usize;
        let at = (pos % self.ring_bytes) as usize;
        let first = bytes.len().min(cap - at);
        let data = self.data(ring);
        // SAFETY: [at, at + first) and [0, len - first) lie inside the ring; the reader never
        // reads past `tail`, which is published only after this copy, and never keeps a
        // reference into the ring.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), data.add(at), first);
            std::ptr::copy_nonoverlapping(bytes[first..].as_ptr(), data, bytes.len() - first);
        }
    }

    fn copy_out(&self, ring: Ring, pos: u64, out: &mut [u8]) {
        let cap = self.ring_bytes as usize;
        let at = (pos % self.ring_bytes) as usize;
        let first = out.len().min(cap - at);
        let data = self.data(ring);
        // SAFETY: as in `copy_in`; the writer does not touch [head, tail) until `head` moves on.
        unsafe {
            std::ptr::copy_nonoverlapping(data.add(at), out.as_mut_ptr(), first);
            let rest = out.len() - first;
            std::ptr::copy_nonoverlapping(data, out[first..].as_mut_ptr(), rest);
        }
    }

    /// Writes one frame (an empty `message` announces a message on the socket) and wakes the
    /// reader when it sleeps. Waits up to `timeout` for room.
    ///
    /// # Errors
    /// [`Error::TooLarge`] for a message over [`Doorbell::max_frame`]; [`Error::Violation`] when
    /// the ring stays full for `timeout` (the reader stopped reading) or its positions are bad.
    pub fn send(&self, message: &[u8], timeout: Duration) -> Result<()> {
        if message.len() > self.max_frame() {
            return Err(Error::TooLarge {
                bytes: message.len(),
                capacity: self.max_frame(),
            });
        }
        let need = (FRAME_HEADER + message.len()) as u64;
        let ring = self.out;
        let start = Instant::now();
        let tail = loop {
            let (head, tail) = self.positions(ring)?;
            if self.ring_bytes - (tail - head) >= need {
                break tail;
            }
            if start.elapsed() >= timeout {
                return Err(Error::Violation {
                    reason: format!("doorbell ring full for {timeout:?}: the peer stopped reading"),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        };
        self.copy_in(ring, tail, &(message.len() as u32).to_le_bytes());
        self.copy_in(ring, tail + FRAME_HEADER as u64, message);
        let c = Self::control(ring);
        self.u64_at(c + TAIL).store(tail + need, Ordering::Release);
        // Dekker with the reader's `sleeping` store then `seq` load: either it sees the new
        // `seq` (and does not sleep) or we see it asleep and wake it.
        let seq = self.u32_at(c + SEQ);
        seq.fetch_add(1, Ordering::SeqCst);
        if self.u32_at(c + SLEEPING).load(Ordering::SeqCst) != 0 {
            futex::wake(seq);
        }
        Ok(())
    }

    /// Takes one frame if there is one, without waiting.
    fn try_recv(&self) -> Result<Option<Frame>> {
        let ring = self.input();
        let (head, tail) = self.positions(ring)?;
        if head == tail {
            return Ok(None);
        }
        let bad = |reason: String| Err(Error::Violation { reason });
        if tail - head < FRAME_HEADER as u64 {
            return bad(format!("doorbell frame header cut: {} bytes", tail - head));
        }
        let mut len = [0u8; FRAME_HEADER];
        self.copy_out(ring, head, &mut len);
        let len = u32::from_le_bytes(len) as u64;
        if len > tail - head - FRAME_HEADER as u64 {
            return bad(format!(
                "doorbell frame of {len} bytes, {} readable",
                tail - head - FRAME_HEADER as u64
            ));
        }
        let mut message = vec![0u8; len as usize];
        self.copy_out(ring, head + FRAME_HEADER as u64, &mut message);
        let c = Self::control(ring);
        self.u64_at(c + HEAD)
            .store(head + FRAME_HEADER as u64 + len, Ordering::Release);
        Ok(Some(match len {
            0 => Frame::OnSocket,
            _ => Frame::Message(message),
        }))
    }

    /// Waits up to `timeout` for a frame: polls for [`Doorbell::spin`], then sleeps on the futex.
    /// `None` when nothing came.
    ///
    /// # Errors
    /// [`Error::Violation`] when the peer broke the ring.
    pub fn recv(&self, timeout: Duration) -> Result<Option<Frame>> {
        let start = Instant::now();
        let c = Self::control(self.input());
        let (seq, sleeping) = (self.u32_at(c + SEQ), self.u32_at(c + SLEEPING));
        let mut polls = 0u32;
        loop {
            if let Some(frame) = self.try_recv()? {
                return Ok(Some(frame));
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Ok(None);
            }
            if waited < self.spin {
                polls = polls.wrapping_add(1);
                match polls % 64 {
                    // Let a peer on the same core run (a busy or small machine).
                    0 => std::thread::yield_now(),
                    _ => std::hint::spin_loop(),
                }
                continue;
            }
            sleeping.store(1, Ordering::SeqCst);
            let seen = seq.load(Ordering::SeqCst);
            let (head, tail) = self.positions(self.input())?;
            if head == tail {
                futex::wait(seq, seen, timeout - waited);
            }
            sleeping.store(0, Ordering::SeqCst);
        }
    }
}

/// A message as frame bytes (postcard, the socket's codec). Never call it on a message that
/// carries a file descriptor: those take the socket.
///
/// # Errors
/// [`Error::Violation`] when the message does not encode.
pub fn encode(msg: &impl Serialize) -> Result<Vec<u8>> {
    postcard::to_allocvec(msg).map_err(|e| Error::Violation {
        reason: format!("a message does not encode: {e}"),
    })
}

/// A frame's message.
///
/// # Errors
/// [`Error::Violation`] when the bytes are not one.
pub fn decode<T: DeserializeOwned>(frame: &[u8]) -> Result<T> {
    postcard::from_bytes(frame).map_err(|e| Error::Violation {
        reason: format!("a doorbell frame does not decode: {e}"),
    })
}

#[cfg(target_os = "linux")]
mod futex {
    //! Shared (not process-private) futex calls on a word of the mapping.
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    pub(super) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `word` is a live, 4-aligned u32; FUTEX_WAIT only reads it. A spurious or
        // interrupted return is fine: the caller looks at the ring again.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                expected,
                &ts as *const libc::timespec,
            );
        }
    }

    pub(super) fn wake(word: &AtomicU32) {
        // SAFETY: as above; FUTEX_WAKE does not touch the word's value.
        unsafe {
            libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, 1);
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod futex {
    //! Without futexes a sleeping reader polls every 50 µs.
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    pub(super) fn wait(_word: &AtomicU32, _expected: u32, timeout: Duration) {
        std::thread::sleep(timeout.min(Duration::from_micros(50)));
    }

    pub(super) fn wake(_word: &AtomicU32) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(ring_bytes: usize) -> (Doorbell, Doorbell) {
        let host = Doorbell::host(ring_bytes, Duration::from_micros(20)).unwrap();
        let drafter = Doorbell::drafter(host.handle(), Duration::from_micros(20)).unwrap();
        (host, drafter)
    }

    const NOW: Duration = Duration::ZERO;

    #[test]
    fn frames_cross_in_order_both_ways_and_wrap() {
        let (host, drafter) = pair(64);
        assert_eq!(host.max_frame(), 28);
        // 64-byte rings: frames of 4 + 9..27 bytes wrap every few messages.
        for i in 0..200u32 {
            let msg: Vec<u8> = (0..(5 + i % 23)).map(|b| (b + i) as u8).collect();
            host.send(&msg, NOW).unwrap();
            assert_eq!(
                drafter.recv(NOW).unwrap(),
                Some(Frame::Message(msg.clone()))
            );
            drafter.send(&msg[1..], NOW).unwrap();
            assert_eq!(
                host.recv(NOW).unwrap(),
                Some(Frame::Message(msg[1..].to_vec()))
            );
        }
        host.send(&[], NOW).unwrap();
        assert_eq!(drafter.recv(NOW).unwrap(), Some(Frame::OnSocket));
        assert_eq!(drafter.recv(NOW).unwrap(), None);
    }

    #[test]
    fn a_full_ring_refuses_after_the_timeout_and_oversized_frames_never_fit() {
        let (host, drafter) = pair(64);
        host.send(&[1; 28], NOW).unwrap();
        host.send(&[2; 28], NOW).unwrap();
        let err = host.send(&[3], Duration::from_millis(1)).unwrap_err();
        assert!(err.to_string().contains("ring full"), "{err}");
        assert!(matches!(
            host.send(&[0; 29], NOW),
            Err(Error::TooLarge { bytes: 29, .. })
        ));
        assert_eq!(
            drafter.recv(NOW).unwrap(),
            Some(Frame::Message(vec![1; 28]))
        );
        host.send(&[3], NOW).unwrap();
    }

    #[test]
    fn a_sleeping_reader_is_woken_by_the_writer() {
        let (host, drafter) = pair(4096);
        let reader = std::thread::spawn(move || drafter.recv(Duration::from_secs(60)));
        // Whether the reader is still polling or already asleep, the frame reaches it.
        std::thread::sleep(Duration::from_millis(5));
        host.send(b"ring", NOW).unwrap();
        let got = reader.join().unwrap().unwrap();
        assert_eq!(got, Some(Frame::Message(b"ring".to_vec())));
    }

    #[test]
    fn bad_positions_and_lengths_from_the_peer_are_violations() {
        let (host, drafter) = pair(64);
        let to_drafter = Doorbell::control(Ring::ToDrafter);
        // A frame that claims more bytes than were written.
        host.copy_in(Ring::ToDrafter, 0, &100u32.to_le_bytes());
        host.u64_at(to_drafter + TAIL).store(8, Ordering::Release);
        let err = drafter.recv(NOW).unwrap_err();
        assert!(err.to_string().contains("100 bytes, 4 readable"), "{err}");
        // A reader whose head ran past the tail.
        host.u64_at(to_drafter + HEAD).store(9, Ordering::Release);
        assert!(host.send(&[1], NOW).is_err());
        // A tail further ahead than the ring holds.
        host.u64_at(to_drafter + HEAD).store(0, Ordering::Release);
        host.u64_at(to_drafter + TAIL).store(65, Ordering::Release);
        assert!(drafter.recv(NOW).is_err());
    }

    #[test]
    fn a_region_that_is_not_a_doorbell_is_refused() {
        let err = Doorbell::drafter(IpcSharedMemory::from_byte(0, 4096), NOW).unwrap_err();
        assert!(err.to_string().contains("magic"), "{err}");
        let err = Doorbell::drafter(IpcSharedMemory::from_byte(0, 16), NOW).unwrap_err();
        assert!(err.to_string().contains("16 bytes"), "{err}");
        assert!(Doorbell::host(8, NOW).is_err());
    }
}
