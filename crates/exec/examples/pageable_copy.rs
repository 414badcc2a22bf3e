//! Pageable host→device copies the executor's way against the profiler's (issue #8: `ngl` cells stage their
//! CPU-resident units at ≈ 0.8× the profile's pageable curve). Needs a CUDA GPU (loaded at run time).
//!
//!   cargo build --release -p pipeshard-exec --example pageable_copy
//!   target/release/examples/pageable_copy [rounds, default 5]   (≈ 30 s on the H200 machine)
//!
//! Each round makes every variant's source anew (allocated, filled, then the last-level cache flushed, like
//! weights made long before), copies it once (`fresh`) and three times more (`again`); the variants' order
//! rotates from round to round so that a drifting host moves them alike. Every copy is timed with CUDA events
//! around it on its stream (as the executor's trace) and on the host from the call to the end of a stream
//! sync (as the profiler). A line per round gives the host's DRAM read (all threads) and a one-thread memcpy
//! into a small buffer (the host side of a pageable copy) with each variant's fresh copy; then one line per
//! variant and kind: medians over the rounds, the event GB/s range, and the share of the source's mapping
//! that transparent huge pages back.

use std::time::Instant;

use pipeshard_exec::cuda::{DevBuf, Event, Gpu, Stream};
use pipeshard_exec::host::HostBuf;
use rayon::prelude::*;

/// `stage blk.N.ffn` of nemo-8b (bf16): gate, up and down (94 MB each) and the norm, as one buffer.
const FFN_BYTES: usize = 283_131_904;
/// `stage blk.N.attn` of nemo-8b (bf16).
const ATTN_BYTES: usize = 83_902_464;
/// run23's profile's pageable check (`vec![1u8; 256 MiB]`, copied repeatedly).
const PROBE_BYTES: usize = 256 << 20;
/// A device-to-device copy of half this queued ahead of a staged copy: ≈ 1.3 ms at the H200's 4.1 TB/s (read
/// + written), like the attention kernel before `stage blk.N.ffn` in run23's traces.
const BUSY_BYTES: usize = 5 << 30;
/// Read between filling a source and copying it: several times any last-level cache.
const FLUSH_BYTES: usize = 1 << 30;
/// The host-side stand-in for the driver's staging buffer: small enough to stay cached.
const STAGING_BYTES: usize = 2 << 20;
const FILL_CHUNK_BYTES: usize = 1 << 17;
const AGAIN_COPIES: usize = 3;

/// How a source buffer is allocated and filled.
#[derive(Clone, Copy)]
enum Alloc {
    /// `vec![0u8; n]` (calloc: fresh zero pages, first touched by the fill), filled by one thread: the
    /// profiler's curve until it read a HostBuf (run23's profile).
    VecOneThread,
    /// `vec![0u8; n]` filled by every thread.
    VecThreads,
    /// `vec![1u8; n]` (memset), nothing else: run23's profile's 256 MiB check.
    VecOnes,
    /// [`HostBuf`] (page-aligned, zeroed by the allocating thread), filled by every thread: the executor's
    /// weights (`ModelWeights::random`).
    Host,
    /// [`HostBuf`] with ones instead of random bytes.
    HostOnes,
    /// Anonymous mmap advised MADV_HUGEPAGE before its first touch, filled by every thread.
    MapHuge,
    /// The same advised MADV_NOHUGEPAGE.
    MapSmall,
}

struct Variant {
    name: &'static str,
    alloc: Alloc,
    bytes: usize,
    /// The source starts this many bytes into its buffer (a Vec's data sits 16 bytes into its mapping).
    offset: usize,
    /// Copies the source is cut into, one after the other.
    copies: usize,
    /// On the compute stream behind queued work, as the executor stages units; else on the idle copy stream.
    busy: bool,
}

const fn variant(name: &'static str, alloc: Alloc, bytes: usize) -> Variant {
    Variant { name, alloc, bytes, offset: 0, copies: 1, busy: false }
}

