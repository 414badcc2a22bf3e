//! Parallel requests: where the KV cells of R sequences live in a layer's cache, and which tokens a forward
//! pass runs.
//!
//! A layer's cache is one `[K | V]` buffer of `R × ctx` rows ([`SeqKv::whole`]). As the simulator models it
//! (core's `Workload::prefill_chunks`, `kv_copies`), every request's prompt is prefilled in turn, then each
//! decode step runs one token of every sequence ([`Pass`]). Two arrangements, the workload's `kv_unified`:
//! - per sequence: sequence `s` owns rows `s·ctx ..`; a decode step's new cells, and the cells a streamed
//!   layer uploads, are one run per sequence (R copies);
//! - unified (llama.cpp `-kvu`): cells in the order they are written — every prompt in turn (`s·P + pos`), then
//!   each decode step's R cells side by side — so a step's new cells and the used cache are one run each. A GPU
//!   attention scans every used cell and masks the other sequences' (as llama.cpp's CUDA kernels do and the
//!   simulator costs it); the CPU reads a sequence's own cells only.
//!
//! With one sequence both arrangements are the single-request cache: row = position.

use crate::cpu::KvLayout;

/// The tokens of one forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// `tokens` prompt tokens of sequence `seq` at positions `pos0..`.
    Prefill { seq: usize, pos0: usize, tokens: usize },
    /// One token of every sequence, all at position `pos` (every request has the same prompt length).
    Decode { pos: usize },
}

/// A run of consecutive cache rows: `(first row, rows)`.
pub type Run = (usize, usize);

/// The rows query `t` of a pass attends to, in position order: `a_len` rows from `a_start`, then `b_len`
/// rows from `b_start` every `b_stride` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRows {
    pub a_start: usize,
    pub a_len: usize,
    pub b_start: usize,
    pub b_stride: usize,
    pub b_len: usize,
}

impl KeyRows {
    /// How many keys.
    #[must_use]
    pub fn len(&self) -> usize {
        self.a_len + self.b_len
    }

    /// Whether there are none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `j`-th key's row.
    #[must_use]
    pub fn row(&self, j: usize) -> usize {
        if j < self.a_len { self.a_start + j } else { self.b_start + (j - self.a_len) * self.b_stride }
    }
}

/// How the GPU attention kernel finds query `t`'s keys: rows `base + t·seq_rows ..` for
/// `pos0 + t·pos_step + 1` keys; with `mask_seqs > 0` (a unified cache in decode), every used row is scanned
/// and a row counts only if it is the query's sequence's (`owner(row) == t`, see [`SeqKv::owner`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuKeys {
    pub base_row: usize,
    pub seq_rows: usize,
    pub pos0: usize,
    pub pos_step: usize,
    pub mask_prompt: usize,
    pub mask_seqs: usize,
}

impl GpuKeys {
    /// Causal attention of one sequence's queries at positions `pos0..` over rows `0..`.
    #[must_use]
    pub fn causal(pos0: usize) -> GpuKeys {
        GpuKeys { base_row: 0, seq_rows: 0, pos0, pos_step: 1, mask_prompt: 0, mask_seqs: 0 }
    }
}

/// The KV cache of R sequences of one layer.
#[derive(Debug, Clone, Copy)]
pub struct SeqKv {
    /// One sequence's cache: `ctx` rows of `kv_dim`.
    pub seq: KvLayout,
    /// Sequences (parallel requests).
    pub seqs: usize,
    /// One cache in write order rather than one region per sequence.
    pub unified: bool,
    /// Prompt tokens of every sequence.
    pub prompt: usize,
}

impl SeqKv {
    /// One request's cache.
    #[must_use]
    pub fn single(seq: KvLayout) -> SeqKv {
        SeqKv { seq, seqs: 1, unified: false, prompt: 0 }
    }

    /// The whole `[K | V]` buffer: `seqs × ctx` rows.
    #[must_use]
    pub fn whole(&self) -> KvLayout {
        KvLayout { ctx: self.seq.ctx * self.seqs, ..self.seq }
    }

    /// The row of sequence `seq`'s cell at position `pos`.
    #[must_use]
    pub fn row(&self, seq: usize, pos: usize) -> usize {
        match (self.unified, pos < self.prompt) {
            (false, _) => seq * self.seq.ctx + pos,
            (true, true) => seq * self.prompt + pos,
            (true, false) => self.seqs * self.prompt + (pos - self.prompt) * self.seqs + seq,
        }
    }

    /// The sequence a row of a unified cache belongs to.
    #[must_use]
    pub fn owner(&self, row: usize) -> usize {
        let prompts = self.seqs * self.prompt;
        if row < prompts { row / self.prompt } else { (row - prompts) % self.seqs }
    }

    /// The cells already in the cache that `pass` reads, as runs (one copy each when they move).
    #[must_use]
    pub fn filled(&self, pass: Pass) -> Vec<Run> {
        let runs = match pass {
            Pass::Prefill { seq, pos0, .. } => vec![(self.row(seq, 0), pos0)],
            Pass::Decode { pos } if self.unified => vec![(0, self.row(0, pos))],
            Pass::Decode { pos } => (0..self.seqs).map(|s| (self.row(s, 0), pos)).collect(),
        };
        runs.into_iter().filter(|r| r.1 > 0).collect()
    }

    /// The cells `pass` writes, as runs.
    #[must_use]
    pub fn new_cells(&self, pass: Pass) -> Vec<Run> {
        match pass {
            Pass::Prefill { seq, pos0, tokens } => vec![(self.row(seq, pos0), tokens)],
            Pass::Decode { pos } if self.unified => vec![(self.row(0, pos), self.seqs)],
            Pass::Decode { pos } => (0..self.seqs).map(|s| (self.row(s, pos), 1)).collect(),
        }
    }

