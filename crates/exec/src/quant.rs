//! Block-quantised matrix formats, bit-exact with GGUF: `q8_0` (an f16 scale `d` and 32 signed bytes,
//! value = `q · d`) and `q4_0` (an f16 scale `d` and 16 bytes of nibbles, value = `(q − 8) · d`; the low nibble
//! of byte `j` is element `j`, the high nibble element `j + 16`). A row of `k` elements is `k / 32` blocks
//! laid out back to back, so a matrix is its rows' blocks in row order, as in a GGUF file.
//!
//! [`QFormat::quantize_row`] follows ggml's reference quantisers (`quantize_row_q8_0_ref`,
//! `quantize_row_q4_0_ref`): the scale is computed in f32 from the block's largest magnitude and stored rounded
//! to f16, while the quants are computed with the unrounded f32 scale. [`QFormat::dequantize_row`] is ggml's
//! `dequantize_row_q8_0` / `dequantize_row_q4_0`: the product of a small integer and an f16 is exact in f32,
//! so dequantised values are exact.

use half::f16;
use pipeshard_core::dtype::DType;

/// Elements per block of every format here.
pub const BLOCK_ELEMS: usize = 32;

/// The most tokens a quantised matmul takes with exactly dequantised (f32) weights, as a GEMV that
/// dequantises while it reads. With more tokens (prefill), CPU and GPU alike first dequantise the weights to
/// bf16 (the activation type of quantised models) and run a bf16 GEMM, so both sides compute the same function
/// for every token count.
pub const EXACT_MAX_TOKENS: usize = 8;

/// A block-quantised matrix format the executor computes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QFormat {
    /// f16 scale + 32 × i8.
    Q8_0,
    /// f16 scale + 32 × 4-bit unsigned, offset 8.
    Q4_0,
}

impl QFormat {
    /// Both formats.
    pub const ALL: [QFormat; 2] = [QFormat::Q8_0, QFormat::Q4_0];

    /// The executor format of a core dtype, if it is one of these.
    #[must_use]
    pub fn from_dtype(d: DType) -> Option<QFormat> {
        match d {
            DType::Q8_0 => Some(QFormat::Q8_0),
            DType::Q4_0 => Some(QFormat::Q4_0),
            _ => None,
        }
    }

    /// The core dtype.
    #[must_use]
    pub const fn dtype(self) -> DType {
        match self {
            QFormat::Q8_0 => DType::Q8_0,
            QFormat::Q4_0 => DType::Q4_0,
        }
    }

    /// Bytes per block of [`BLOCK_ELEMS`] elements.
    #[must_use]
    pub const fn block_bytes(self) -> usize {
        match self {
            QFormat::Q8_0 => 34,
            QFormat::Q4_0 => 18,
        }
    }

    /// Bytes of a row of `k` elements (`k` a multiple of [`BLOCK_ELEMS`]).
    #[must_use]
    pub const fn row_bytes(self, k: usize) -> usize {
        k / BLOCK_ELEMS * self.block_bytes()
    }

    /// Quantises `x` (a multiple of [`BLOCK_ELEMS`] values) into `out` (`row_bytes(x.len())` bytes).
    ///
    /// # Panics
    /// If the lengths do not match (a caller's bug: shapes are checked when weights are laid out).
    pub fn quantize_row(self, x: &[f32], out: &mut [u8]) {
        assert!(
            x.len().is_multiple_of(BLOCK_ELEMS) && out.len() == self.row_bytes(x.len()),
            "quantize_row: {} values into {} bytes of {self:?}",
            x.len(),
            out.len()
        );
        for (xb, ob) in x.chunks_exact(BLOCK_ELEMS).zip(out.chunks_exact_mut(self.block_bytes())) {
            match self {
                QFormat::Q8_0 => {
                    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                    ob[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                    for (o, &v) in ob[2..].iter_mut().zip(xb) {
                        // `round` is C's roundf (half away from zero); |v · id| ≤ 127.
                        *o = ((v * id).round() as i8).to_le_bytes()[0];
                    }
                }
                QFormat::Q4_0 => {
                    // The value of largest magnitude, with its sign, maps to −8.
                    let max = xb.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                    let d = max / -8.0;
                    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                    ob[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                    let (lo, hi) = xb.split_at(BLOCK_ELEMS / 2);
                    for ((o, &a), &b) in ob[2..].iter_mut().zip(lo).zip(hi) {
                        // C truncates `x · id + 8.5` to an integer and clamps it at 15.
                        let q = |v: f32| ((v * id + 8.5) as u8).min(15);
                        *o = q(a) | (q(b) << 4);
                    }
                }
            }
        }
    }

    /// Dequantises `blocks` (whole blocks) into `out` (`BLOCK_ELEMS` values per block).
    ///
    /// # Panics
    /// If the lengths do not match.
    pub fn dequantize_row(self, blocks: &[u8], out: &mut [f32]) {
        let bb = self.block_bytes();
        assert!(
            blocks.len().is_multiple_of(bb) && out.len() == blocks.len() / bb * BLOCK_ELEMS,
            "dequantize_row: {} bytes of {self:?} into {} values",
            blocks.len(),
            out.len()
        );
        for (b, ob) in blocks.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK_ELEMS)) {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            match self {
                QFormat::Q8_0 => {
                    for (o, &q) in ob.iter_mut().zip(&b[2..]) {
                        *o = f32::from(i8::from_le_bytes([q])) * d;
                    }
                }
                QFormat::Q4_0 => {
                    let (lo, hi) = ob.split_at_mut(BLOCK_ELEMS / 2);
                    for ((a, c), &q) in lo.iter_mut().zip(hi).zip(&b[2..]) {
                        *a = (f32::from(q & 0x0f) - 8.0) * d;
                        *c = (f32::from(q >> 4) - 8.0) * d;
                    }
                }
            }
        }
    }

