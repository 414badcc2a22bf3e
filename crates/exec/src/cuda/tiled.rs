//! The host side of the tiled expert kernels ([`super::Gpu::tiled_experts`]): a MoE layer's pinned picked
//! experts cut into tiles and groups, and each group's per-token entry lists, in the layout the kernels read.
//!
//! Entries are the token permutation's (experts ascending, an expert's tokens ascending), numbered from 0.
//! A tile is at most [`TILE_ENTRIES`] entries of one expert; a group is a run of whole experts whose entries
//! fit `rows` rows of the per-expert path's `moe_act` and `moe_y` (next fit, in expert order), so a group's
//! outputs need no scratch of their own. The index is one byte block, uploaded in one copy:
//! - tiles, 16 bytes each: the expert unit's device address (u64), its first entry and its entries (u32);
//! - the entry lists: for each group, each token's entries (u32 entry ids) in ascending expert order — group
//!   g's lists occupy its own entries' positions, so they are one array of all entries;
//! - each group's `m + 1` u32 offsets into that array, by token.

use std::ops::Range;

/// Entries of a tile at most (`TE_ROWS` in kernels.cu: 8 warps of 16 rows). A tile's weights are dequantised
/// once for all its entries, and an expert of a 1024-token chunk (≈ 63 ± 8 entries for qwen3-30b-a3b) fits
/// one: with 64, half of them took a second, nearly empty tile, and the layer ran 1.47× the profiler's
/// 64-token rows (validation run36, 2.93 ms against 2.0 a q4_0 layer).
pub const TILE_ENTRIES: usize = 128;
/// Bytes of a tile: unit address (u64), first entry (u32), entries (u32).
const TILE_BYTES: usize = 16;

/// One group: one launch of each tiled kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TiledGroup {
    /// Its tiles (indices into the index's tiles).
    pub tiles: Range<usize>,
    /// Its entries: `act`/`y` row r holds entry `entries.start + r`.
    pub entries: Range<usize>,
    /// Byte offset in the index of its `m + 1` per-token offsets into the entry lists.
    pub tok_first: usize,
}

/// Where [`build_tiled_index`] put things.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TiledIndex {
    pub groups: Vec<TiledGroup>,
    /// Byte offset of the entry lists (the tiles start at 0).
    pub tok_ent: usize,
    /// Bytes written.
    pub bytes: usize,
}

/// The most bytes [`build_tiled_index`] writes for `entries` entries of at most `experts` experts over `m`
/// tokens, in groups of `rows` rows. Tiles: Σ ⌈c/128⌉ ≤ ⌈entries/128⌉ + experts. Groups: two consecutive next-fit
/// groups hold more than `rows` entries, so there are at most 2⌊entries/rows⌋ + 1 (and at most `experts`).
#[must_use]
pub fn tiled_index_max_bytes(m: usize, entries: usize, experts: usize, rows: usize) -> usize {
    let tiles = entries.div_ceil(TILE_ENTRIES) + experts;
    let groups = (2 * (entries / rows.max(1)) + 1).min(experts.max(1));
    tiles * TILE_BYTES + 4 * entries + 4 * groups * (m + 1)
}