    /// Token `t`'s new cell is row `first + t·step`.
    #[must_use]
    pub fn store_rows(&self, pass: Pass) -> (usize, usize) {
        match pass {
            Pass::Prefill { seq, pos0, .. } => (self.row(seq, pos0), 1),
            Pass::Decode { pos } if self.unified => (self.row(0, pos), 1),
            Pass::Decode { pos } => (pos, self.seq.ctx),
        }
    }

    /// Token `t`'s own keys (its new cell included), in position order.
    #[must_use]
    pub fn keys(&self, pass: Pass, t: usize) -> KeyRows {
        let none = |a_start, a_len| KeyRows { a_start, a_len, b_start: 0, b_stride: 1, b_len: 0 };
        match pass {
            Pass::Prefill { seq, pos0, .. } => none(self.row(seq, 0), pos0 + t + 1),
            Pass::Decode { pos } if self.unified => KeyRows {
                a_start: self.row(t, 0),
                a_len: self.prompt.min(pos + 1),
                b_start: self.seqs * self.prompt + t,
                b_stride: self.seqs,
                b_len: (pos + 1).saturating_sub(self.prompt),
            },
            Pass::Decode { pos } => none(self.row(t, 0), pos + 1),
        }
    }

    /// What the GPU attention kernel scans for `pass`.
    #[must_use]
    pub fn gpu_keys(&self, pass: Pass) -> GpuKeys {
        match pass {
            Pass::Prefill { seq, pos0, .. } => {
                GpuKeys { base_row: self.row(seq, 0), ..GpuKeys::causal(pos0) }
            }
            Pass::Decode { pos } if self.unified && self.seqs > 1 => GpuKeys {
                pos_step: 0,
                mask_prompt: self.prompt,
                mask_seqs: self.seqs,
                ..GpuKeys::causal(self.row(self.seqs - 1, pos))
            },
            Pass::Decode { pos } => GpuKeys { seq_rows: self.seq.ctx, pos_step: 0, ..GpuKeys::causal(pos) },
        }
    }
}

impl Pass {
    /// Tokens the pass runs.
    #[must_use]
    pub fn tokens(&self, seqs: usize) -> usize {
        match *self {
            Pass::Prefill { tokens, .. } => tokens,
            Pass::Decode { .. } => seqs,
        }
    }

    /// Token `t`'s position is `pos0 + t·step`: `(pos0, step)`.
    #[must_use]
    pub fn positions(&self) -> (usize, usize) {
        match *self {
            Pass::Prefill { pos0, .. } => (pos0, 1),
            Pass::Decode { pos } => (pos, 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::Elem;

    fn cache(seqs: usize, unified: bool) -> SeqKv {
        SeqKv { seq: KvLayout { ctx: 8, kv_dim: 4, elem: Elem::F16 }, seqs, unified, prompt: 3 }
    }

    /// Every (sequence, position) gets its own row inside the buffer; the rows a pass writes are its new
    /// cells, and the keys of a token are exactly its sequence's cells up to its position.
    #[test]
    fn cells_are_distinct_and_keys_are_own_cells() {
        for (seqs, unified) in [(1, false), (1, true), (3, false), (3, true)] {
            let c = cache(seqs, unified);
            let rows: std::collections::HashSet<usize> =
                (0..seqs).flat_map(|s| (0..8).map(move |p| (s, p))).map(|(s, p)| c.row(s, p)).collect();
            assert_eq!(rows.len(), seqs * 8, "{seqs} {unified}");
            assert!(rows.iter().all(|&r| r < c.whole().ctx));
            for pos in 3..8 {
                let pass = Pass::Decode { pos };
                let written: Vec<usize> =
                    c.new_cells(pass).iter().flat_map(|&(a, n)| a..a + n).collect::<Vec<_>>();
                let (first, step) = c.store_rows(pass);
                let stored: Vec<usize> = (0..seqs).map(|t| first + t * step).collect();
                let mut w = written.clone();
                w.sort_unstable();
                let mut s = stored.clone();
                s.sort_unstable();
                assert_eq!(w, s);
                assert_eq!(stored, (0..seqs).map(|t| c.row(t, pos)).collect::<Vec<_>>());
                for t in 0..seqs {
                    let k = c.keys(pass, t);
                    let got: Vec<usize> = (0..k.len()).map(|j| k.row(j)).collect();
                    assert_eq!(got, (0..=pos).map(|p| c.row(t, p)).collect::<Vec<_>>());
                    if unified {
                        assert!(got.iter().all(|&r| c.owner(r) == t));
                    }
                }
                // The filled runs cover every earlier cell of every sequence.
                let filled: std::collections::HashSet<usize> =
                    c.filled(pass).iter().flat_map(|&(a, n)| a..a + n).collect();
                for s in 0..seqs {
                    assert!((0..pos).all(|p| filled.contains(&c.row(s, p))));
                }
            }
        }
    }

    #[test]
    fn unified_moves_one_run_per_copy_and_per_sequence_one_per_sequence() {
        let pass = Pass::Decode { pos: 5 };
        assert_eq!(cache(3, true).new_cells(pass), vec![(3 * 3 + 2 * 3, 3)]);
        assert_eq!(cache(3, true).filled(pass), vec![(0, 15)]);
        assert_eq!(cache(3, false).new_cells(pass), vec![(5, 1), (13, 1), (21, 1)]);
        assert_eq!(cache(3, false).filled(pass).len(), 3);
        // The masked scan covers every used cell, the new ones included.
        let g = cache(3, true).gpu_keys(pass);
        assert_eq!((g.pos0 + 1, g.mask_seqs), (15 + 3, 3));
    }
}