const VARIANTS: [Variant; 11] = [
    variant("prof-curve", Alloc::VecOneThread, FFN_BYTES),
    variant("prof-probe", Alloc::VecOnes, PROBE_BYTES),
    Variant { busy: true, ..variant("exec-stage", Alloc::Host, FFN_BYTES) },
    variant("exec-idle", Alloc::Host, FFN_BYTES),
    variant("exec-attn", Alloc::Host, ATTN_BYTES),
    Variant { copies: 3, ..variant("exec-3-copies", Alloc::Host, FFN_BYTES) },
    Variant { offset: 16, ..variant("exec-offset16", Alloc::Host, FFN_BYTES) },
    variant("exec-ones", Alloc::HostOnes, FFN_BYTES),
    variant("vec-threads", Alloc::VecThreads, FFN_BYTES),
    variant("map-huge", Alloc::MapHuge, FFN_BYTES),
    variant("map-small", Alloc::MapSmall, FFN_BYTES),
];

/// An anonymous mapping aligned to 2 MiB, unmapped on drop.
struct Mapping {
    base: *mut libc::c_void,
    mapped_bytes: usize,
    data: *mut u8,
    len_bytes: usize,
}

impl Mapping {
    fn new(len_bytes: usize, advice: libc::c_int) -> Mapping {
        const HUGE: usize = 2 << 20;
        let mapped_bytes = len_bytes + HUGE;
        // SAFETY: a fresh private anonymous mapping; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED, "mmap of {mapped_bytes} bytes failed");
        let data = base.cast::<u8>().wrapping_add((base as usize).next_multiple_of(HUGE) - base as usize);
        // SAFETY: the advised range lies inside the mapping; advice only changes how pages are backed.
        let rc = unsafe { libc::madvise(data.cast(), len_bytes.next_multiple_of(HUGE), advice) };
        if rc != 0 {
            eprintln!("madvise({advice}) failed: {}", std::io::Error::last_os_error());
        }
        Mapping { base, mapped_bytes, data, len_bytes }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `data..data + len_bytes` lies inside the live mapping, which self owns exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len_bytes) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.base, self.mapped_bytes) };
    }
}

enum Source {
    Vec(Vec<u8>),
    Host(HostBuf),
    Map(Mapping),
}

impl Source {
    fn new(alloc: Alloc, len_bytes: usize, seed: u64) -> Source {
        let mut s = match alloc {
            Alloc::VecOneThread | Alloc::VecThreads => Source::Vec(vec![0; len_bytes]),
            Alloc::VecOnes => Source::Vec(vec![1; len_bytes]),
            Alloc::Host | Alloc::HostOnes => Source::Host(HostBuf::zeroed(len_bytes)),
            Alloc::MapHuge => Source::Map(Mapping::new(len_bytes, libc::MADV_HUGEPAGE)),
            Alloc::MapSmall => Source::Map(Mapping::new(len_bytes, libc::MADV_NOHUGEPAGE)),
        };
        let bytes = s.as_mut_slice();
        match alloc {
            Alloc::VecOneThread => bytes.chunks_mut(FILL_CHUNK_BYTES).enumerate().for_each(fill(seed)),
            Alloc::VecOnes => {}
            Alloc::HostOnes => bytes.fill(1),
            _ => bytes.par_chunks_mut(FILL_CHUNK_BYTES).enumerate().for_each(fill(seed)),
        }
        s
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Source::Vec(v) => v,
            Source::Host(h) => h.as_mut_slice(),
            Source::Map(m) => m.as_mut_slice(),
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            Source::Vec(v) => v,
            Source::Host(h) => h.as_slice(),
            // SAFETY: as in Mapping::as_mut_slice, shared.
            Source::Map(m) => unsafe { std::slice::from_raw_parts(m.data, m.len_bytes) },
        }
    }
}