/// Writes the index of `experts` (each its unit's device address and its entries, in entry order from entry
/// 0) into `out`, given each entry's token (`tokens`, all < `m`, an expert's distinct), in groups of at most
/// `rows` entries (`rows` ≥ every expert's entries).
///
/// # Panics
/// If `out` is shorter than [`tiled_index_max_bytes`] or an expert has more than `rows` entries: the caller
/// sized both.
#[must_use]
pub fn build_tiled_index(
    experts: &[(u64, usize)],
    tokens: &[u32],
    m: usize,
    rows: usize,
    out: &mut [u8],
) -> TiledIndex {
    let entries: usize = experts.iter().map(|e| e.1).sum();
    assert_eq!(tokens.len(), entries, "one token an entry");
    let mut put = |at: usize, v: &[u8]| out[at..at + v.len()].copy_from_slice(v);
    // Groups (next fit) and tiles.
    let mut spans: Vec<(Range<usize>, Range<usize>)> = Vec::new(); // (tiles, entries)
    let (mut first, mut n_tiles) = (0usize, 0usize);
    for &(unit, c) in experts {
        assert!(c <= rows, "an expert's {c} entries exceed the group's {rows} rows");
        match spans.last_mut() {
            Some((_, e)) if e.len() + c <= rows => {}
            _ => spans.push((n_tiles..n_tiles, first..first)),
        }
        for start in (0..c).step_by(TILE_ENTRIES) {
            let at = n_tiles * TILE_BYTES;
            put(at, &unit.to_le_bytes());
            put(at + 8, &((first + start) as u32).to_le_bytes());
            put(at + 12, &((c - start).min(TILE_ENTRIES) as u32).to_le_bytes());
            n_tiles += 1;
        }
        first += c;
        let (t, e) = spans.last_mut().expect("a group was opened");
        (t.end, e.end) = (n_tiles, first);
    }
    let tok_ent = n_tiles * TILE_BYTES;
    let firsts = tok_ent + 4 * entries;
    let mut groups = Vec::with_capacity(spans.len());
    let mut count = vec![0u32; m + 1];
    for (g, (tiles, ent)) in spans.into_iter().enumerate() {
        // Counting sort of the group's entries by token: stable, so a token's entries stay in expert order.
        count.fill(0);
        for &t in &tokens[ent.clone()] {
            count[t as usize + 1] += 1;
        }
        let mut at = ent.start as u32;
        let tok_first = firsts + 4 * g * (m + 1);
        for (t, c) in count.iter_mut().enumerate() {
            at += *c;
            *c = at - ent.start as u32;
            put(tok_first + 4 * t, &at.to_le_bytes());
        }
        // `count[t]` is now token t's next slot, relative to the group's first entry.
        for p in ent.clone() {
            let slot = &mut count[tokens[p] as usize];
            put(tok_ent + 4 * (ent.start + *slot as usize), &(p as u32).to_le_bytes());
            *slot += 1;
        }
        groups.push(TiledGroup { tiles, entries: ent, tok_first });
    }
    let bytes = firsts + 4 * groups.len() * (m + 1);
    TiledIndex { groups, tok_ent, bytes }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    /// Every entry in exactly one tile of its own expert and one group's list of its token, a token's entries in
    /// ascending expert order, groups within their rows and the bytes within the bound — over pseudo-random
    /// routings of up to 200 tokens and 40 experts, and one worked example.
    #[test]
    fn tiles_groups_and_token_lists_cover_every_entry_once_in_expert_order() {
        // Worked example: 3 tokens; experts A (tokens 0, 2), B (1), C (0, 1, 2); 3 rows a group.
        let mut out = vec![0u8; tiled_index_max_bytes(3, 6, 3, 3)];
        let ix = build_tiled_index(&[(0xA0, 2), (0xB0, 1), (0xC0, 3)], &[0, 2, 1, 0, 1, 2], 3, 3, &mut out);
        assert_eq!(ix.groups.len(), 2);
        assert_eq!((ix.groups[0].entries.clone(), ix.groups[1].entries.clone()), (0..3, 3..6));
        let firsts: Vec<u32> = (0..4).map(|t| u32_at(&out, ix.groups[0].tok_first + 4 * t)).collect();
        assert_eq!(firsts, [0, 1, 2, 3]);
        let lists: Vec<u32> = (0..6).map(|i| u32_at(&out, ix.tok_ent + 4 * i)).collect();
        assert_eq!(lists, [0, 2, 1, 3, 4, 5]);

        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for _ in 0..300 {
            let (m, n_experts) = (1 + next(200), 1 + next(40));
            let top_k = 1 + next(n_experts.min(8));
            let mut lists: Vec<Vec<u32>> = vec![Vec::new(); n_experts];
            for t in 0..m {
                let mut picked = Vec::new();
                while picked.len() < top_k {
                    let e = next(n_experts);
                    if !picked.contains(&e) {
                        picked.push(e);
                    }
                }
                for e in picked {
                    lists[e].push(t as u32);
                }
            }
            lists.retain(|l| !l.is_empty());
            let experts: Vec<(u64, usize)> =
                lists.iter().enumerate().map(|(i, l)| (0x1000 * (i as u64 + 1), l.len())).collect();
            let tokens: Vec<u32> = lists.concat();
            let rows = m + next(m + 1);
            let max = tiled_index_max_bytes(m, tokens.len(), experts.len(), rows);
            let mut out = vec![0xffu8; max];
            let ix = build_tiled_index(&experts, &tokens, m, rows, &mut out);
            assert!(ix.bytes <= max, "{} bytes over the bound {max}", ix.bytes);
            // Each entry's expert, by entry.
            let owner: Vec<usize> = experts.iter().enumerate().flat_map(|(i, e)| vec![i; e.1]).collect();
            let mut tiled = vec![0; tokens.len()];
            let mut listed = vec![0; tokens.len()];
            let mut next_entry = 0;
            for g in &ix.groups {
                assert_eq!(g.entries.start, next_entry, "groups are contiguous");
                next_entry = g.entries.end;
                assert!(g.entries.len() <= rows);
                for tile in g.tiles.clone() {
                    let at = tile * TILE_BYTES;
                    let unit = u64::from_le_bytes(out[at..at + 8].try_into().unwrap());
                    let (first, n) = (u32_at(&out, at + 8) as usize, u32_at(&out, at + 12) as usize);
                    assert!((1..=TILE_ENTRIES).contains(&n) && g.entries.contains(&first));
                    assert!(first + n <= g.entries.end);
                    for p in first..first + n {
                        assert_eq!(experts[owner[p]].0, unit, "a tile holds one expert's entries");
                        tiled[p] += 1;
                    }
                }
                for t in 0..m {
                    let (a, b) = (u32_at(&out, g.tok_first + 4 * t), u32_at(&out, g.tok_first + 4 * t + 4));
                    let ps: Vec<usize> =
                        (a..b).map(|i| u32_at(&out, ix.tok_ent + 4 * i as usize) as usize).collect();
                    assert!(ps.windows(2).all(|w| owner[w[0]] < owner[w[1]]), "expert order");
                    for p in ps {
                        assert!(g.entries.contains(&p) && tokens[p] as usize == t);
                        listed[p] += 1;
                    }
                }
            }
            assert_eq!(next_entry, tokens.len());
            assert!(tiled.iter().chain(&listed).all(|&c| c == 1), "every entry once");
        }
    }
}
