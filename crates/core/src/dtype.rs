//! Weight and cache element formats with GGUF block semantics.
//!
//! Quantised formats store weights in fixed-size blocks along a row (the innermost dimension): a row of `k`
//! elements needs `k / block_elems` blocks of `block_bytes` each. Values follow ggml's `ggml_type_traits`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A tensor element format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    #[serde(rename = "q2_k")]
    Q2K,
    #[serde(rename = "q3_k")]
    Q3K,
    #[serde(rename = "q4_k")]
    Q4K,
    #[serde(rename = "q5_k")]
    Q5K,
    #[serde(rename = "q6_k")]
    Q6K,
}

/// A shape that a format cannot store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DTypeError {
    #[error(
        "a {dtype} row must hold a multiple of {block} elements, got {row_elems}: pick another format or pad the row"
    )]
    RowNotBlockAligned { dtype: DType, block: u64, row_elems: u64 },
    #[error("{rows} rows of {row_elems} {dtype} elements do not fit in 2^64 bytes")]
    TooLarge { dtype: DType, row_elems: u64, rows: u64 },
    #[error(
        "unknown weight format `{0}`; known: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k"
    )]
    Unknown(String),
}

impl DType {
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
    ];

    /// Elements per block (1 for plain float formats).
    #[must_use]
    pub const fn block_elems(self) -> u64 {
        match self {
            DType::F32 | DType::F16 | DType::Bf16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => 32,
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => 256,
        }
    }

    /// Bytes per block, as ggml lays the block structs out.
    #[must_use]
    pub const fn block_bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::Q8_0 => 34, // f16 scale + 32 × i8
            DType::Q4_0 => 18, // f16 scale + 16 bytes of nibbles
            DType::Q4_1 => 20, // f16 scale + f16 min + 16
            DType::Q5_0 => 22, // f16 scale + 4 bytes high bits + 16
            DType::Q5_1 => 24, // f16 scale + f16 min + 4 + 16
            DType::Q2K => 84,  // 16 scales + 64 quants + 2 × f16
            DType::Q3K => 110, // 32 hmask + 64 quants + 12 scales + f16
            DType::Q4K => 144, // 2 × f16 + 12 scales + 128 quants
            DType::Q5K => 176, // 2 × f16 + 12 scales + 32 high bits + 128 quants
            DType::Q6K => 210, // 128 low + 64 high + 16 scales + f16
        }
    }

    /// Average storage bits per element.
    #[must_use]
    pub fn bits_per_weight(self) -> f64 {
        (self.block_bytes() * 8) as f64 / self.block_elems() as f64
    }

    /// Whether the format is a block-quantised one (dequantised before or during a matmul).
    #[must_use]
    pub const fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes of a tensor whose rows hold `row_elems` elements and that has `rows` rows.
    pub fn tensor_bytes(self, row_elems: u64, rows: u64) -> Result<u64, DTypeError> {
        let block = self.block_elems();
        if !row_elems.is_multiple_of(block) {
            return Err(DTypeError::RowNotBlockAligned { dtype: self, block, row_elems });
        }
        (row_elems / block)
            .checked_mul(self.block_bytes())
            .and_then(|b| b.checked_mul(rows))
            .ok_or(DTypeError::TooLarge { dtype: self, row_elems, rows })
    }

    /// GGUF / ggml spelling.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q2K => "q2_k",
            DType::Q3K => "q3_k",
            DType::Q4K => "q4_k",
            DType::Q5K => "q5_k",
            DType::Q6K => "q6_k",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = DTypeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        DType::ALL.into_iter().find(|d| d.name() == lower).ok_or_else(|| DTypeError::Unknown(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    #[allow(clippy::float_cmp)] // bits per weight are exact binary fractions
    fn known_block_layouts() {
        assert_eq!(DType::Q4_0.bits_per_weight(), 4.5);
        assert_eq!(DType::Q8_0.bits_per_weight(), 8.5);
        assert_eq!(DType::Q2K.bits_per_weight(), 2.625);
        assert_eq!(DType::Q4K.bits_per_weight(), 4.5);
        assert_eq!(DType::Q6K.bits_per_weight(), 6.5625);
        assert_eq!(DType::Bf16.tensor_bytes(4096, 4096).unwrap(), 32 * 1024 * 1024);
    }

    #[test]
    fn misaligned_rows_are_rejected() {
        let err = DType::Q4K.tensor_bytes(100, 3).unwrap_err();
        assert!(err.to_string().contains("multiple of 256"), "{err}");
    }

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.name()));
        }
        assert!("q9_0".parse::<DType>().is_err());
    }

    proptest! {
        #[test]
        fn bytes_scale_with_blocks(d in proptest::sample::select(DType::ALL.to_vec()), blocks in 1u64..512, rows in 1u64..64) {
            let row = blocks * d.block_elems();
            let bytes = d.tensor_bytes(row, rows).unwrap();
            prop_assert_eq!(bytes, blocks * d.block_bytes() * rows);
            prop_assert!((bytes as f64 * 8.0 / (row * rows) as f64 - d.bits_per_weight()).abs() < 1e-9);
        }
    }
}