/// Fills chunk `i` with random bytes (splitmix64 of the seed and the word's index).
fn fill(seed: u64) -> impl Fn((usize, &mut [u8])) + Sync {
    move |(i, chunk)| {
        let first = (i * FILL_CHUNK_BYTES / 8) as u64;
        for (j, w) in chunk.chunks_mut(8).enumerate() {
            let mut z = (seed ^ (first + j as u64)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            w.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes()[..w.len()]);
        }
    }
}

/// The share of the mapping holding `ptr` that transparent huge pages back (AnonHugePages / Rss of its entry
/// in /proc/self/smaps; adjacent mappings of the same kind are one entry), if the file says.
fn huge_share(ptr: *const u8) -> Option<f64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let at = ptr as usize;
    let mut inside = false;
    let (mut rss_kb, mut huge_kb) = (None, None);
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-')
            && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        {
            if inside {
                break;
            }
            inside = (lo..hi).contains(&at);
        } else if inside {
            let kb = words.next().and_then(|w| w.parse::<f64>().ok());
            match first {
                "Rss:" => rss_kb = kb,
                "AnonHugePages:" => huge_kb = kb,
                _ => {}
            }
        }
    }
    Some(huge_kb? / rss_kb?.max(1.0))
}

struct Device<'g> {
    gpu: &'g Gpu,
    dst: DevBuf,
    busy: DevBuf,
    ev0: Event,
    ev1: Event,
}

impl Device<'_> {
    /// (host ms, event ms) of copying `src` in `copies` pieces.
    fn copy(&self, src: &[u8], copies: usize, busy: bool) -> pipeshard_exec::Result<(f64, f64)> {
        let stream = if busy { Stream::Compute } else { Stream::H2d };
        if busy {
            let (half, at) = (BUSY_BYTES / 2, self.busy.ptr());
            // SAFETY: two disjoint halves of `busy`.
            unsafe { self.gpu.d2d(Stream::Compute, at + half as u64, at, half)? };
        }
        self.gpu.record(&self.ev0, stream)?;
        let t0 = Instant::now();
        let mut at = self.dst.ptr();
        for piece in src.chunks(src.len().div_ceil(copies)) {
            // SAFETY: the pieces add up to src.len() ≤ dst's size; src outlives the sync below.
            unsafe { self.gpu.h2d(stream, at, piece)? };
            at += piece.len() as u64;
        }
        self.gpu.record(&self.ev1, stream)?;
        self.gpu.sync(stream)?;
        let host_ms = t0.elapsed().as_secs_f64() * 1e3;
        Ok((host_ms, f64::from(self.gpu.elapsed_ms(&self.ev0, &self.ev1)?)))
    }
}

/// What the host does for a pageable copy, without the device: (every thread reading `flush`, one thread
/// copying 256 MiB of it into a small cached buffer), GB/s. A shared host's state moves both.
fn host_gbps(flush: &[u64]) -> (f64, f64) {
    let t = Instant::now();
    std::hint::black_box(flush.par_iter().fold(|| 0u64, |a, &w| a.wrapping_add(w)).sum::<u64>());
    let read_gbps = FLUSH_BYTES as f64 / t.elapsed().as_nanos() as f64;
    let mut staging = vec![0u8; STAGING_BYTES];
    let t = Instant::now();
    for piece in flush_bytes(flush)[..PROBE_BYTES].chunks(STAGING_BYTES) {
        staging.copy_from_slice(piece);
        std::hint::black_box(&mut staging);
    }
    (read_gbps, PROBE_BYTES as f64 / t.elapsed().as_nanos() as f64)
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 { xs[n / 2] } else { f64::midpoint(xs[n / 2 - 1], xs[n / 2]) }
}

fn sys(path: &str) -> String {
    std::fs::read_to_string(path).map_or_else(|e| format!("({e})"), |s| s.trim().to_string())
}

/// Per variant and kind (fresh, again): (host ms, event ms) of every copy, and the huge-page shares seen.
type Samples = Vec<[(Vec<(f64, f64)>, Vec<f64>); 2]>;

