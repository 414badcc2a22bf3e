//! `exec::cuda`: the only module that touches cudarc. Everything cudarc returns is turned into
//! [`ExecError`] here, at the call site, and no cudarc type appears in a public signature.
//!
//! [`probe`] checks that libcuda, libnvrtc and libcublas can be loaded (cudarc's `dynamic-loading` panics on
//! the first call into a missing library, TOOLCHAIN.md) and that a device exists. [`Gpu`] is the one device
//! handle: the context with cudarc's event tracking disabled (the executor orders its streams with its own
//! [`Event`]s), three streams ([`Stream::Compute`], [`Stream::H2d`], [`Stream::D2h`]), one cuBLAS handle bound
//! to the compute stream with a workspace we allocate (so cuBLAS allocates nothing later), and a cache of
//! compiled NVRTC modules ([`Kernels`]). Device memory is raw `cuMemAlloc` ([`DevBuf`]): the executor takes one
//! arena and carves it itself, so the stream-ordered pool (which keeps freed memory) is never used.
//! Device pointers are plain `u64` addresses inside an arena; every launch says in its `SAFETY` comment which
//! sizes it relies on.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::{result as cublas_result, sys as cublas_sys};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg, result, sys,
};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use pipeshard_core::workload::{GROUPED_EXPERTS_MAX_TOKENS, MAX_KEY_SPLITS};

use crate::error::{ExecError, Result};
use crate::host::{Elem, HostBuf};
use crate::quant::{EXACT_MAX_TOKENS, QFormat};
use crate::seqs::GpuKeys;
use crate::weights::ExpertOffsets;

pub mod tiled;

const KERNELS_CU: &str = include_str!("kernels.cu");
/// cuBLAS workspace we hand it (NVIDIA recommends 32 MiB on Hopper).
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;
/// Where a quantised matrix is dequantised, a chunk of rows at a time, for cuBLAS (prefill). Allocated on the
/// first such matmul, which the warm-up runs, so it counts in the measured runtime overhead.
pub const DEQUANT_SCRATCH_BYTES: usize = 16 << 20;
/// Rows one warp of the quantised GEMV kernels computes (`QROWS` in kernels.cu): they share each activation
/// load and conversion.
const GEMV_ROWS_PER_WARP: usize = 4;
/// Rows one block of four warps of the tensor-core GEMV (q4_k) computes: the M of its mma.
const TC_GEMV_ROWS: usize = 16;
/// Threads of an `attn_combine` block (its `COMBINE_WARPS` warps), one block per query and head.
const COMBINE_THREADS: u32 = 16 * 32;

/// The kernel parameter array `cuLaunchKernelEx` takes: a pointer to each (mutable) local, in order.
macro_rules! kernel_params {
    ($($x:ident),* $(,)?) => { [$((&raw mut $x).cast::<c_void>()),*] };
}

fn driver_err(call: &'static str) -> impl Fn(result::DriverError) -> ExecError {
    move |e| ExecError::Cuda { call, reason: format!("{e:?}") }
}

fn cublas_err(call: &'static str) -> impl Fn(cublas_result::CublasError) -> ExecError {
    move |e| ExecError::Cuda { call, reason: format!("{e:?}") }
}

/// Whether a CUDA device is usable here, and if not, why.
pub fn probe() -> std::result::Result<String, String> {
    // SAFETY: `is_culib_present` only tries to dlopen the library and reports whether that worked.
    let (driver, nvrtc, cublas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
        )
    };
    let missing: Vec<&str> = [(driver, "libcuda"), (nvrtc, "libnvrtc"), (cublas, "libcublas")]
        .iter()
        .filter(|(present, _)| !present)
        .map(|(_, name)| *name)
        .collect();
    if !missing.is_empty() {
        return Err(format!("{} not found", missing.join(", ")));
    }
    result::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
    let n = result::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))?;
    if n < 1 {
        return Err("no CUDA device".into());
    }
    let dev = result::device::get(0).map_err(|e| format!("cuDeviceGet failed: {e:?}"))?;
    result::device::get_name(dev).map_err(|e| format!("cuDeviceGetName failed: {e:?}"))
}

/// One of the executor's three streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Kernels, cuBLAS and activation copies.
    Compute,
    /// Weight and KV uploads of the streaming ring.
    H2d,
    /// KV write-back.
    D2h,
}

/// Which kernels a module is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelKey {
    /// Activation / matrix element type (f16 or bf16).
    pub act: Elem,
    /// KV cache element type.
    pub kv: Elem,
    /// Head dimension (multiple of 32, at most 256).
    pub head_dim: usize,
}

/// The compiled kernels of one [`KernelKey`].
#[derive(Debug)]
pub struct Kernels {
    key: KernelKey,
    embed: CudaFunction,
    norm_act: CudaFunction,
    rmsnorm_rows_f32: CudaFunction,
    add_bias: CudaFunction,
    copy_mapped: CudaFunction,
    copy_mapped_parts: CudaFunction,
    copy_inline_parts: CudaFunction,
    add_mapped: CudaFunction,
    spin: CudaFunction,
    rope: CudaFunction,
    rope_store_kv: CudaFunction,
    store_kv: CudaFunction,
    attention: CudaFunction,
    attn_combine: CudaFunction,
    swiglu: CudaFunction,
    relu2: CudaFunction,
    argmax: CudaFunction,
    gather_rows: CudaFunction,
    scatter_add_rows: CudaFunction,
    /// The grouped expert kernels by weight format (the first [`GROUPED_FORMATS`] of [`TILED_FORMATS`]).
    moe_gate_up_grouped: [CudaFunction; GROUPED_FORMATS],
    moe_down_grouped: [CudaFunction; GROUPED_FORMATS],
    /// The tiled expert kernels by weight format ([`TILED_FORMATS`]) and their combine.
    moe_gate_up_tiled: [CudaFunction; TILED_FORMATS.len()],
    moe_down_tiled: [CudaFunction; TILED_FORMATS.len()],
    moe_combine_tiled: CudaFunction,
    gemv_q8_0: CudaFunction,
    gemv_q4_0: CudaFunction,
    gemv1_q8_0: CudaFunction,
    gemv1_q4_0: CudaFunction,
    dequant_q8_0: CudaFunction,
    dequant_q4_0: CudaFunction,
    embed_q8_0: CudaFunction,
    embed_q4_0: CudaFunction,
    gemv_q4_k: CudaFunction,
    gemv_q6_k: CudaFunction,
    gemv1_q4_k: CudaFunction,
    gemv1_q6_k: CudaFunction,
    dequant_q4_k: CudaFunction,
    dequant_q6_k: CudaFunction,
    embed_q4_k: CudaFunction,
    embed_q6_k: CudaFunction,
    gemv_q2_k: CudaFunction,
    gemv_q3_k: CudaFunction,
    gemv1_q2_k: CudaFunction,
    gemv1_q3_k: CudaFunction,
    dequant_q2_k: CudaFunction,
    dequant_q3_k: CudaFunction,
    embed_q2_k: CudaFunction,
    embed_q3_k: CudaFunction,
    round_k23_x: CudaFunction,
    /// `decode_gemv` instances by rows a warp streams (1, 2, 4): plain input, normed input; normed input with
    /// SwiGLU (2, 4 rows: 1, 2 gate|up pairs) and with squared ReLU (1, 2 rows).
    decode_gemv_x: [CudaFunction; 4],
    decode_gemv_norm: [CudaFunction; 4],
    decode_gemv_norm_swiglu: [CudaFunction; 3],
    decode_gemv_norm_relu2: [CudaFunction; 3],
}

impl Kernels {
    /// What the module was compiled for.
    #[must_use]
    pub fn key(&self) -> KernelKey {
        self.key
    }
}

/// A raw device allocation, freed on drop.
#[derive(Debug)]
pub struct DevBuf {
    ctx: Arc<CudaContext>,
    ptr: u64,
    bytes: usize,
}

impl DevBuf {
    /// Device address of the first byte.
    #[must_use]
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: ptr came from malloc_sync in this context and is freed once; all streams using it were
        // synchronised by the owner before dropping.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// A CUDA event (with or without timing), destroyed on drop.
#[derive(Debug)]
pub struct Event {
    ctx: Arc<CudaContext>,
    raw: sys::CUevent,
}

// SAFETY: CUDA events are usable from any thread once the context is bound; we bind before every use.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: raw was created by event::create and is destroyed once.
        let _ = unsafe { result::event::destroy(self.raw) };
    }
}

/// The events that order one slot of a streaming ring between the H2D stream, which copies into it, and the
/// stream that reads it: the executor's protocol for every streamed unit, which the profiler times as the
/// host's cost of a streamed unit (`RingIssueProbe`).
#[derive(Debug)]
pub struct RingSlot {
    /// Recorded on the H2D stream after the slot's copies; the reader waits for it.
    copy_done: Event,
    /// Recorded by the reader after its last use; the next copy into the slot waits for it.
    slot_free: Event,
}

impl RingSlot {
    pub fn new(gpu: &Gpu) -> Result<RingSlot> {
        Ok(RingSlot { copy_done: gpu.event(false)?, slot_free: gpu.event(false)? })
    }

    /// Enqueues copies into the slot on the H2D stream: behind the previous tenant's release where the slot
    /// held one (`reused`), between two timing events (the copies' span, returned with what `copy` returns),
    /// then their completion. `copy` enqueues the copies themselves on the H2D stream.
    pub fn issue<T>(
        &self,
        gpu: &Gpu,
        reused: bool,
        copy: impl FnOnce() -> Result<T>,
    ) -> Result<(Event, Event, T)> {
        if reused {
            gpu.wait(Stream::H2d, &self.slot_free)?;
        }
        let start = gpu.mark(Stream::H2d)?;
        let out = copy()?;
        let end = gpu.mark(Stream::H2d)?;
        gpu.record(&self.copy_done, Stream::H2d)?;
        Ok((start, end, out))
    }

    /// Makes `reader` wait for the slot's copies.
    pub fn acquire(&self, gpu: &Gpu, reader: Stream) -> Result<()> {
        gpu.wait(reader, &self.copy_done)
    }

    /// Frees the slot for its next copies once what `reader` has queued so far has run.
    pub fn release(&self, gpu: &Gpu, reader: Stream) -> Result<()> {
        gpu.record(&self.slot_free, reader)
    }
}

/// Host memory page-locked in place; unregistered on drop, which must happen before the buffer is freed.
#[derive(Debug)]
pub struct HostRegistration {
    ctx: Arc<CudaContext>,
    ptr: *mut c_void,
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: ptr was registered by cuMemHostRegister and the buffer is still alive (the contract of
        // `Gpu::register`).
        let _ = unsafe { sys::cuMemHostUnregister(self.ptr) };
    }
}

/// A 32-bit flag in page-locked host memory mapped for the device: [`Gpu::wait_flag`] holds a stream until
/// the host stores a value at least the one waited for ([`HostFlag::release`]), so that the host can enqueue
/// work before its inputs exist and release it later without a launch.
#[derive(Debug)]
pub struct HostFlag {
    // Declared before `buf`: unregistered before the memory is freed.
    _reg: HostRegistration,
    buf: HostBuf,
    dev: u64,
}

impl HostFlag {
    /// Lets every stream waiting for a value up to `value` (cyclically, see [`Gpu::wait_flag`]) run on.
    ///
    /// Ordering: the calling thread's earlier stores (the data the released work copies from page-locked host
    /// memory) are globally visible before the flag's. The fence orders even non-temporal stores (which x86's
    /// store order leaves out) and keeps the compiler from sinking stores past it; the copy engine's reads of
    /// host memory are cache-coherent, and the work behind the wait starts only once the device has read the
    /// new value, so it reads the data as written.
    pub fn release(&self, value: u32) {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.atomic().store(value, Ordering::Release);
    }

    fn atomic(&self) -> &AtomicU32 {
        // SAFETY: the buffer is page-aligned (so 4-aligned), at least 4 bytes long and lives as long as self;
        // the host touches those 4 bytes only through this atomic (the device only reads them).
        unsafe { AtomicU32::from_ptr(self.buf.as_ptr().cast()) }
    }
}

