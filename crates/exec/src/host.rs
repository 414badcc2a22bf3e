//! Host buffers: page-aligned, zero-initialised byte buffers that the CUDA side can page-lock in place
//! (`cuMemHostRegister`, ten times cheaper than allocating pinned memory, see TOOLCHAIN.md), and the element
//! types the executor stores (f32, f16, bf16) with their exact conversions.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use pipeshard_core::dtype::DType;

use crate::error::{ExecError, Result};

/// Alignment of host buffers: one page, so that registering them pins whole pages only.
pub const HOST_ALIGN_BYTES: usize = 4096;

/// A zero-initialised, page-aligned byte buffer.
pub struct HostBuf {
    ptr: NonNull<u8>,
    len_bytes: usize,
}

// SAFETY: HostBuf owns its allocation exclusively, like a Vec<u8>; shared references only read it.
unsafe impl Send for HostBuf {}
// SAFETY: as above; `&HostBuf` gives only shared, read-only access.
unsafe impl Sync for HostBuf {}

impl std::fmt::Debug for HostBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuf").field("len_bytes", &self.len_bytes).finish_non_exhaustive()
    }
}

impl HostBuf {
    /// A buffer of `len_bytes` zero bytes (at least one page is allocated so the pointer is never dangling),
    /// for small internal buffers; sizes that come from a model or a plan go through [`HostBuf::try_zeroed`].
    #[must_use]
    pub fn zeroed(len_bytes: usize) -> HostBuf {
        Self::try_zeroed(len_bytes, "a staging buffer").unwrap_or_else(|e| panic!("{e}"))
    }

    /// A buffer of `len_bytes` zero bytes, or [`ExecError::HostMemory`] naming `what` and the size when the
    /// host cannot give it (instead of aborting the process, as a failed allocation otherwise does).
    pub fn try_zeroed(len_bytes: usize, what: &str) -> Result<HostBuf> {
        let fail = || ExecError::HostMemory { what: what.to_string(), bytes: len_bytes as u64 };
        let layout = len_bytes
            .max(1)
            .checked_next_multiple_of(HOST_ALIGN_BYTES)
            .and_then(|n| Layout::from_size_align(n, HOST_ALIGN_BYTES).ok())
            .ok_or_else(fail)?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(fail)?;
        Ok(HostBuf { ptr, len_bytes })
    }

    /// Length in bytes.
    #[must_use]
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Bytes actually allocated (whole pages), the span to register.
    #[must_use]
    pub fn capacity_bytes(&self) -> usize {
        self.len_bytes.max(1).next_multiple_of(HOST_ALIGN_BYTES)
    }

    /// Whether the buffer holds no bytes.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len_bytes == 0
    }

    /// The bytes.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len_bytes initialised (zeroed) bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len_bytes) }
    }

    /// The bytes, mutably.
    #[must_use]
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len_bytes) }
    }

    /// The buffer as f32s (the buffer is page-aligned, so any length multiple of 4 is a valid f32 slice).
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // page-aligned allocation
    pub fn f32s(&self) -> &[f32] {
        // SAFETY: the pointer is 4096-aligned, the bytes are initialised, and every bit pattern is an f32.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<f32>(), self.len_bytes / 4) }
    }

    /// The buffer as mutable f32s.
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // page-aligned allocation
    pub fn f32s_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in f32s, with exclusive access through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<f32>(), self.len_bytes / 4) }
    }

    /// Raw start pointer (for page-locking and DMA).
    #[must_use]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.capacity_bytes(), HOST_ALIGN_BYTES).expect("valid layout");
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// An element type the executor stores: matrices in f16 or bf16, norms in f32, KV in f16, bf16 or f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Elem {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

impl Elem {
    /// The executor element type of a core format, if the executor stores it.
    #[must_use]
    pub fn from_dtype(d: DType) -> Option<Elem> {
        match d {
            DType::F32 => Some(Elem::F32),
            DType::F16 => Some(Elem::F16),
            DType::Bf16 => Some(Elem::Bf16),
            _ => None,
        }
    }

    /// The core format of this element type.
    #[must_use]
    pub const fn dtype(self) -> DType {
        match self {
            Elem::F32 => DType::F32,
            Elem::F16 => DType::F16,
            Elem::Bf16 => DType::Bf16,
        }
    }