fn main() -> pipeshard_exec::Result<()> {
    let rounds: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(5);
    let gpu = Gpu::new()?;
    let nodes = std::fs::read_dir("/sys/devices/system/node")
        .map_or(0, |d| d.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("node")).count());
    println!("gpu: {}; rayon threads: {}; NUMA nodes: {nodes}", gpu.name(), rayon::current_num_threads());
    println!(
        "THP enabled: {}; defrag: {}",
        sys("/sys/kernel/mm/transparent_hugepage/enabled"),
        sys("/sys/kernel/mm/transparent_hugepage/defrag")
    );
    let dev = Device {
        gpu: &gpu,
        dst: gpu.alloc(FFN_BYTES.max(PROBE_BYTES))?,
        busy: gpu.alloc(BUSY_BYTES)?,
        ev0: gpu.event(true)?,
        ev1: gpu.event(true)?,
    };
    let flush = vec![1u64; FLUSH_BYTES / 8];
    let mut samples: Samples = VARIANTS.iter().map(|_| Default::default()).collect();
    // One unrecorded copy first: the driver's first pageable copy sets up its staging buffers.
    dev.copy(&flush_bytes(&flush)[..PROBE_BYTES], 1, false)?;
    let t0 = Instant::now();
    for round in 0..rounds {
        let (read_gbps, memcpy_gbps) = host_gbps(&flush);
        let mut fresh = vec![String::new(); VARIANTS.len()];
        for k in 0..VARIANTS.len() {
            let i = (k + round) % VARIANTS.len();
            let v = &VARIANTS[i];
            let src = Source::new(v.alloc, v.offset + v.bytes, (round * VARIANTS.len() + i) as u64);
            let bytes = &src.as_slice()[v.offset..];
            let share = huge_share(bytes.as_ptr());
            host_gbps(&flush);
            for c in 0..=AGAIN_COPIES {
                let (times, shares) = &mut samples[i][usize::from(c > 0)];
                let t = dev.copy(bytes, v.copies, v.busy)?;
                if c == 0 {
                    fresh[i] = format!("{} {:.2}", v.name, v.bytes as f64 / (t.1 * 1e6));
                }
                times.push(t);
                shares.extend(share);
            }
        }
        println!(
            "round {}: host DRAM read {read_gbps:.1} GB/s (all threads), memcpy {memcpy_gbps:.2} GB/s (one \
             thread); fresh copies, event GB/s: {}",
            round + 1,
            fresh.join(", ")
        );
    }
    println!(
        "{rounds} rounds in {:.1} s; ms and GB/s are medians, [range] of the event GB/s",
        t0.elapsed().as_secs_f64()
    );
    println!(
        "{:<14} {:<5} {:>10} {:>6} {:>9} {:>7} {:>15} {:>9} {:>7} {:>5}",
        "variant", "kind", "bytes", "copies", "event ms", "GB/s", "range", "host ms", "GB/s", "huge"
    );
    for (v, kinds) in VARIANTS.iter().zip(&mut samples) {
        for (kind, (times, shares)) in ["fresh", "again"].iter().zip(kinds.iter_mut()) {
            let gbps = |ms: f64| v.bytes as f64 / (ms * 1e6);
            let mut host: Vec<f64> = times.iter().map(|t| t.0).collect();
            let mut event: Vec<f64> = times.iter().map(|t| t.1).collect();
            let (host_ms, event_ms) = (median(&mut host), median(&mut event));
            let huge =
                if shares.is_empty() { "?".to_string() } else { format!("{:.0}%", 100.0 * median(shares)) };
            println!(
                "{:<14} {kind:<5} {:>10} {:>6} {event_ms:>9.2} {:>7.2} {:>15} {host_ms:>9.2} {:>7.2} {huge:>5}",
                v.name,
                v.bytes,
                v.copies,
                gbps(event_ms),
                format!("[{:.2}–{:.2}]", gbps(event[event.len() - 1]), gbps(event[0])),
                gbps(host_ms),
            );
        }
    }
    Ok(())
}

/// The flush buffer's bytes.
fn flush_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: any u64 slice is a valid byte slice of 8× its length.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), words.len() * 8) }
}