/// The device handle: context, streams, cuBLAS and compiled kernels.
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    h2d: Arc<CudaStream>,
    d2h: Arc<CudaStream>,
    cublas: cublas_sys::cublasHandle_t,
    _workspace: DevBuf,
    name: String,
    arch: Option<&'static str>,
    kernels: Mutex<HashMap<KernelKey, Arc<Kernels>>>,
    dequant_scratch: Mutex<Option<DevBuf>>,
    decode_gemv: AtomicBool,
}

// SAFETY: the cuBLAS handle is only used from the thread that drives the executor, with the context bound; the
// other fields are Send + Sync cudarc handles.
unsafe impl Send for Gpu {}
// SAFETY: as above; kernel cache access is behind a Mutex.
unsafe impl Sync for Gpu {}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the handle was created in `new` and is destroyed once.
        let _ = unsafe { cublas_result::destroy_handle(self.cublas) };
    }
}

/// The input of a one-token decode GEMV ([`Gpu::decode_gemv`]).
#[derive(Debug, Clone, Copy)]
pub enum GemvInput {
    /// `k` activations of the kernels' type at this address.
    Act(u64),
    /// The unit's input norm of the f32 residual row at `h`, as [`Gpu::norm_act`] computes it: f32 weight `w`,
    /// f32 bias `b` (0: none), LayerNorm or RMSNorm.
    Norm { h: u64, w: u64, b: u64, eps: f32, layer_norm: bool },
}

/// What a one-token decode GEMV writes ([`Gpu::decode_gemv`]).
#[derive(Debug, Clone, Copy)]
pub enum GemvOutput {
    /// `n` f32 at `y`, set or added to.
    Y { y: u64, accumulate: bool },
    /// `n` activations at `act`: silu(gate) · up from `2n` rows, gate's `n` then up's, as [`Gpu::ffn_act`].
    SwiGlu { act: u64 },
    /// `n` activations at `act`: max(up, 0)², as [`Gpu::ffn_act`] without a gate.
    Relu2 { act: u64 },
}

/// Warps a block of the decode GEMV (`DG_WARPS` in kernels.cu).
const DECODE_GEMV_WARPS: usize = 8;
/// The widest input the decode GEMV stages in a block's shared memory (48 KiB, the default limit).
pub const DECODE_GEMV_MAX_K: usize = 24 * 1024;
/// Below this many rows a one-token matmul stays with cuBLAS, whose split-K keeps the SMs busy (a router's
/// 128 rows would give the decode GEMV 16 blocks).
const DECODE_GEMV_MIN_ROWS: usize = 1024;

/// Whether [`Gpu::decode_gemv`] takes rows of `k` elements with these device addresses (rows and a plain input
/// are read 16 bytes at a time).
#[must_use]
pub fn decode_gemv_fits(k: usize, addrs: &[u64]) -> bool {
    k.is_multiple_of(8) && k <= DECODE_GEMV_MAX_K && addrs.iter().all(|a| a.is_multiple_of(16))
}

/// When a decode GEMV may start ([`Gpu::decode_gemv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EarlyStart {
    /// After the previous kernel in the stream ends, as any launch.
    AfterPrevious,
    /// While the previous kernel runs (programmatic dependent launch): the GEMV fetches its first weights,
    /// then waits for that kernel before it reads its input. Only for weights no earlier kernel writes and no
    /// copy still fills: pinned ones, or any after the unit's first kernel.
    UnderPrevious,
}

/// How a warp of the decode GEMV streams its rows: `rows` together, `loads` 16-byte loads of each in flight
/// (kernels.cu's instances `…_{rows}x{loads}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvShape {
    pub rows: usize,
    pub loads: usize,
}

impl GemvShape {
    /// Every instance of a plain or normed input with a plain output, in kernels.cu's order.
    pub const ALL: [GemvShape; 4] = [
        GemvShape { rows: 1, loads: 4 },
        GemvShape { rows: 2, loads: 4 },
        GemvShape { rows: 4, loads: 4 },
        GemvShape { rows: 2, loads: 8 },
    ];
    /// SwiGLU's instances (its rows come in gate|up pairs).
    pub const PAIRS: [GemvShape; 3] =
        [GemvShape { rows: 2, loads: 4 }, GemvShape { rows: 4, loads: 4 }, GemvShape { rows: 2, loads: 8 }];
    /// Squared ReLU's instances.
    pub const ONE_OUTPUT_A_ROW: [GemvShape; 3] =
        [GemvShape { rows: 1, loads: 4 }, GemvShape { rows: 2, loads: 4 }, GemvShape { rows: 2, loads: 8 }];
    /// The default: two rows a warp, four loads each, the fastest of these shapes at every part of nemo-8b's
    /// decode layer on the H200, each launched under the kernel before (results/exec/bounds/run11/
    /// decode-kernels.md: q|k|v 16.1, o 10.5, gate|up 48.4, down 26.1 µs; 2 × 8 18–19, 11.1, 48.8, 26.6).
    pub const DEFAULT: GemvShape = GemvShape { rows: 2, loads: 4 };
}

/// The decode GEMV's instances `{prefix}_{shape}` for `shapes`, in their order.
fn kernel_set<const N: usize>(
    shapes: [GemvShape; N],
    prefix: &str,
    f: impl Fn(&str) -> Result<CudaFunction>,
) -> Result<[CudaFunction; N]> {
    let fs = shapes.iter().map(|s| f(&format!("{prefix}_{s}"))).collect::<Result<Vec<_>>>()?;
    Ok(fs.try_into().unwrap_or_else(|_| unreachable!("one function a shape")))
}

/// The tiled expert kernels' instances `{prefix}_{format}`, in [`TILED_FORMATS`]' order.
fn tiled_set(
    prefix: &str,
    f: impl Fn(&str) -> Result<CudaFunction>,
) -> Result<[CudaFunction; TILED_FORMATS.len()]> {
    let fs = TILED_FORMATS.iter().map(|s| f(&format!("{prefix}_{s}"))).collect::<Result<Vec<_>>>()?;
    Ok(fs.try_into().unwrap_or_else(|_| unreachable!("one function a format")))
}

/// The grouped expert kernels' instances: `{prefix}` for the activation type, `{prefix}_{format}` for the
/// quantised formats, in [`TILED_FORMATS`]' order.
fn grouped_set(
    prefix: &str,
    f: impl Fn(&str) -> Result<CudaFunction>,
) -> Result<[CudaFunction; GROUPED_FORMATS]> {
    let name = |s: &str| if s == TILED_FORMATS[0] { prefix.to_string() } else { format!("{prefix}_{s}") };
    let fs = TILED_FORMATS[..GROUPED_FORMATS].iter().map(|s| f(&name(s))).collect::<Result<Vec<_>>>()?;
    Ok(fs.try_into().unwrap_or_else(|_| unreachable!("one function a format")))
}

impl std::fmt::Display for GemvShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.rows, self.loads)
    }
}

/// The widest row `norm_act` takes: 16 elements a thread in registers, 1024 threads.
pub const NORM_MAX_DIM: usize = 16 * 1024;

/// Up to [`MappedParts::MAX`] copies of 4-byte words from mapped host memory to the device, one kernel
/// argument ([`Gpu::copy_mapped_parts`]; `MappedParts` in kernels.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MappedParts {
    dst: [u64; 5],
    src: [u64; 5],
    words: [u64; 5],
}

// SAFETY: plain integers, laid out (`repr(C)`) as kernels.cu's `MappedParts`.
unsafe impl DeviceRepr for MappedParts {}

impl MappedParts {
    /// Parts one launch copies.
    pub const MAX: usize = 5;

    /// Adds a copy of `bytes` (a whole number of 4-byte words, both addresses 4-byte aligned) from `src`, a
    /// device address of mapped host memory ([`Gpu::register_mapped`]), to `dst`; an empty copy adds nothing.
    ///
    /// # Panics
    /// Past [`Self::MAX`] parts, or where `bytes` or an address is not a multiple of 4.
    pub fn push(&mut self, dst: u64, src: u64, bytes: usize) {
        if bytes == 0 {
            return;
        }
        assert!(
            bytes.is_multiple_of(4) && dst.is_multiple_of(4) && src.is_multiple_of(4),
            "4-byte words: {bytes} bytes {dst:#x} ← {src:#x}"
        );
        let k = self.words.iter().position(|&w| w == 0).expect("at most MappedParts::MAX parts");
        (self.dst[k], self.src[k], self.words[k]) = (dst, src, bytes as u64 / 4);
    }
}

/// Up to [`InlineParts::MAX`] copies of 4-byte words whose bytes ride in one launch's parameters
/// ([`Gpu::copy_inline_parts`]; `InlineParts` in kernels.cu): no copy engine and no reads of host memory.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct InlineParts {
    dst: [u64; 5],
    words: [u32; 5],
    data: [u32; InlineParts::WORDS],
}

// SAFETY: plain integers, laid out (`repr(C)`) as kernels.cu's `InlineParts`.
unsafe impl DeviceRepr for InlineParts {}

impl InlineParts {
    /// Parts one launch copies.
    pub const MAX: usize = 5;
    /// Words all parts of one launch hold together (kernels.cu's `INLINE_PARTS_WORDS`): a one-token step's
    /// routing with top 8 (41 words), in few bytes of parameters (see kernels.cu).
    pub const WORDS: usize = 64;

    /// The parts `(device destination, bytes)` in one launch's parameters, empty ones skipped; None where
    /// they are more than [`Self::MAX`] or hold more than [`Self::WORDS`] words together (the caller copies
    /// them another way).
    ///
    /// # Panics
    /// Where a part's length or destination is not a multiple of 4.
    #[must_use]
    pub fn new(parts: &[(u64, &[u8])]) -> Option<InlineParts> {
        let mut p = InlineParts { dst: [0; 5], words: [0; 5], data: [0; Self::WORDS] };
        let (mut k, mut at) = (0, 0);
        for &(dst, bytes) in parts.iter().filter(|(_, b)| !b.is_empty()) {
            assert!(
                bytes.len().is_multiple_of(4) && dst.is_multiple_of(4),
                "4-byte words: {} bytes to {dst:#x}",
                bytes.len()
            );
            let words = bytes.len() / 4;
            if k == Self::MAX || at + words > Self::WORDS {
                return None;
            }
            for (w, b) in p.data[at..at + words].iter_mut().zip(bytes.chunks_exact(4)) {
                *w = u32::from_le_bytes(b.try_into().expect("4 bytes"));
            }
            (p.dst[k], p.words[k]) = (dst, words as u32);
            (k, at) = (k + 1, at + words);
        }
        Some(p)
    }
}