    /// Quantises a row-major `[rows, k]` f32 matrix.
    #[must_use]
    pub fn quantize(self, x: &[f32], k: usize) -> Vec<u8> {
        let mut out = vec![0u8; x.len() / k * self.row_bytes(k)];
        for (xr, or) in x.chunks_exact(k).zip(out.chunks_exact_mut(self.row_bytes(k))) {
            self.quantize_row(xr, or);
        }
        out
    }

    /// Dequantises a whole `[rows, k]` matrix to f32.
    #[must_use]
    pub fn dequantize(self, blocks: &[u8]) -> Vec<f32> {
        let mut out = vec![0f32; blocks.len() / self.block_bytes() * BLOCK_ELEMS];
        self.dequantize_row(blocks, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(d: f32, quants: &[u8]) -> Vec<u8> {
        let mut b = f16::from_f32(d).to_le_bytes().to_vec();
        b.extend_from_slice(quants);
        b
    }

    #[test]
    #[allow(clippy::float_cmp)] // dequantised values are exact products of small integers and an f16
    fn hand_made_q8_0_block_dequantises_to_q_times_d() {
        // d = 0.5 (exact in f16); quants −128, −1, 0, 1, 127, then j − 16 for the rest.
        let mut q: Vec<u8> = (0..32).map(|j| ((j as i8) - 16).to_le_bytes()[0]).collect();
        q[..5].copy_from_slice(&[0x80, 0xff, 0x00, 0x01, 0x7f]);
        let out = QFormat::Q8_0.dequantize(&block(0.5, &q));
        assert_eq!(&out[..5], &[-64.0, -0.5, 0.0, 0.5, 63.5]);
        for (j, &v) in out.iter().enumerate().skip(5) {
            assert_eq!(v, (j as f32 - 16.0) * 0.5, "element {j}");
        }
    }

    #[test]
    #[allow(clippy::float_cmp)]
    fn hand_made_q4_0_block_puts_low_nibbles_first() {
        // Byte j = (high 15 − j) << 4 | low j: element j is (j − 8)·d, element 16 + j is (7 − j)·d.
        let q: Vec<u8> = (0..16u8).map(|j| ((15 - j) << 4) | j).collect();
        let out = QFormat::Q4_0.dequantize(&block(0.25, &q));
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.25, "low nibble {j}");
            assert_eq!(out[16 + j], (7.0 - j as f32) * 0.25, "high nibble {j}");
        }
        // The scale is stored in f16: 0.1 is rounded (0.0999755859375), and that is what multiplies.
        let d16 = f16::from_f32(0.1).to_f32();
        assert_eq!(QFormat::Q4_0.dequantize(&block(0.1, &[0x9f; 16]))[0], 7.0 * d16);
    }

    #[test]
    #[allow(clippy::float_cmp)] // −0.5 is exact in f16
    fn quantisers_follow_the_reference_rules() {
        // q8_0: the largest magnitude maps to ±127, d = amax / 127.
        let x: Vec<f32> = (0..32).map(|i| (i as f32 - 12.0) * 0.3).collect();
        let b = QFormat::Q8_0.quantize(&x, 32);
        let d = 19.0 * 0.3 / 127.0;
        assert_eq!(f16::from_le_bytes([b[0], b[1]]), f16::from_f32(d));
        assert_eq!(i8::from_le_bytes([b[2 + 31]]), 127);
        assert_eq!(i8::from_le_bytes([b[2]]), (-12.0f32 * 0.3 / d).round() as i8);
        // q4_0: the signed maximum maps to nibble 0 (value −8·d), so d = max / −8 (negative here).
        let mut y = [0.1f32; 32];
        y[20] = 4.0;
        y[3] = -1.0;
        let b = QFormat::Q4_0.quantize(&y, 32);
        assert_eq!(f16::from_le_bytes([b[0], b[1]]).to_f32(), -0.5);
        assert_eq!(b[2 + 4] >> 4, 0, "element 20 is the high nibble of byte 4");
        assert_eq!(b[2 + 3] & 0x0f, 10, "−1 / −0.5 + 8.5 = 10.5 truncates to 10");
        assert_eq!(b[2] & 0x0f, 8, "0.1 / −0.5 + 8.5 = 8.3 truncates to 8");
        // An all-zero block has d = 0 and dequantises to zeros.
        let z = QFormat::Q4_0.quantize(&[0.0; 32], 32);
        assert!(QFormat::Q4_0.dequantize(&z).iter().all(|&v| v == 0.0));
    }

    #[test]
    fn round_trip_error_is_within_half_a_step_but_at_q4_0s_clamped_end() {
        let x: Vec<f32> = (0..256).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 3.0).collect();
        for f in QFormat::ALL {
            let back = f.dequantize(&f.quantize(&x, 64));
            for (xb, bb) in x.chunks(32).zip(back.chunks(32)) {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                // q4_0 maps the signed maximum to −8, so the opposite end (+8) clamps to 7: a whole step.
                let (step, max_steps) = match f {
                    QFormat::Q8_0 => (amax / 127.0, 0.5),
                    QFormat::Q4_0 => (amax / 8.0, 1.0),
                };
                let mut worst = 0f32;
                for (a, b) in xb.iter().zip(bb) {
                    // Plus the f16 rounding of the scale times the largest quant.
                    assert!(
                        (a - b).abs() <= max_steps * step + amax * 1e-3,
                        "{f:?} {a} vs {b} (step {step})"
                    );
                    worst = worst.max((a - b).abs());
                }
                assert!(worst > 0.0, "{f:?}: random values are not all representable");
            }
        }
    }
}
