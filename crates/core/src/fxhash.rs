//! The Fx hash (rustc's): one rotate, xor and multiply per word.
//!
//! Lookup tables keyed by small trusted values (unit ids, op shapes) are hit on every placement a planner or
//! the simulator touches; std's SipHash, keyed against flooding attacks, cost more than the work around it.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A fast, unkeyed hasher for trusted keys.
#[derive(Debug, Clone, Copy, Default)]
pub struct FxHasher(u64);

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for FxHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    /// Little-endian 8-byte words, the last one zero-padded.
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.add(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }
    fn write_u8(&mut self, x: u8) {
        self.add(u64::from(x));
    }
    fn write_u32(&mut self, x: u32) {
        self.add(u64::from(x));
    }
    fn write_u64(&mut self, x: u64) {
        self.add(x);
    }
    fn write_usize(&mut self, x: usize) {
        self.add(x as u64);
    }
    fn write_isize(&mut self, x: isize) {
        self.add(x as u64);
    }
}

/// A `HashMap` hashed with [`FxHasher`].
pub type FxHashMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_keys_hash_equal_and_distinct_ids_rarely_collide() {
        use crate::inventory::UnitId;
        use std::hash::BuildHasher;
        let b = BuildHasherDefault::<FxHasher>::default();
        let ids: Vec<UnitId> = (0..94)
            .flat_map(|layer| (0..128).map(move |expert| UnitId::Expert { layer, expert }))
            .chain((0..94).map(|layer| UnitId::Kv { layer }))
            .collect();
        let mut hashes: Vec<u64> = ids.iter().map(|id| b.hash_one(id)).collect();
        assert_eq!(b.hash_one(UnitId::Kv { layer: 3 }), b.hash_one(UnitId::Kv { layer: 3 }));
        hashes.sort_unstable();
        hashes.dedup();
        assert_eq!(hashes.len(), ids.len(), "distinct unit ids must hash apart");
    }
}