fn threads_for(n: u64, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(u64::from(block)).max(1) as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Gpu {
    /// Opens device 0 (after [`probe`] succeeded).
    pub fn new() -> Result<Gpu> {
        let name = probe().map_err(|reason| ExecError::NoCuda { reason })?;
        let ctx = CudaContext::new(0)
            .map_err(|e| ExecError::NoCuda { reason: format!("context creation failed: {e:?}") })?;
        // SAFETY: called before any stream or allocation exists; the executor orders streams with its own events.
        unsafe { ctx.disable_event_tracking() };
        let compute = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let h2d = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let d2h = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let cublas = cublas_result::create_handle().map_err(cublas_err("cublasCreate"))?;
        // SAFETY: handle and stream are valid and live as long as self.
        unsafe { cublas_result::set_stream(cublas, compute.cu_stream().cast()) }
            .map_err(cublas_err("cublasSetStream"))?;
        let workspace = Self::alloc_in(&ctx, CUBLAS_WORKSPACE_BYTES)?;
        // SAFETY: the workspace is a live device allocation of CUBLAS_WORKSPACE_BYTES owned by self.
        unsafe {
            cublas_sys::cublasSetWorkspace_v2(cublas, workspace.ptr as *mut c_void, CUBLAS_WORKSPACE_BYTES)
        }
        .result()
        .map_err(cublas_err("cublasSetWorkspace"))?;
        let (major, minor) = ctx.compute_capability().map_err(driver_err("cuDeviceGetAttribute"))?;
        let arch = match (major, minor) {
            (9, 0) => Some("compute_90"),
            (8, 9) => Some("compute_89"),
            (8, 6) => Some("compute_86"),
            (8, 0) => Some("compute_80"),
            (12, 0) => Some("compute_120"),
            _ => None,
        };
        Ok(Gpu {
            ctx,
            compute,
            h2d,
            d2h,
            cublas,
            _workspace: workspace,
            name,
            arch,
            kernels: Mutex::new(HashMap::new()),
            dequant_scratch: Mutex::new(None),
            decode_gemv: AtomicBool::new(true),
        })
    }

    /// The device name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    fn stream(&self, s: Stream) -> &Arc<CudaStream> {
        match s {
            Stream::Compute => &self.compute,
            Stream::H2d => &self.h2d,
            Stream::D2h => &self.d2h,
        }
    }

    /// Makes the context current on the calling thread (needed once per thread before copies or launches).
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        let (free, total) = self.ctx.mem_get_info().map_err(driver_err("cuMemGetInfo"))?;
        Ok((free as u64, total as u64))
    }

    fn alloc_in(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DevBuf> {
        ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: a plain device allocation of `bytes` bytes; freed by DevBuf's Drop.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(driver_err("cuMemAlloc"))?;
        Ok(DevBuf { ctx: ctx.clone(), ptr, bytes })
    }

    /// A raw device allocation of `bytes` bytes.
    pub fn alloc(&self, bytes: usize) -> Result<DevBuf> {
        Self::alloc_in(&self.ctx, bytes)
    }

    /// Page-locks `buf` in place so copies from and to it are true DMA.
    ///
    /// # Safety
    /// `buf` must outlive the returned guard (drop the guard first), and must not be registered twice.
    pub unsafe fn register(&self, buf: &HostBuf) -> Result<HostRegistration> {
        // SAFETY: forwarded from the caller.
        unsafe { self.register_with(buf, 0) }
    }

    /// [`Gpu::register`], and maps `buf` into the device's address space: the device address of its first
    /// byte comes back, for kernels that read it over PCIe ([`Gpu::copy_mapped`]).
    ///
    /// # Safety
    /// As [`Gpu::register`].
    pub unsafe fn register_mapped(&self, buf: &HostBuf) -> Result<(HostRegistration, u64)> {
        // SAFETY: forwarded from the caller.
        let reg = unsafe { self.register_with(buf, sys::CU_MEMHOSTREGISTER_DEVICEMAP) }?;
        let mut dev = 0;
        // SAFETY: `buf` was registered with DEVICEMAP just above; `dev` is a live out-parameter.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&raw mut dev, buf.as_ptr().cast(), 0) }
            .result()
            .map_err(driver_err("cuMemHostGetDevicePointer"))?;
        Ok((reg, dev))
    }

    /// [`Gpu::register`] with `cuMemHostRegister` flags.
    ///
    /// # Safety
    /// As [`Gpu::register`].
    unsafe fn register_with(&self, buf: &HostBuf, flags: u32) -> Result<HostRegistration> {
        self.bind()?;
        let ptr = buf.as_ptr().cast::<c_void>();
        // SAFETY: ptr spans capacity_bytes of live, page-aligned memory owned by `buf`, which the caller keeps
        // alive until the guard unregisters it.
        unsafe { sys::cuMemHostRegister_v2(ptr, buf.capacity_bytes(), flags) }
            .result()
            .map_err(driver_err("cuMemHostRegister"))?;
        Ok(HostRegistration { ctx: self.ctx.clone(), ptr })
    }

    /// A [`HostFlag`] at 0, once a wait on it has run on the compute stream: the device attribute of stream
    /// memory operations (`CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1`) describes the deprecated v1 calls,
    /// not the `_v2` ones used here, so the trial wait is the check. An error means the device or driver cannot
    /// do it: the caller runs without.
    pub fn host_flag(&self) -> Result<HostFlag> {
        let buf = HostBuf::zeroed(4);
        // SAFETY: the flag owns `buf` and declares the guard first, so it unregisters before the buffer is freed;
        // the buffer is new, so registered once.
        let (reg, dev) = unsafe { self.register_mapped(&buf) }?;
        let flag = HostFlag { _reg: reg, buf, dev };
        // SAFETY: the flag lives past the sync below, and holds 0, which the wait for ≥ 0 is satisfied by.
        unsafe { self.wait_flag(Stream::Compute, &flag, 0)? };
        self.sync(Stream::Compute)?;
        Ok(flag)
    }

    /// Makes stream `s` wait until `flag` holds `value` or later in cyclic order (`(i32)(flag − value) ≥ 0`, so
    /// sequence numbers may wrap).
    ///
    /// # Safety
    /// `flag` outlives the wait, and the host releases it to `value` or later: until then the stream, and any
    /// host sync on it, waits (a guard that releases on drop covers error paths).
    pub unsafe fn wait_flag(&self, s: Stream, flag: &HostFlag, value: u32) -> Result<()> {
        // SAFETY: flag.dev is the device address of a live, registered 4-byte host word; the caller keeps it
        // alive and releases it.
        unsafe {
            sys::cuStreamWaitValue32_v2(
                self.stream(s).cu_stream(),
                flag.dev,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        }
        .result()
        .map_err(driver_err("cuStreamWaitValue32"))
    }

    /// A new event; `timing` events can be measured with [`Gpu::elapsed_ms`].
    pub fn event(&self, timing: bool) -> Result<Event> {
        self.bind()?;
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let raw = result::event::create(flags).map_err(driver_err("cuEventCreate"))?;
        Ok(Event { ctx: self.ctx.clone(), raw })
    }

    /// Records `ev` on stream `s`.
    pub fn record(&self, ev: &Event, s: Stream) -> Result<()> {
        // SAFETY: both handles are live.
        unsafe { result::event::record(ev.raw, self.stream(s).cu_stream()) }
            .map_err(driver_err("cuEventRecord"))
    }

    /// A new timing event recorded on stream `s`: one end of a timeline span.
    pub fn mark(&self, s: Stream) -> Result<Event> {
        let ev = self.event(true)?;
        self.record(&ev, s)?;
        Ok(ev)
    }

    /// Makes stream `s` wait for the last recording of `ev`.
    pub fn wait(&self, s: Stream, ev: &Event) -> Result<()> {
        // SAFETY: both handles are live.
        unsafe {
            result::stream::wait_event(
                self.stream(s).cu_stream(),
                ev.raw,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(driver_err("cuStreamWaitEvent"))
    }

    /// Blocks the host until stream `s` is idle.
    pub fn sync(&self, s: Stream) -> Result<()> {
        self.stream(s).synchronize().map_err(driver_err("cuStreamSynchronize"))
    }

    /// Blocks the host until every stream is idle.
    pub fn sync_all(&self) -> Result<()> {
        for s in [Stream::Compute, Stream::H2d, Stream::D2h] {
            self.sync(s)?;
        }
        Ok(())
    }

    /// Blocks the host until the last recording of `ev` has completed.
    pub fn sync_event(&self, ev: &Event) -> Result<()> {
        self.bind()?;
        // SAFETY: ev is a live event of this context.
        unsafe { result::event::synchronize(ev.raw) }.map_err(driver_err("cuEventSynchronize"))
    }

    /// Milliseconds between two completed timing events.
    pub fn elapsed_ms(&self, start: &Event, end: &Event) -> Result<f32> {
        // SAFETY: both are live timing events that have completed (the caller synchronised).
        unsafe { result::event::elapsed(start.raw, end.raw) }.map_err(driver_err("cuEventElapsedTime"))
    }

    /// Copies `src` to device address `dst` on stream `s`.
    ///
    /// # Safety
    /// `dst..dst+src.len()` lies inside a live allocation, and `src` stays alive and unmodified until the copy
    /// completes (the caller orders that with an event or a sync). For overlap `src` must be page-locked.
    pub unsafe fn h2d(&self, s: Stream, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: forwarded from the caller.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), self.stream(s).cu_stream()) }
            .result()
            .map_err(driver_err("cuMemcpyHtoDAsync"))
    }

    /// Copies `dst.len()` bytes from device address `src` into `dst` on stream `s`.
    ///
    /// # Safety
    /// `src..src+dst.len()` lies inside a live allocation, and `dst` stays alive and is not read until the copy
    /// completes.
    pub unsafe fn d2h(&self, s: Stream, dst: &mut [u8], src: u64) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: forwarded from the caller.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), self.stream(s).cu_stream())
        }
        .result()
        .map_err(driver_err("cuMemcpyDtoHAsync"))
    }

    /// Copies `bytes` bytes between device addresses on stream `s`.
    ///
    /// # Safety
    /// Both ranges lie inside live allocations and do not overlap.
    pub unsafe fn d2d(&self, s: Stream, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream(s).cu_stream()) }
            .map_err(driver_err("cuMemcpyDtoDAsync"))
    }

    /// The kernels for `key`, compiled on first use and cached.
    pub fn kernels(&self, key: KernelKey) -> Result<Arc<Kernels>> {
        let mut cache = self.kernels.lock().expect("kernel cache lock");
        if let Some(k) = cache.get(&key) {
            return Ok(k.clone());
        }
        self.bind()?;
        let kv_kind = match key.kv {
            Elem::F32 => 0,
            Elem::F16 => 1,
            Elem::Bf16 => 2,
        };
        let opts = CompileOptions {
            arch: self.arch,
            options: vec![
                format!("-DACT_BF16={}", i32::from(key.act == Elem::Bf16)),
                format!("-DKV_KIND={kv_kind}"),
                format!("-DHEAD_DIM={}", key.head_dim),
            ],
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(KERNELS_CU, opts)
            .map_err(|e| ExecError::Cuda { call: "nvrtcCompileProgram", reason: format!("{e:?}") })?;
        let module = self.ctx.load_module(ptx).map_err(driver_err("cuModuleLoadData"))?;
        let f = |name: &str| module.load_function(name).map_err(driver_err("cuModuleGetFunction"));
        let k = Arc::new(Kernels {
            key,
            embed: f("embed")?,
            norm_act: f("norm_act")?,
            rmsnorm_rows_f32: f("rmsnorm_rows_f32")?,
            add_bias: f("add_bias")?,
            copy_mapped: f("copy_mapped")?,
            copy_mapped_parts: f("copy_mapped_parts")?,
            copy_inline_parts: f("copy_inline_parts")?,
            add_mapped: f("add_mapped")?,
            spin: f("spin")?,
            rope: f("rope")?,
            rope_store_kv: f("rope_store_kv")?,
            store_kv: f("store_kv")?,
            attention: f("attention")?,
            attn_combine: f("attn_combine")?,
            swiglu: f("swiglu")?,
            relu2: f("relu2")?,
            argmax: f("argmax")?,
            gather_rows: f("gather_rows")?,
            scatter_add_rows: f("scatter_add_rows")?,
            moe_gate_up_grouped: grouped_set("moe_gate_up_grouped", f)?,
            moe_down_grouped: grouped_set("moe_down_grouped", f)?,
            moe_gate_up_tiled: tiled_set("moe_gate_up_tiled", f)?,
            moe_down_tiled: tiled_set("moe_down_tiled", f)?,
            moe_combine_tiled: f("moe_combine_tiled")?,
            gemv_q8_0: f("gemv_q8_0")?,
            gemv_q4_0: f("gemv_q4_0")?,
            gemv1_q8_0: f("gemv1_q8_0")?,
            gemv1_q4_0: f("gemv1_q4_0")?,
            dequant_q8_0: f("dequant_q8_0")?,
            dequant_q4_0: f("dequant_q4_0")?,
            embed_q8_0: f("embed_q8_0")?,
            embed_q4_0: f("embed_q4_0")?,
            gemv_q4_k: f("gemv_q4_k")?,
            gemv_q6_k: f("gemv_q6_k")?,
            gemv1_q4_k: f("gemv1_q4_k")?,
            gemv1_q6_k: f("gemv1_q6_k")?,
            dequant_q4_k: f("dequant_q4_k")?,
            dequant_q6_k: f("dequant_q6_k")?,
            embed_q4_k: f("embed_q4_k")?,
            embed_q6_k: f("embed_q6_k")?,
            gemv_q2_k: f("gemv_q2_k")?,
            gemv_q3_k: f("gemv_q3_k")?,
            gemv1_q2_k: f("gemv1_q2_k")?,
            gemv1_q3_k: f("gemv1_q3_k")?,
            dequant_q2_k: f("dequant_q2_k")?,
            dequant_q3_k: f("dequant_q3_k")?,
            embed_q2_k: f("embed_q2_k")?,
            embed_q3_k: f("embed_q3_k")?,
            round_k23_x: f("round_k23_x")?,
            decode_gemv_x: kernel_set(GemvShape::ALL, "decode_gemv_x", f)?,
            decode_gemv_norm: kernel_set(GemvShape::ALL, "decode_gemv_norm", f)?,
            decode_gemv_norm_swiglu: kernel_set(GemvShape::PAIRS, "decode_gemv_norm_swiglu", f)?,
            decode_gemv_norm_relu2: kernel_set(GemvShape::ONE_OUTPUT_A_ROW, "decode_gemv_norm_relu2", f)?,
        });
        cache.insert(key, k.clone());
        Ok(k)
    }

    /// `y[m, n] (+)= x[m, k] · w[n, k]ᵀ` on the compute stream: `w` and `x` in `act` (f16/bf16), `y` f32, f32
    /// accumulation (cuBLAS GemmEx; column-major view: yᵀ = w · xᵀ with `transa = T`).
    ///
    /// # Safety
    /// `w` holds `n × k`, `x` holds `m × k` elements of `act`, and `y` holds `m × n` f32, all in live
    /// allocations.
    pub unsafe fn gemm(
        &self,
        act: Elem,
        w: u64,
        x: u64,
        y: u64,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        // SAFETY: forwarded; row stride n.
        unsafe { self.gemm_strided(act, w, x, y, m, n, k, n, accumulate) }
    }

    /// [`Gpu::gemm`] writing columns of a wider `y` (row stride `ldy` ≥ `n`): how a chunk of a matrix's rows
    /// fills its slice of the output.
    ///
    /// # Safety
    /// As [`Gpu::gemm`], with `y` holding `(m − 1) × ldy + n` f32.
    unsafe fn gemm_strided(
        &self,
        act: Elem,
        w: u64,
        x: u64,
        y: u64,
        m: usize,
        n: usize,
        k: usize,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        let dt = if act == Elem::Bf16 {
            cublas_sys::cudaDataType::CUDA_R_16BF
        } else {
            cublas_sys::cudaDataType::CUDA_R_16F
        };
        let alpha = 1f32;
        let beta = if accumulate { 1f32 } else { 0f32 };
        // SAFETY: sizes as documented by the caller; alpha/beta are host scalars alive for the call.
        unsafe {
            cublas_result::gemm_ex(
                self.cublas,
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                std::ptr::from_ref(&alpha).cast(),
                w as *const c_void,
                dt,
                k as i32,
                x as *const c_void,
                dt,
                k as i32,
                std::ptr::from_ref(&beta).cast(),
                y as *mut c_void,
                cublas_sys::cudaDataType::CUDA_R_32F,
                ldy as i32,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(cublas_err("cublasGemmEx"))
    }

    /// Whether one-token matmuls over matrices in the activation type take [`Gpu::decode_gemv`] (the default)
    /// rather than cuBLAS, and the executor folds a unit's input norm and FFN activation into them: the
    /// `exec run --decode-gemv` A/B.
    pub fn set_decode_gemv(&self, on: bool) {
        self.decode_gemv.store(on, Ordering::Relaxed);
    }

    /// See [`Gpu::set_decode_gemv`].
    #[must_use]
    pub fn decode_gemv_on(&self) -> bool {
        self.decode_gemv.load(Ordering::Relaxed)
    }

    /// One token's `w[n', k] · x` over rows in the activation type, with the unit's input norm as `input` and
    /// an activation as `output` where they are folded in (see `decode_gemv` in kernels.cu), two rows a warp.
    ///
    /// # Safety
    /// `w` holds the rows `output` reads (`n`, or `2n` for SwiGLU), `input`'s addresses `k` elements (f32 for
    /// the norm's row, weight and bias), `output`'s `n` elements, all in live allocations;
    /// [`decode_gemv_fits`] holds for `k`, `w` and a plain input's address.
    pub unsafe fn decode_gemv(
        &self,
        kn: &Kernels,
        w: u64,
        n: usize,
        k: usize,
        input: GemvInput,
        output: GemvOutput,
        early: EarlyStart,
    ) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.decode_gemv_with(kn, w, n, k, input, output, GemvShape::DEFAULT, early) }
    }

    /// [`Gpu::decode_gemv`] with `rows` rows a warp (1, 2 or 4; SwiGLU 2 or 4, squared ReLU 1 or 2): the
    /// bench's variants.
    ///
    /// # Safety
    /// As [`Gpu::decode_gemv`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn decode_gemv_with(
        &self,
        kn: &Kernels,
        w: u64,
        n: usize,
        k: usize,
        input: GemvInput,
        output: GemvOutput,
        shape: GemvShape,
        early: EarlyStart,
    ) -> Result<()> {
        let plain = match input {
            GemvInput::Act(x) => x,
            GemvInput::Norm { .. } => 0,
        };
        if !decode_gemv_fits(k, &[w, plain]) {
            return Err(ExecError::Input(format!(
                "decode_gemv: rows of {k} elements at {w:#x} (input {plain:#x}): k must be a multiple of 8 up \
                 to {DECODE_GEMV_MAX_K}, addresses 16-byte aligned"
            )));
        }
        let at = |shapes: &[GemvShape]| shapes.iter().position(|&s| s == shape);
        let f = match (input, output) {
            (GemvInput::Act(_), GemvOutput::Y { .. }) => at(&GemvShape::ALL).map(|i| &kn.decode_gemv_x[i]),
            (GemvInput::Norm { .. }, GemvOutput::Y { .. }) => {
                at(&GemvShape::ALL).map(|i| &kn.decode_gemv_norm[i])
            }
            (GemvInput::Norm { .. }, GemvOutput::SwiGlu { .. }) => {
                at(&GemvShape::PAIRS).map(|i| &kn.decode_gemv_norm_swiglu[i])
            }
            (GemvInput::Norm { .. }, GemvOutput::Relu2 { .. }) => {
                at(&GemvShape::ONE_OUTPUT_A_ROW).map(|i| &kn.decode_gemv_norm_relu2[i])
            }
            (GemvInput::Act(_), _) => None,
        }
        .ok_or_else(|| {
            ExecError::Input(format!("decode_gemv: no instance for {input:?} → {output:?} at {shape}"))
        })?;
        let rows = shape.rows;
        let (h, nw, nb, eps, ln) = match input {
            GemvInput::Act(_) => (0u64, 0u64, 0u64, 0f32, 0i32),
            GemvInput::Norm { h, w, b, eps, layer_norm } => (h, w, b, eps, i32::from(layer_norm)),
        };
        let (y, act, acc) = match output {
            GemvOutput::Y { y, accumulate } => (y, 0u64, i32::from(accumulate)),
            GemvOutput::SwiGlu { act } | GemvOutput::Relu2 { act } => (0, act, 0),
        };
        let outs_per_warp = if matches!(output, GemvOutput::SwiGlu { .. }) { rows / 2 } else { rows };
        let warps = n.div_ceil(outs_per_warp);
        let cfg = LaunchConfig {
            grid_dim: (warps.div_ceil(DECODE_GEMV_WARPS) as u32, 1, 1),
            block_dim: ((DECODE_GEMV_WARPS * 32) as u32, 1, 1),
            // The input, normed or not, is staged in shared memory.
            shared_mem_bytes: (2 * k) as u32,
        };
        let (mut n, mut k) = (n as i32, k as i32);
        let (mut w, mut plain, mut h, mut nw, mut nb, mut eps, mut ln, mut y, mut act, mut acc) =
            (w, plain, h, nw, nb, eps, ln, y, act, acc);
        let mut params = kernel_params![w, plain, h, nw, nb, eps, ln, y, act, n, k, acc];
        // SAFETY: the parameters match the kernel's, in order, and live through the call; sizes and alignment
        // as documented and checked above; with `early`, the caller's weights are complete before the previous
        // kernel (the kernel reads nothing else before its `griddepcontrol.wait`).
        unsafe { self.launch_ex(f, cfg, &mut params, early == EarlyStart::UnderPrevious, "decode_gemv") }
    }

    /// Launches `f` on the compute stream through `cuLaunchKernelEx`, with programmatic stream serialization
    /// where `programmatic`: the kernel may begin while the one before it runs (sm_90; the driver ignores the
    /// attribute elsewhere).
    ///
    /// # Safety
    /// `params` point to the kernel's parameters, in order; the kernel waits (`griddepcontrol.wait`) before it
    /// touches anything the previous kernel writes.
    unsafe fn launch_ex(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &mut [*mut c_void],
        programmatic: bool,
        kernel: &'static str,
    ) -> Result<()> {
        self.bind()?;
        // SAFETY: a zeroed attribute is a valid plain-data value; its id and value are set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.compute.cu_stream(),
            attrs: &raw mut attr,
            numAttrs: u32::from(programmatic),
        };
        // SAFETY: forwarded from the caller; config and attr live through the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &raw const config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| ExecError::Cuda { call: "cuLaunchKernelEx", reason: format!("{kernel}: {e:?}") })
    }

    /// The device address of the scratch quantised matrices are dequantised into before cuBLAS reads them
    /// ([`DEQUANT_SCRATCH_BYTES`], taken on first use). Kernels on the compute stream use it in turn.
    fn dequant_scratch(&self) -> Result<u64> {
        let mut scratch = self.dequant_scratch.lock().expect("dequant scratch lock");
        if scratch.is_none() {
            *scratch = Some(self.alloc(DEQUANT_SCRATCH_BYTES)?);
        }
        Ok(scratch.as_ref().map_or(0, DevBuf::ptr))
    }

    /// `dst[i]` = element `i` of the `fmt` blocks at `src`, dequantised and rounded to the activation type, for
    /// `elems` elements (whole blocks; consecutive matrices of whole-block rows dequantise as one).
    ///
    /// # Safety
    /// `src` holds `elems` elements of whole `fmt` blocks, `dst` `elems` activations.
    unsafe fn dequantize(&self, kn: &Kernels, fmt: QFormat, src: u64, dst: u64, elems: usize) -> Result<()> {
        let f = match fmt {
            QFormat::Q8_0 => &kn.dequant_q8_0,
            QFormat::Q4_0 => &kn.dequant_q4_0,
            QFormat::Q4K => &kn.dequant_q4_k,
            QFormat::Q6K => &kn.dequant_q6_k,
            QFormat::Q2K => &kn.dequant_q2_k,
            QFormat::Q3K => &kn.dequant_q3_k,
        };
        let elems = elems as u64;
        // SAFETY: the kernel reads `elems` elements' blocks at src and writes `elems` activations at dst.
        unsafe {
            self.compute.launch_builder(f).arg(&src).arg(&dst).arg(&elems).launch(threads_for(elems, 256))
        }
        .map(|_| ())
        .map_err(driver_err("cuLaunchKernel(dequant_q)"))
    }

    /// `y[m, n] (+)= x[m, k] · w[n, k]ᵀ` with `w` stored as `quant` (or in the activation type when `None`: one
    /// token's product of at least 1024 rows through [`Gpu::decode_gemv`] where it is on, else cuBLAS):
    /// up to [`EXACT_MAX_TOKENS`] tokens a GEMV kernel (`QMAX_T` in kernels.cu) that dequantises as it reads (exact f32 weights);
    /// more tokens dequantise chunks of rows into [`DEQUANT_SCRATCH_BYTES`] (rounded to the activation type)
    /// and run cuBLAS on each.
    ///
    /// # Safety
    /// `w` holds `n` rows of `k` elements in its format (`k` a multiple of its block when quantised; 16-byte
    /// aligned), `x` `m × k` activations of `kn`'s type, `y` `m × n` f32, all in live allocations.
    pub unsafe fn matmul(
        &self,
        kn: &Kernels,
        quant: Option<QFormat>,
        w: u64,
        x: u64,
        y: u64,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.matmul_early(kn, quant, w, x, y, m, n, k, accumulate, EarlyStart::AfterPrevious) }
    }

    /// [`Gpu::matmul`], a one-token product through the decode GEMV starting as `early` says (the other paths
    /// start after the previous kernel).
    ///
    /// # Safety
    /// As [`Gpu::matmul`], and as [`EarlyStart`] says for its weights.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul_early(
        &self,
        kn: &Kernels,
        quant: Option<QFormat>,
        w: u64,
        x: u64,
        y: u64,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
        early: EarlyStart,
    ) -> Result<()> {
        let act = kn.key.act;
        let Some(fmt) = quant else {
            if m == 1 && n >= DECODE_GEMV_MIN_ROWS && self.decode_gemv_on() && decode_gemv_fits(k, &[w, x]) {
                // SAFETY: forwarded; fits checked.
                return unsafe {
                    let y = GemvOutput::Y { y, accumulate };
                    self.decode_gemv(kn, w, n, k, GemvInput::Act(x), y, early)
                };
            }
            // SAFETY: forwarded.
            return unsafe { self.gemm(act, w, x, y, m, n, k, accumulate) };
        };
        if m <= EXACT_MAX_TOKENS {
            let f = match (fmt, m) {
                (QFormat::Q8_0, 1) => &kn.gemv1_q8_0,
                (QFormat::Q4_0, 1) => &kn.gemv1_q4_0,
                (QFormat::Q8_0, _) => &kn.gemv_q8_0,
                (QFormat::Q4_0, _) => &kn.gemv_q4_0,
                (QFormat::Q4K, 1) => &kn.gemv1_q4_k,
                (QFormat::Q6K, 1) => &kn.gemv1_q6_k,
                (QFormat::Q4K, _) => &kn.gemv_q4_k,
                (QFormat::Q6K, _) => &kn.gemv_q6_k,
                (QFormat::Q2K, 1) => &kn.gemv1_q2_k,
                (QFormat::Q3K, 1) => &kn.gemv1_q3_k,
                (QFormat::Q2K, _) => &kn.gemv_q2_k,
                (QFormat::Q3K, _) => &kn.gemv_q3_k,
            };
            let (n32, k32, m32, acc) = (n as i32, k as i32, m as i32, i32::from(accumulate));
            let cfg = if fmt == QFormat::Q4K {
                // Tensor-core kernel: a block of four warps per TC_GEMV_ROWS rows.
                threads_for(n.div_ceil(TC_GEMV_ROWS) as u64 * 128, 128)
            } else {
                // Four warps per block, GEMV_ROWS_PER_WARP rows each.
                threads_for(n.div_ceil(GEMV_ROWS_PER_WARP) as u64 * 32, 128)
            };
            // SAFETY: argument types match the kernel; the kernel reads n rows of whole blocks of w (a warp's
            // rows past n re-read row n − 1; q4_k's 16-byte loads need 16-byte aligned rows, which tensors are:
            // `weights::TENSOR_ALIGN_BYTES` in units, `layout::REGION_ALIGN_BYTES` in the arena) and m rows of k
            // activations, and writes y[t·n + r] for t < m, r < n (the caller's sizes).
            return unsafe {
                self.compute
                    .launch_builder(f)
                    .arg(&w)
                    .arg(&x)
                    .arg(&y)
                    .arg(&n32)
                    .arg(&k32)
                    .arg(&m32)
                    .arg(&acc)
                    .launch(cfg)
            }
            .map(|_| ())
            .map_err(driver_err("cuLaunchKernel(gemv_q)"));
        }
        let sp = self.dequant_scratch()?;
        let chunk_rows = (DEQUANT_SCRATCH_BYTES / (k * act.size_bytes())).max(1).min(n);
        let mut r0 = 0;
        while r0 < n {
            let rows = chunk_rows.min(n - r0);
            let src = w + (r0 * fmt.row_bytes(k)) as u64;
            // SAFETY: the chunk's rows lie inside w; the scratch holds rows·k activations (chunk_rows sized it,
            // and a single row of k ≤ 8M elements fits); kernels run in order on the compute stream, so the
            // next chunk overwrites the scratch only after this chunk's GEMM read it.
            unsafe {
                self.dequantize(kn, fmt, src, sp, rows * k)?;
                self.gemm_strided(act, sp, x, y + (r0 * 4) as u64, m, rows, k, n, accumulate)?;
            }
            r0 += rows;
        }
        Ok(())
    }

    /// The activations `x` (`blocks` super-blocks of [`crate::quant::K_BLOCK_ELEMS`] in `kn`'s activation
    /// type) as the q2_k/q3_k GEMV rounds them, with the same device code: `q` gets one `i8` an element, `dx`
    /// one f32 a super-block ([`crate::quant::round_activations`]'s values). For tests: the GEMV itself
    /// rounds in registers.
    ///
    /// # Safety
    /// `x` holds `blocks × 256` activations, `q` `blocks × 256` bytes, `dx` `blocks` f32, all live.
    pub unsafe fn round_k23_activations(
        &self,
        kn: &Kernels,
        x: u64,
        q: u64,
        dx: u64,
        blocks: usize,
    ) -> Result<()> {
        let blocks = blocks as u64;
        // SAFETY: argument types match the kernel; it reads and writes the sizes above (16 lanes a block).
        unsafe {
            self.compute
                .launch_builder(&kn.round_k23_x)
                .arg(&x)
                .arg(&q)
                .arg(&dx)
                .arg(&blocks)
                .launch(threads_for(blocks * 16, 128))
        }
        .map(|_| ())
        .map_err(driver_err("cuLaunchKernel(round_k23_x)"))
    }
}