    /// Bytes per element.
    #[must_use]
    pub const fn size_bytes(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F16 | Elem::Bf16 => 2,
        }
    }

    /// Rounds `x` to the nearest value this type holds (round to nearest even), as an f32.
    #[must_use]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Elem::F32 => x,
            Elem::F16 => f16::from_f32(x).to_f32(),
            Elem::Bf16 => bf16::from_f32(x).to_f32(),
        }
    }

    /// Reads element `i` of a byte slice holding this type.
    #[must_use]
    pub fn read(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            Elem::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes")),
            Elem::F16 => f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            Elem::Bf16 => bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        }
    }

    /// Elements `0..out.len()` of a byte slice holding this type, as f32 (one dispatch per row, so the loop
    /// vectorises; embedding a 1024-token ubatch element by element took 6.8 ms on the H200 machine).
    pub fn read_row(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            Elem::F32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Elem::F16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Elem::Bf16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
                }
            }
        }
    }

    /// Writes `xs` (rounded) as elements `0..xs.len()` of a byte slice holding this type, with one dispatch
    /// per row like [`Elem::read_row`] (a prefill chunk's MoE activations are 2 M elements).
    pub fn write_row(self, xs: &[f32], bytes: &mut [u8]) {
        match self {
            Elem::F32 => {
                for (c, x) in bytes.chunks_exact_mut(4).zip(xs) {
                    c.copy_from_slice(&x.to_le_bytes());
                }
            }
            Elem::F16 => {
                let n = xs.len().min(bytes.len() / 2);
                // SAFETY: f16 is a plain u16, so any two bytes are one.
                let (head, halves, _) = unsafe { bytes[..2 * n].align_to_mut::<f16>() };
                if cfg!(target_endian = "little") && head.is_empty() && halves.len() == n {
                    // half converts a slice with F16C where the CPU has it, 10× the element-wise conversion:
                    // op offload's host store of a 1008-token chunk's K and V took 4.3 ms a layer (run23).
                    halves.convert_from_f32_slice(&xs[..n]);
                } else {
                    for (c, &x) in bytes.chunks_exact_mut(2).zip(xs) {
                        c.copy_from_slice(&f16::from_f32(x).to_le_bytes());
                    }
                }
            }
            Elem::Bf16 => {
                for (c, &x) in bytes.chunks_exact_mut(2).zip(xs) {
                    c.copy_from_slice(&bf16::from_f32(x).to_le_bytes());
                }
            }
        }
    }

    /// Writes `x` (rounded) as element `i` of a byte slice holding this type.
    pub fn write(self, bytes: &mut [u8], i: usize, x: f32) {
        match self {
            Elem::F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes()),
            Elem::F16 => bytes[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(x).to_le_bytes()),
            Elem::Bf16 => bytes[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(x).to_le_bytes()),
        }
    }

    /// Name as in safetensors / GGUF.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::F16 => "f16",
            Elem::Bf16 => "bf16",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_page_aligned_and_zeroed() {
        let mut b = HostBuf::zeroed(10_000);
        assert_eq!(b.as_ptr() as usize % HOST_ALIGN_BYTES, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[9_999] = 7;
        assert_eq!(b.as_slice()[9_999], 7);
        assert_eq!(b.capacity_bytes(), 12_288);
    }

    /// An allocation the host cannot give is an error naming what and how much, not an abort.
    #[test]
    fn an_absurd_host_allocation_is_an_error() {
        for bytes in [1usize << 62, usize::MAX - 10] {
            let e = HostBuf::try_zeroed(bytes, "unit blk.0.ffn").unwrap_err();
            assert_eq!(e, ExecError::HostMemory { what: "unit blk.0.ffn".into(), bytes: bytes as u64 });
            let msg = e.to_string();
            assert!(msg.contains(&bytes.to_string()) && msg.contains("--layers"), "{msg}");
        }
    }

    /// A row written at once rounds exactly as element by element, aligned or not, overflow and subnormals
    /// included.
    #[test]
    fn rows_round_as_elements_do() {
        let mut xs: Vec<f32> = (0..4099).map(|i| (i as f32 * 0.731).sin() * 2f32.powi(i % 40 - 30)).collect();
        xs.extend([
            0.0,
            -0.0,
            65504.0,
            65520.0,
            -1e6,
            f32::INFINITY,
            f32::NEG_INFINITY,
            6e-8,
            -3e-5,
            f32::NAN,
        ]);
        for e in [Elem::F32, Elem::F16, Elem::Bf16] {
            let es = e.size_bytes();
            let mut one = vec![0u8; xs.len() * es];
            for (i, &x) in xs.iter().enumerate() {
                e.write(&mut one, i, x);
            }
            for skew in [0, 1] {
                let mut row = vec![7u8; xs.len() * es + skew + 3];
                e.write_row(&xs, &mut row[skew..skew + xs.len() * es]);
                let got = &row[skew..skew + xs.len() * es];
                let n = xs.len() - 1;
                assert_eq!(got[..n * es], one[..n * es], "{e:?} skew {skew}");
                assert!(e.read(got, n).is_nan(), "{e:?}: NaN stays NaN");
                assert!(row[skew + xs.len() * es..].iter().all(|&b| b == 7), "{e:?}: nothing past the row");
            }
        }
    }

    #[test]
    fn elements_round_trip() {
        let mut bytes = vec![0u8; 8];
        for e in [Elem::F32, Elem::F16, Elem::Bf16] {
            e.write(&mut bytes, 1, 1.2345);
            let back = e.read(&bytes, 1);
            assert!((back - 1.2345).abs() < 0.01, "{e:?} {back}");
            assert_eq!(back.to_bits(), e.round(1.2345).to_bits());
        }
    }
}