/// Device addresses one routed expert reads and writes ([`Gpu::expert_ffn`]): the MoE part of the scratch.
#[derive(Debug, Clone, Copy)]
pub struct ExpertIo {
    /// The layer's normed activations, a row per token.
    pub xn: u64,
    /// The expert's token rows (u32) and routing weights (f32).
    pub idx: u64,
    pub wts: u64,
    /// Gathered rows (activations); gate and up outputs (f32, `2 × rows × ffn`: each row's gate then its up
    /// columns where one GEMM computes both, else gate's rows then up's); their SwiGLU product (activations);
    /// down output (f32).
    pub x: u64,
    pub gate_up: u64,
    pub act: u64,
    pub y: u64,
    /// The residual stream (f32) the weighted outputs are added to.
    pub h: u64,
}

/// Device addresses of one MoE layer's grouped routed experts ([`Gpu::grouped_experts`]): the grouped part of
/// the MoE scratch.
#[derive(Debug, Clone, Copy)]
pub struct GroupedIo {
    /// `groups` u64: each expert's unit address (its gate, up and down at the [`ExpertOffsets`] every expert of
    /// the model shares).
    pub base: u64,
    /// `groups + 1` u32: expert g's entries of `idx`/`wts` are `first[g] .. first[g + 1]`.
    pub first: u64,
    /// The token permutation: token rows (u32, ascending within an expert) and routing weights (f32).
    pub idx: u64,
    pub wts: u64,
    /// The layer's normed activations, a row per token.
    pub xn: u64,
    /// SwiGLU rows (activations), one per entry: `first[groups] × ffn`.
    pub act: u64,
    /// The residual stream (f32) the weighted outputs are added to.
    pub h: u64,
}

// The cost model prices a step's pinned experts as one group up to core's bound: the grouped kernels' own.
const _: () = assert!(GROUPED_EXPERTS_MAX_TOKENS == EXACT_MAX_TOKENS as u64);

/// Weight formats of the tiled expert kernels (kernel name suffixes): the activation type (f16/bf16), then
/// [`QFormat::ALL`] in its order.
const TILED_FORMATS: [&str; 7] = ["act", "q8_0", "q4_0", "q4_k", "q6_k", "q2_k", "q3_k"];
const _: () = assert!(TILED_FORMATS.len() == QFormat::ALL.len() + 1);

/// Formats of the grouped expert kernels, the first of [`TILED_FORMATS`]: the activation type and the
/// quantised formats whose GEMVs of at most [`EXACT_MAX_TOKENS`] tokens take the activations as they are —
/// all but q2_k/q3_k, last in [`QFormat::ALL`] ([`QFormat::rounds_activations`]).
const GROUPED_FORMATS: usize = 5;
const _: () = {
    let mut i = 0;
    while i < QFormat::ALL.len() {
        assert!(QFormat::ALL[i].rounds_activations() == (i + 1 >= GROUPED_FORMATS));
        i += 1;
    }
};

/// Threads of a tiled expert kernel's block (`TE_THREADS`): a warp for each 16 of a tile's entries.
const TILE_THREADS: u32 = (tiled::TILE_ENTRIES / 16 * 32) as u32;

/// Index of `quant`'s instances in [`TILED_FORMATS`].
fn tiled_format(quant: Option<QFormat>) -> usize {
    quant.map_or(0, |q| 1 + QFormat::ALL.iter().position(|&f| f == q).expect("every format is in ALL"))
}

/// Whether [`Gpu::tiled_experts`] takes experts of `hidden` × `ffn` (any format): its tiles are 32 gate and up
/// columns, 64 down columns and 32 elements of k wide.
#[must_use]
pub fn tiled_experts_fit(hidden: usize, ffn: usize) -> bool {
    hidden.is_multiple_of(64) && ffn.is_multiple_of(32)
}

/// Device addresses of one group of [`Gpu::tiled_experts`] (layouts: [`tiled`]).
#[derive(Debug, Clone, Copy)]
pub struct TiledIo {
    /// The group's tiles.
    pub tiles: u64,
    /// The layer's token permutation: token rows (u32) and routing weights (f32), by entry.
    pub idx: u64,
    pub wts: u64,
    /// The group's `m + 1` per-token offsets into `tok_ent`, the entry lists.
    pub tok_first: u64,
    pub tok_ent: u64,
    /// The layer's normed activations, a row per token.
    pub xn: u64,
    /// A SwiGLU row (activations, `ffn`) and an output row (f32, `hidden`) per entry of the group.
    pub act: u64,
    pub y: u64,
    /// The residual stream (f32) the weighted outputs are added to.
    pub h: u64,
}

/// Whether [`Gpu::grouped_experts`] can run a step of `tokens` token rows of experts in `quant`'s format
/// (`None`: the activation type) with rows of `hidden` and `ffn`: f16/bf16 matrices or a format whose GEMVs
/// take the activations as they are (q2_k/q3_k round them to 8 bits first, [`QFormat::rounds_activations`],
/// so they keep the per-expert path), at most [`EXACT_MAX_TOKENS`] tokens (a register accumulator per token
/// of an expert; a lane per token of the step), and rows of whole 8-element lane reads (16-byte vectors of
/// activations; a quantised row's blocks already hold a multiple of 8 elements).
#[must_use]
pub fn grouped_experts_fit(quant: Option<QFormat>, tokens: usize, hidden: usize, ffn: usize) -> bool {
    quant.is_none_or(|q| !q.rounds_activations())
        && tokens <= EXACT_MAX_TOKENS
        && hidden.is_multiple_of(8)
        && ffn.is_multiple_of(8)
}

/// Kernel launches on the compute stream. Pointers are device addresses; each function's `# Safety` says which
/// sizes it reads and writes.
impl Gpu {
    /// `h[t] = table[ids[t]]` for `m` tokens, the table stored as `quant` (or in the activation type).
    ///
    /// # Safety
    /// `ids` holds `m` in-range token ids, `table` `vocab × hidden` in its format, `h` `m × hidden` f32.
    pub unsafe fn embed(
        &self,
        k: &Kernels,
        quant: Option<QFormat>,
        table: u64,
        ids: u64,
        h: u64,
        m: usize,
        hidden: usize,
    ) -> Result<()> {
        let hidden = hidden as i32;
        let cfg = LaunchConfig { grid_dim: (m as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let f = match quant {
            None => &k.embed,
            Some(QFormat::Q8_0) => &k.embed_q8_0,
            Some(QFormat::Q4_0) => &k.embed_q4_0,
            Some(QFormat::Q4K) => &k.embed_q4_k,
            Some(QFormat::Q6K) => &k.embed_q6_k,
            Some(QFormat::Q2K) => &k.embed_q2_k,
            Some(QFormat::Q3K) => &k.embed_q3_k,
        };
        // SAFETY: argument types match the kernel signature; sizes per the caller.
        unsafe { self.compute.launch_builder(f).arg(&table).arg(&ids).arg(&h).arg(&hidden).launch(cfg) }
            .map(|_| ())
            .map_err(driver_err("cuLaunchKernel(embed)"))
    }

    /// Normalises `rows` rows of `dim` f32 into the activation type (`b` = 0 for none).
    ///
    /// # Safety
    /// `x` holds `rows × dim` f32, `w` (and `b` if non-zero) `dim` f32, `out` `rows × dim` activations.
    pub unsafe fn norm_act(
        &self,
        k: &Kernels,
        x: u64,
        w: u64,
        b: u64,
        out: u64,
        rows: usize,
        dim: usize,
        eps: f32,
        layer_norm: bool,
    ) -> Result<()> {
        // The kernel keeps NORM_PER (16) elements a thread in registers; weights.rs refuses wider models.
        if dim > NORM_MAX_DIM {
            return Err(ExecError::Input(format!("norm_act: rows of {dim} elements exceed {NORM_MAX_DIM}")));
        }
        let threads: u32 = if dim <= NORM_MAX_DIM / 2 { 512 } else { 1024 };
        let (dim, ln) = (dim as i32, i32::from(layer_norm));
        let cfg =
            LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: as documented.
        unsafe {
            self.compute
                .launch_builder(&k.norm_act)
                .arg(&x)
                .arg(&w)
                .arg(&b)
                .arg(&out)
                .arg(&dim)
                .arg(&eps)
                .arg(&ln)
                .launch(cfg)
        }
        .map(|_| ())
        .map_err(driver_err("cuLaunchKernel(norm_act)"))
    }

    /// In-place f32 RMSNorm of `rows` rows of `dim`.
    ///
    /// # Safety
    /// `x` holds `rows × dim` f32 and `w` `dim` f32.
    pub unsafe fn rmsnorm_rows(
        &self,
        k: &Kernels,
        x: u64,
        w: u64,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        let (dim, r) = (dim as i32, rows as i32);
        let cfg = threads_for(rows as u64 * 32, 256);
        // SAFETY: as documented.
        unsafe {
            self.compute
                .launch_builder(&k.rmsnorm_rows_f32)
                .arg(&x)
                .arg(&w)
                .arg(&dim)
                .arg(&eps)
                .arg(&r)
                .launch(cfg)
        }
        .map(|_| ())
        .map_err(driver_err("cuLaunchKernel(rmsnorm_rows_f32)"))
    }

    /// `x[i] += b[i % dim]` over `n` elements.
    ///
    /// # Safety
    /// `x` holds `n` f32, `b` `dim` f32.
    pub unsafe fn add_bias(&self, k: &Kernels, x: u64, b: u64, dim: usize, n: usize) -> Result<()> {
        let (dim, n64) = (dim as i32, n as u64);
        // SAFETY: as documented.
        unsafe {
            self.compute
                .launch_builder(&k.add_bias)
                .arg(&x)
                .arg(&b)
                .arg(&dim)
                .arg(&n64)
                .launch(threads_for(n64, 256))
        }
        .map(|_| ())
        .map_err(driver_err("cuLaunchKernel(add_bias)"))
    }

    /// Copies `bytes` from mapped host memory (`src`, a device address from [`Gpu::register_mapped`]) to `dst`
    /// on the compute stream, by a kernel rather than a copy engine (see `copy_mapped` in kernels.cu).
    ///
    /// # Safety
    /// `src..src + bytes` must lie in a live mapped registration, `dst..dst + bytes` in a live device
    /// allocation, and the host must not write the source until the copy has run.
    pub unsafe fn copy_mapped(&self, k: &Kernels, dst: u64, src: u64, bytes: usize) -> Result<()> {
        let n = bytes as u64;
        // Enough threads for four 16-byte loads each, up to 8 blocks an SM of the largest parts.
        let mut cfg = threads_for(n.div_ceil(64), 256);
        cfg.grid_dim.0 = cfg.grid_dim.0.min(132 * 8);
        // SAFETY: as documented.
        unsafe { self.compute.launch_builder(&k.copy_mapped).arg(&dst).arg(&src).arg(&n).launch(cfg) }
            .map(|_| ())
            .map_err(driver_err("cuLaunchKernel(copy_mapped)"))
    }

    /// Copies `parts` to the device on the compute stream in one launch that carries their bytes (see
    /// `copy_inline_parts` in kernels.cu); the host may rewrite the parts' sources as soon as this returns.
    ///
    /// # Safety
    /// Each part's destination must lie in a live device allocation.
    pub unsafe fn copy_inline_parts(&self, k: &Kernels, parts: &InlineParts) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (1, InlineParts::MAX as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as documented; `InlineParts` is laid out as kernels.cu's.
        unsafe { self.compute.launch_builder(&k.copy_inline_parts).arg(parts).launch(cfg) }
            .map(|_| ())
            .map_err(driver_err("cuLaunchKernel(copy_inline_parts)"))
    }

    /// Copies `parts` from mapped host memory to the device on the compute stream in one launch, by the SMs'
    /// loads rather than a copy engine (see `copy_mapped_parts` in kernels.cu).
    ///
    /// # Safety
    /// Each part's source must lie in a live mapped registration and its destination in a live device
    /// allocation, and the host must not write the sources until the copy has run.
    pub unsafe fn copy_mapped_parts(&self, k: &Kernels, parts: &MappedParts) -> Result<()> {
        let most = parts.words.iter().copied().max().unwrap_or(0);
        let mut cfg = threads_for(most, 256);
        cfg.grid_dim.1 = MappedParts::MAX as u32;
        // SAFETY: as documented; `MappedParts` is laid out as kernels.cu's.
        unsafe { self.compute.launch_builder(&k.copy_mapped_parts).arg(parts).launch(cfg) }
            .map(|_| ())
            .map_err(driver_err("cuLaunchKernel(copy_mapped_parts)"))
    }

    /// `x[i] += src[i]` for `n` f32 on the compute stream, `src` the device address of mapped host memory
    /// ([`Gpu::register_mapped`]) read over PCIe by the kernel.
    ///
    /// # Safety
    /// `x` holds `n` f32 on the device, `src` `n` f32 of a live mapped registration that the host does not
    /// write until the kernel has run.
    pub unsafe fn add_mapped(&self, k: &Kernels, x: u64, src: u64, n: usize) -> Result<()> {
        let n = n as u64;
        // SAFETY: as documented.
        unsafe {
            self.compute.launch_builder(&k.add_mapped).arg(&x).arg(&src).arg(&n).launch(threads_for(n, 256))
        }
        .map(|_| ())
        .map_err(driver_err("cuLaunchKernel(add_mapped)"))
    }

    /// Holds the compute stream for `ns` nanoseconds, so that what the host enqueues meanwhile runs back to
    /// back at the device's pace (the profiler times kernels so, as the executor's decode runs them: its host
    /// enqueues a step well ahead of the GPU).
    pub fn hold_compute(&self, k: &Kernels, ns: u64) -> Result<()> {
        // SAFETY: the kernel takes one u64 and touches no memory.
        unsafe { self.compute.launch_builder(&k.spin).arg(&ns).launch(threads_for(1, 32)) }
            .map(|_| ())
            .map_err(driver_err("cuLaunchKernel(spin)"))
    }

    /// RoPE over `x` `[m, heads, head_dim]`, token `t` at position `pos.0 + t·pos.1`.
    ///
    /// # Safety
    /// `x` holds `m × heads × head_dim` f32 and `inv_freq` `half` f32, `2 × half ≤ head_dim`.
    pub unsafe fn rope(
        &self,
        k: &Kernels,
        x: u64,
        inv_freq: u64,
        m: usize,
        heads: usize,
        head_dim: usize,
        half: usize,
        pos: (usize, usize),
    ) -> Result<()> {
        if half == 0 {
            return Ok(());
        }
        let n = (m * heads * half) as u64;
        let (m, heads, hd, half) = (m as i32, heads as i32, head_dim as i32, half as i32);
        let (pos0, pos_step) = (pos.0 as i32, pos.1 as i32);
        // SAFETY: as documented.
        unsafe {
            self.compute
                .launch_builder(&k.rope)
                .arg(&x)
                .arg(&inv_freq)
                .arg(&m)
                .arg(&heads)
                .arg(&hd)
                .arg(&half)
                .arg(&pos0)
                .arg(&pos_step)
                .launch(threads_for(n, 256))
        }
        .map(|_| ())
        .map_err(driver_err("cuLaunchKernel(rope)"))
    }

    /// Writes `m` K and V rows into the cache, token `t` at row `rows.0 + t·rows.1`.
    ///
    /// # Safety
    /// `k`, `v` hold `m × kv_dim` f32; `kc`, `vc` hold every row written, `kv_dim` cache elements each.
    pub unsafe fn store_kv(
        &self,
        kn: &Kernels,
        k: u64,
        v: u64,
        kc: u64,
        vc: u64,
        kv_dim: usize,
        rows: (usize, usize),
        m: usize,
    ) -> Result<()> {
        let n = (m * kv_dim) as u64;
        let (kv_dim, row0, row_step, m) = (kv_dim as i32, rows.0 as i64, rows.1 as i64, m as i32);
        // SAFETY: as documented.
        unsafe {
            self.compute
                .launch_builder(&kn.store_kv)
                .arg(&k)
                .arg(&v)
                .arg(&kc)
                .arg(&vc)
                .arg(&kv_dim)
                .arg(&row0)
                .arg(&row_step)
                .arg(&m)
                .launch(threads_for(n, 256))
        }
        .map(|_| ())
        .map_err(driver_err("cuLaunchKernel(store_kv)"))
    }

    /// [`Gpu::rope`] of `q`'s and `k`'s heads and [`Gpu::store_kv`] of the rotated K and of V, in one launch.
    ///
    /// # Safety
    /// As the two calls: `q` holds `m × n_heads × head_dim` f32, `k` and `v` `m × n_kv_heads × head_dim` f32,
    /// `inv_freq` `half` f32 with `2 × half ≤ head_dim`, and `kc`/`vc` every row `rows` names.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rope_store_kv(
        &self,
        kn: &Kernels,
        (q, k, v): (u64, u64, u64),
        inv_freq: u64,
        (kc, vc): (u64, u64),
        m: usize,
        (n_heads, n_kv_heads, head_dim, half): (usize, usize, usize, usize),
        pos: (usize, usize),
        rows: (usize, usize),
    ) -> Result<()> {
        let per = (n_heads + n_kv_heads) * half + n_kv_heads * (head_dim - 2 * half) + n_kv_heads * head_dim;
        let n = (m * per) as u64;
        let (mut m, mut heads, mut kv_heads, mut hd, mut half) =
            (m as i32, n_heads as i32, n_kv_heads as i32, head_dim as i32, half as i32);
        let (mut pos0, mut pos_step, mut row0, mut row_step) =
            (pos.0 as i32, pos.1 as i32, rows.0 as i64, rows.1 as i64);
        let (mut q, mut k, mut v, mut inv_freq, mut kc, mut vc) = (q, k, v, inv_freq, kc, vc);
        let mut params = kernel_params![
            q, k, v, inv_freq, kc, vc, m, heads, kv_heads, hd, half, pos0, pos_step, row0, row_step
        ];
        // SAFETY: as documented; the kernel waits for the kernel before it first thing.
        unsafe { self.launch_ex(&kn.rope_store_kv, threads_for(n, 256), &mut params, true, "rope_store_kv") }
    }

    /// Attention of `m` queries over the cache rows `keys` describes (causal over one sequence, one query per
    /// sequence, or a masked scan of a unified cache); with `n_splits > 1` through the partial buffers and a
    /// combine pass.
    ///
    /// # Safety
    /// `q` holds `m × n_heads × head_dim` f32; `kc`/`vc` (the cache at `keys.base_row`) every row `keys` reads,
    /// `n_kv_heads × head_dim` cache elements each; `out` `m × n_heads × head_dim` activations; with splits,
    /// `part_o` holds `m × n_heads × n_splits × head_dim` f32 and `part_ml` `2 × m × n_heads × n_splits` f32.
    pub unsafe fn attention(
        &self,
        k: &Kernels,
        q: u64,
        kc: u64,
        vc: u64,
        out: u64,
        part_o: u64,
        part_ml: u64,
        m: usize,
        keys: GpuKeys,
        n_heads: usize,
        n_kv_heads: usize,
        scale: f32,
        n_splits: usize,
    ) -> Result<()> {
        // The kernel reads each lane's head_dim/32 cache elements with one vector load (at most 16 bytes).
        if !kc.is_multiple_of(16) || !vc.is_multiple_of(16) {
            return Err(ExecError::Input(format!(
                "attention: KV cache pointers {kc:#x}/{vc:#x} are not 16-byte aligned"
            )));
        }
        let n_keys_max = keys.pos0 + (m - 1) * keys.pos_step + 1;
        // Scratch holds `n_splits` (sized for the whole context); one split per 32-key tile read is enough.
        let n_splits = n_splits.min(n_keys_max.div_ceil(32)).max(1);
        if n_splits as u64 > MAX_KEY_SPLITS {
            return Err(ExecError::Input(format!(
                "attention: {n_splits} key splits, the kernels take at most {MAX_KEY_SPLITS}"
            )));
        }
        let keys_per_split = n_keys_max.div_ceil(n_splits).next_multiple_of(32) as i32;
        let warps = (m * n_heads * n_splits) as u64;
        let cfg = LaunchConfig {
            grid_dim: (warps.div_ceil(4) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (mut mi, mut p0, mut nh, mut nkv, mut ns) =
            (m as i32, keys.pos0 as i32, n_heads as i32, n_kv_heads as i32, n_splits as i32);
        let (mut seq_rows, mut pos_step) = (keys.seq_rows as i64, keys.pos_step as i32);
        let (mut mask_prompt, mut mask_seqs) = (keys.mask_prompt as i32, keys.mask_seqs as i32);
        let (mut q, mut kc, mut vc, mut out, mut part_o, mut part_ml, mut scale, mut keys_per_split) =
            (q, kc, vc, out, part_o, part_ml, scale, keys_per_split);
        let mut params = kernel_params![
            q,
            kc,
            vc,
            out,
            part_o,
            part_ml,
            mi,
            p0,
            nh,
            nkv,
            scale,
            ns,
            keys_per_split,
            seq_rows,
            pos_step,
            mask_prompt,
            mask_seqs,
        ];
        // Both kernels wait for the kernel before them first thing, so they launch under it.
        // SAFETY: as documented.
        unsafe { self.launch_ex(&k.attention, cfg, &mut params, true, "attention")? };
        if n_splits > 1 {
            let mut rows = (m * n_heads) as i64;
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (COMBINE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut params = kernel_params![part_o, part_ml, out, ns, rows];
            // SAFETY: as documented.
            unsafe { self.launch_ex(&k.attn_combine, cfg, &mut params, true, "attn_combine")? };
        }
        Ok(())
    }

    /// `out[t, j] = silu(g[t, j]) · u[t, j]` (or `relu(u[t, j])²` when `g` is `None`) for `rows` rows of
    /// `cols`, into activations. `g` and `u` rows are `ld` f32 apart: `cols` for matrices of their own,
    /// `2·cols` where one GEMM wrote gate|up side by side (`g` the output, `u` `cols` further); `out`'s are
    /// `cols` apart.
    ///
    /// # Safety
    /// `g` (if any) and `u` hold `(rows − 1) × ld + cols` f32, `out` `rows × cols` activations.
    pub unsafe fn ffn_act(
        &self,
        k: &Kernels,
        g: Option<u64>,
        u: u64,
        out: u64,
        rows: usize,
        cols: usize,
        ld: usize,
    ) -> Result<()> {
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        // A block of 256 threads a 256-column slice of up to 65535 rows (the grid's y limit); the kernel
        // strides over the rest.
        let cfg = LaunchConfig {
            grid_dim: (cols.div_ceil(256) as u32, rows.min(65_535) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (cols, ld, rows) = (cols as i32, ld as u64, rows as u64);
        // SAFETY: as documented.
        let r = unsafe {
            match g {
                Some(g) => self
                    .compute
                    .launch_builder(&k.swiglu)
                    .arg(&g)
                    .arg(&u)
                    .arg(&out)
                    .arg(&cols)
                    .arg(&ld)
                    .arg(&rows)
                    .launch(cfg),
                None => self
                    .compute
                    .launch_builder(&k.relu2)
                    .arg(&u)
                    .arg(&out)
                    .arg(&cols)
                    .arg(&ld)
                    .arg(&rows)
                    .launch(cfg),
            }
        };
        r.map(|_| ()).map_err(driver_err("cuLaunchKernel(ffn_act)"))
    }

    /// MoE token permutation: `dst[i] = src[idx[i]]` for `rows` activation rows of `dim`.
    ///
    /// # Safety
    /// `idx` holds `rows` u32 indexing rows of `src` (activations, `dim` per row); `dst` holds `rows × dim`
    /// activations.
    pub unsafe fn gather_rows(
        &self,
        k: &Kernels,
        src: u64,
        idx: u64,
        dst: u64,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        let dim = dim as i32;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: as documented.
        unsafe {
            self.compute.launch_builder(&k.gather_rows).arg(&src).arg(&idx).arg(&dst).arg(&dim).launch(cfg)
        }
        .map(|_| ())
        .map_err(driver_err("cuLaunchKernel(gather_rows)"))
    }

    /// MoE combine: `h[idx[i]] += w[i] · y[i]` for `rows` f32 rows of `dim`; the `idx` of one call are distinct.
    ///
    /// # Safety
    /// `y` holds `rows × dim` f32, `idx` and `w` `rows` distinct in-range row indices and f32 weights, `h` the
    /// rows they index.
    pub unsafe fn scatter_add_rows(
        &self,
        k: &Kernels,
        y: u64,
        idx: u64,
        w: u64,
        h: u64,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        let dim = dim as i32;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: as documented.
        unsafe {
            self.compute
                .launch_builder(&k.scatter_add_rows)
                .arg(&y)
                .arg(&idx)
                .arg(&w)
                .arg(&h)
                .arg(&dim)
                .launch(cfg)
        }
        .map(|_| ())
        .map_err(driver_err("cuLaunchKernel(scatter_add_rows)"))
    }

    /// One routed expert over the `c` tokens that picked it: gather their rows of `io.xn`, one matmul over
    /// gate and up, SwiGLU, down matmul, and the weighted scatter-add into `io.h`. The matmuls run over
    /// `rows ≥ c` rows (a warmed shape); rows past `c` are computed and dropped. This is the executor's whole
    /// per-expert sequence, and the profiler times this same call.
    ///
    /// Launches: 5 (gather, gate|up, SwiGLU, down, scatter-add) in f16/bf16 and, up to [`EXACT_MAX_TOKENS`]
    /// rows, in the quantised formats (their GEMV kernels dequantise as they read); 6 in quantised formats
    /// above, where the whole expert (gate|up and down, one run of blocks) is dequantised into the scratch in
    /// one launch for the two cuBLAS GEMMs, while it fits [`DEQUANT_SCRATCH_BYTES`] in the activation type
    /// (qwen3-30b-a3b's takes 9 MiB; larger ones dequantise each matmul, in chunks where needed: 7 or more).
    /// With gate and up as two matmuls it was 6 and 9, and in a prefill chunk, where the
    /// host enqueues ~128 experts a layer, the enqueueing set the pace (ncu on the H200, qwen3-30b-a3b q4_0,
    /// ~64 tokens an expert: 61 µs an expert against ~46 µs of kernels). Gate and up are one
    /// `[2·ffn, hidden]` matrix because the unit stores them back to back
    /// ([`crate::weights::Dims::expert_gate_up_adjacent`]): a token's output row holds its gate columns, then
    /// its up columns, and the SwiGLU reads them `2·ffn` apart. Where alignment padding separates them
    /// (f16/bf16 experts whose `ffn × hidden` is not a multiple of 8, never a quantised one) they stay two
    /// matmuls.
    ///
    /// # Safety
    /// `w` holds the expert's gate and up (`ffn × hidden`) and down (`hidden × ffn`) at `o`'s offsets in
    /// `quant`'s format; `io.idx`/`io.wts` hold `c` distinct token rows of `io.xn` and `io.h` and their
    /// weights; `io.x`, `io.act` hold `rows` activation rows (`hidden`, `ffn`), `io.gate_up` `rows` f32 rows
    /// of `2·ffn`, `io.y` `rows` f32 rows of `hidden`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn expert_ffn(
        &self,
        k: &Kernels,
        quant: Option<QFormat>,
        w: u64,
        o: ExpertOffsets,
        io: &ExpertIo,
        c: usize,
        rows: usize,
        hidden: usize,
        ffn: usize,
    ) -> Result<()> {
        let act_bytes = k.key.act.size_bytes();
        let row_bytes = quant.map_or(hidden * act_bytes, |q| q.row_bytes(hidden));
        let one_matrix = o.up == o.gate + ffn * row_bytes;
        // A quantised expert whose GEMMs go through cuBLAS, gate|up and down back to back in the unit, is
        // dequantised in one launch (its blocks are one stream): 6 launches instead of 7, for the host that
        // sets a prefill chunk's pace.
        let whole_unit = quant.filter(|_| {
            rows > EXACT_MAX_TOKENS
                && one_matrix
                && o.down == o.up + ffn * row_bytes
                && 3 * ffn * hidden * act_bytes <= DEQUANT_SCRATCH_BYTES
        });
        // SAFETY: the sizes are the caller's, as documented; gate|up's 2·ffn rows are the unit's gate and up
        // when `one_matrix` (whole rows of whole blocks, back to back), and its outputs fill `io.gate_up`;
        // `whole_unit`'s three matrices are one run of whole blocks that fits the scratch.
        unsafe {
            self.gather_rows(k, io.xn, io.idx, io.x, c, hidden)?;
            // The down matrix as the last matmul reads it: dequantised already, or in the unit.
            let down = if let Some(fmt) = whole_unit {
                let sp = self.dequant_scratch()?;
                self.dequantize(k, fmt, w + o.gate as u64, sp, 3 * ffn * hidden)?;
                self.gemm(k.key.act, sp, io.x, io.gate_up, rows, 2 * ffn, hidden, false)?;
                Some(sp + (2 * ffn * hidden * act_bytes) as u64)
            } else {
                None
            };
            let (g, u, ld) = if one_matrix {
                if down.is_none() {
                    self.matmul(k, quant, w + o.gate as u64, io.x, io.gate_up, rows, 2 * ffn, hidden, false)?;
                }
                (io.gate_up, io.gate_up + (ffn * 4) as u64, 2 * ffn)
            } else {
                let up = io.gate_up + (rows * ffn * 4) as u64;
                self.matmul(k, quant, w + o.gate as u64, io.x, io.gate_up, rows, ffn, hidden, false)?;
                self.matmul(k, quant, w + o.up as u64, io.x, up, rows, ffn, hidden, false)?;
                (io.gate_up, up, ffn)
            };
            self.ffn_act(k, Some(g), u, io.act, rows, ffn, ld)?;
            match down {
                Some(d) => self.gemm(k.key.act, d, io.act, io.y, rows, hidden, ffn, false)?,
                None => self.matmul(k, quant, w + o.down as u64, io.act, io.y, rows, hidden, ffn, false)?,
            }
            self.scatter_add_rows(k, io.y, io.idx, io.wts, io.h, c, hidden)
        }
    }

    /// A MoE layer's pinned picked experts over a decode step's `m` ≤ [`EXACT_MAX_TOKENS`] tokens in two
    /// launches, against [`Gpu::expert_ffn`]'s 5 an expert (40 for qwen3-30b-a3b's 8 experts a token, where
    /// the host's launches, not the 75 MB of weights, set the pace: ~380 µs a layer on the H200 against ~20 µs
    /// of HBM reads):
    /// - `moe_gate_up_grouped`: for every (expert, ffn row j), a warp dots gate row j and up row j with each of
    ///   the expert's tokens' rows of `io.xn` (read through `io.idx`, no gather) and writes
    ///   `silu(g)·u` rounded to the activation type into the entry's row of `io.act`;
    /// - `moe_down_grouped`: for every hidden column j, a warp keeps the `m` tokens' `h[t, j]` in lanes and adds,
    ///   expert by expert in ascending order, `w · (down row j · act row)` for each of the expert's tokens —
    ///   the same additions into `h`, in the same order, as the per-expert scatter-adds, with no float atomics.
    ///
    /// Quantised weights (q8_0, q4_0, q4_k, q6_k: [`grouped_experts_fit`]) are dequantised exactly in f32 as
    /// they are read, as the per-expert path's GEMVs of at most [`EXACT_MAX_TOKENS`] tokens use them. Each
    /// output is the per-expert path's dot product up to the order of its f32 additions.
    ///
    /// # Safety
    /// `io.base` holds `groups` u64 addresses of expert units with gate and up (`ffn × hidden`) and down
    /// (`hidden × ffn`) in `quant`'s format (the activation type where `None`, 16-byte aligned) at `o`'s
    /// offsets; `io.first` `groups + 1` ascending u32 from 0, at most [`EXACT_MAX_TOKENS`] apart;
    /// `io.idx`/`io.wts` `first[groups]` entries, an expert's token rows distinct and < `m`; `io.xn` `m`
    /// activation rows of `hidden`, `io.h` `m` f32 rows of `hidden`; `io.act` `first[groups]` activation rows
    /// of `ffn`; every activation row 16-byte aligned.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn grouped_experts(
        &self,
        k: &Kernels,
        quant: Option<QFormat>,
        o: ExpertOffsets,
        io: &GroupedIo,
        groups: usize,
        m: usize,
        hidden: usize,
        ffn: usize,
    ) -> Result<()> {
        if groups == 0 || m == 0 {
            return Ok(());
        }
        if !grouped_experts_fit(quant, m, hidden, ffn) {
            return Err(ExecError::Cuda {
                call: "grouped_experts",
                reason: format!(
                    "{m} tokens of hidden {hidden}, ffn {ffn} in {quant:?}: outside the grouped kernels' \
                     shapes or formats"
                ),
            });
        }
        let f = tiled_format(quant);
        let (gate, up, down) = (o.gate as u64, o.up as u64, o.down as u64);
        let (hd, fe, gr, m32) = (hidden as i32, ffn as i32, groups as i32, m as i32);
        // GX_WARPS (8) warps a block: a warp per (expert, ffn row), then a warp per hidden column.
        let a_cfg = threads_for((groups * ffn * 32) as u64, 256);
        let b_cfg = threads_for((hidden * 32) as u64, 256);
        // SAFETY: argument types match the kernels; the sizes are the caller's, as documented: kernel A reads
        // groups experts' gate/up rows and the entries' xn rows and writes first[groups] act rows; kernel B
        // reads the down rows and act rows and writes h's m rows; kernels on the compute stream run in order.
        unsafe {
            self.compute
                .launch_builder(&k.moe_gate_up_grouped[f])
                .arg(&io.base)
                .arg(&io.first)
                .arg(&io.idx)
                .arg(&io.xn)
                .arg(&io.act)
                .arg(&gate)
                .arg(&up)
                .arg(&hd)
                .arg(&fe)
                .arg(&gr)
                .launch(a_cfg)
                .map_err(driver_err("cuLaunchKernel(moe_gate_up_grouped)"))?;
            self.compute
                .launch_builder(&k.moe_down_grouped[f])
                .arg(&io.base)
                .arg(&io.first)
                .arg(&io.idx)
                .arg(&io.wts)
                .arg(&io.act)
                .arg(&io.h)
                .arg(&down)
                .arg(&hd)
                .arg(&fe)
                .arg(&gr)
                .arg(&m32)
                .launch(b_cfg)
                .map_err(driver_err("cuLaunchKernel(moe_down_grouped)"))?;
        }
        Ok(())
    }

    /// One group of a MoE layer's pinned picked experts ([`tiled`]) in three launches, any weight format:
    /// - `moe_gate_up_tiled_*`: for each tile of at most 128 entries and 32 columns of gate and up, the weights
    ///   dequantised into shared memory (rounded to the activation type, as `dequant_*` does) and multiplied
    ///   with the entries' rows of `io.xn` (read through `io.idx`: no gather) on tensor cores, then SwiGLU,
    ///   rounded to the activation type as `swiglu` does, into the entry's row of `io.act`;
    /// - `moe_down_tiled_*`: the same for down over `io.act`, into `io.y` (f32);
    /// - `moe_combine_tiled`: for each token, `h += w · y` over its entries of the group in ascending expert
    ///   order — the additions of the per-expert path's scatter-adds, in their order.
    ///
    /// Each output is [`Gpu::expert_ffn`]'s over more than [`EXACT_MAX_TOKENS`] rows (dequantise to the
    /// activation type, then cuBLAS) up to the order of its f32 additions — at every entry count: callers keep
    /// quantised experts of at most [`EXACT_MAX_TOKENS`] entries on [`Gpu::expert_ffn`]'s exact GEMVs.
    ///
    /// # Safety
    /// `io.tiles` holds `tiles` tiles of the group, whose entries are `first_entry ..` (as [`tiled`] lays
    /// them out), of expert units holding gate and up (`ffn × hidden`) and down (`hidden × ffn`) in `quant`'s
    /// format (the activation type where `None`) at `o`'s offsets, rows 16-byte aligned; `io.tok_first` `m + 1`
    /// offsets into `io.tok_ent`, whose entries are the group's; `io.idx`/`io.wts` every entry named; token
    /// rows < `m` of `io.xn` (activations, `hidden`) and `io.h` (f32); `io.act` and `io.y` a row per entry
    /// of the group; [`tiled_experts_fit`] holds.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tiled_experts(
        &self,
        k: &Kernels,
        quant: Option<QFormat>,
        o: ExpertOffsets,
        io: &TiledIo,
        tiles: usize,
        first_entry: usize,
        m: usize,
        hidden: usize,
        ffn: usize,
    ) -> Result<()> {
        if tiles == 0 {
            return Ok(());
        }
        if !tiled_experts_fit(hidden, ffn) {
            return Err(ExecError::Cuda {
                call: "tiled_experts",
                reason: format!("hidden {hidden}, ffn {ffn}: outside the tiled kernels' shapes"),
            });
        }
        let f = tiled_format(quant);
        let (gate, up, down) = (o.gate as u64, o.up as u64, o.down as u64);
        let (hd, fe, gfirst) = (hidden as i32, ffn as i32, first_entry as u32);
        let cfg = |x: usize, y: usize, threads: u32| LaunchConfig {
            grid_dim: (x as u32, y as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match the kernels; the sizes are the caller's, as documented; kernels on the
        // compute stream run in order, so each reads what the one before wrote.
        unsafe {
            self.compute
                .launch_builder(&k.moe_gate_up_tiled[f])
                .arg(&io.tiles)
                .arg(&io.idx)
                .arg(&io.xn)
                .arg(&io.act)
                .arg(&gate)
                .arg(&up)
                .arg(&hd)
                .arg(&fe)
                .arg(&gfirst)
                .launch(cfg(ffn / 32, tiles, TILE_THREADS))
                .map_err(driver_err("cuLaunchKernel(moe_gate_up_tiled)"))?;
            self.compute
                .launch_builder(&k.moe_down_tiled[f])
                .arg(&io.tiles)
                .arg(&io.act)
                .arg(&io.y)
                .arg(&down)
                .arg(&hd)
                .arg(&fe)
                .arg(&gfirst)
                .launch(cfg(hidden / 64, tiles, TILE_THREADS))
                .map_err(driver_err("cuLaunchKernel(moe_down_tiled)"))?;
            self.compute
                .launch_builder(&k.moe_combine_tiled)
                .arg(&io.tok_first)
                .arg(&io.tok_ent)
                .arg(&io.wts)
                .arg(&io.y)
                .arg(&io.h)
                .arg(&hd)
                .arg(&gfirst)
                .launch(cfg(hidden.div_ceil(256), m, 256))
                .map_err(driver_err("cuLaunchKernel(moe_combine_tiled)"))?;
        }
        Ok(())
    }

    /// `out[r] = argmax(logits[r])` for `rows` rows of `vocab`.
    ///
    /// # Safety
    /// `logits` holds `rows × vocab` f32, `out` `rows` u32.
    pub unsafe fn argmax(&self, k: &Kernels, logits: u64, vocab: usize, out: u64, rows: usize) -> Result<()> {
        let vocab = vocab as i32;
        let cfg =
            LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: as documented.
        unsafe { self.compute.launch_builder(&k.argmax).arg(&logits).arg(&vocab).arg(&out).launch(cfg) }
            .map(|_| ())
            .map_err(driver_err("cuLaunchKernel(argmax)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parts fill in order, an empty one adds nothing, and a sixth or an unaligned part is refused.
    #[test]
    fn mapped_parts_take_five_aligned_copies() {
        let mut p = MappedParts::default();
        p.push(0x1000, 0x2000, 0);
        for k in 0..MappedParts::MAX as u64 {
            p.push(0x1000 + 64 * k, 0x2000 + 32 * k, 4 * (k as usize + 1));
        }
        assert_eq!(p.words, [1, 2, 3, 4, 5]);
        assert_eq!((p.dst[2], p.src[2]), (0x1080, 0x2040));
        assert!(
            std::panic::catch_unwind(|| {
                let mut q = p;
                q.push(0x1000, 0x2000, 4);
            })
            .is_err(),
            "a sixth part"
        );
        assert!(std::panic::catch_unwind(|| MappedParts::default().push(0x1002, 0x2000, 4)).is_err());
        assert!(std::panic::catch_unwind(|| MappedParts::default().push(0x1000, 0x2000, 6)).is_err());
    }

    /// Parts pack back to back in order, empty ones skipped; a sixth part or more words than fit is refused,
    /// and an unaligned part panics.
    #[test]
    fn inline_parts_pack_words_back_to_back() {
        let a: Vec<u8> = (0..8).collect();
        let b: Vec<u8> = (100..112).collect();
        let p = InlineParts::new(&[(0x1000, &a), (0x2000, &[]), (0x3000, &b)]).expect("fits");
        assert_eq!((p.dst, p.words), ([0x1000, 0x3000, 0, 0, 0], [2, 3, 0, 0, 0]));
        assert_eq!(p.data[0], u32::from_le_bytes([0, 1, 2, 3]));
        assert_eq!(p.data[2], u32::from_le_bytes([100, 101, 102, 103]));
        assert_eq!(p.data[4], u32::from_le_bytes([108, 109, 110, 111]));
        let word = [0u8; 4];
        assert!(InlineParts::new(&[(0x1000, &word[..]); 6]).is_none(), "a sixth part");
        let most = vec![0u8; 4 * InlineParts::WORDS];
        assert!(InlineParts::new(&[(0x1000, &most)]).is_some());
        assert!(InlineParts::new(&[(0x1000, &most), (0x2000, &word)]).is_none(), "one word too many");
        assert!(std::panic::catch_unwind(|| InlineParts::new(&[(0x1002, &word[..])])).is_err());
        assert!(std::panic::catch_unwind(|| InlineParts::new(&[(0x1000, &word[..3])])).is_err());
    }

    /// The grouped kernels take f16/bf16 and every quantised format whose GEMVs keep the activations as they
    /// are, each at its instances' index, up to `EXACT_MAX_TOKENS` tokens of rows of whole 8-element reads.
    #[test]
    fn grouped_experts_fit_every_format_but_q2_k_and_q3_k() {
        let (hidden, ffn) = (2048, 768);
        for quant in std::iter::once(None).chain(QFormat::ALL.map(Some)) {
            let fits = quant.is_none_or(|q| !matches!(q, QFormat::Q2K | QFormat::Q3K));
            for tokens in 1..=EXACT_MAX_TOKENS {
                assert_eq!(grouped_experts_fit(quant, tokens, hidden, ffn), fits, "{quant:?} {tokens}");
            }
            assert!(!grouped_experts_fit(quant, EXACT_MAX_TOKENS + 1, hidden, ffn), "{quant:?}");
            if fits {
                assert!(tiled_format(quant) < GROUPED_FORMATS, "{quant:?}: an instance of its own");
            }
        }
        assert!(!grouped_experts_fit(None, 1, 2052, ffn) && !grouped_experts_fit(None, 1, hidden, 772));
    }
}
