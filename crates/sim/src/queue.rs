//! The event queue: a min-heap keyed by (time, event rank, insertion sequence).
//!
//! Two events at the same nanosecond are taken in rank order (an event type's fixed rank, lower first), and two
//! of the same rank in the order they were pushed. With integer time and no other source of order, every run of
//! the simulator takes exactly the same path.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// An event with a fixed rank among events of the same time.
pub trait Ranked {
    /// Lower ranks are handled first among events of the same time.
    fn rank(&self) -> u8;
}

#[derive(Debug)]
struct Entry<E> {
    time_ns: u64,
    /// The rank in the top byte, the insertion sequence below: one comparison orders both.
    rank_seq: u64,
    event: E,
}

/// Bits of `rank_seq` below the rank.
const SEQ_BITS: u32 = 56;

impl<E> Entry<E> {
    fn key(&self) -> (u64, u64) {
        (self.time_ns, self.rank_seq)
    }
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl<E> Eq for Entry<E> {}

impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<E> Ord for Entry<E> {
    /// Reversed, so that `BinaryHeap` (a max-heap) pops the smallest key first.
    fn cmp(&self, other: &Self) -> Ordering {
        other.key().cmp(&self.key())
    }
}

/// A deterministic priority queue of timed events.
#[derive(Debug)]
pub struct EventQueue<E> {
    heap: BinaryHeap<Entry<E>>,
    seq: u64,
}

impl<E: Ranked> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue::new()
    }
}

impl<E: Ranked> EventQueue<E> {
    /// An empty queue.
    #[must_use]
    pub fn new() -> EventQueue<E> {
        EventQueue { heap: BinaryHeap::new(), seq: 0 }
    }

    /// Schedules `event` at `time_ns`.
    pub fn push(&mut self, time_ns: u64, event: E) {
        assert!(self.seq < 1 << SEQ_BITS, "an event queue holds fewer than 2^56 pushes");
        let rank_seq = u64::from(event.rank()) << SEQ_BITS | self.seq;
        self.heap.push(Entry { time_ns, rank_seq, event });
        self.seq += 1;
    }

    /// Takes the earliest event (ties: lower rank, then earlier push).
    pub fn pop(&mut self) -> Option<(u64, E)> {
        self.heap.pop().map(|e| (e.time_ns, e.event))
    }

    /// The time of the earliest event, if any.
    #[must_use]
    pub fn peek_time_ns(&self) -> Option<u64> {
        self.heap.peek().map(|e| e.time_ns)
    }

    /// Empties the queue and restarts the insertion sequence: it then orders events exactly as a new one.
    pub fn clear(&mut self) {
        self.heap.clear();
        self.seq = 0;
    }

    /// Events waiting.
    #[must_use]
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether no event is waiting.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Ev(u8, &'static str);

    impl Ranked for Ev {
        fn rank(&self) -> u8 {
            self.0
        }
    }

    /// Pins the tie-breaking down: time first, then rank, then insertion order — never heap layout.
    #[test]
    fn ties_break_by_rank_then_insertion() {
        let mut q = EventQueue::new();
        q.push(5, Ev(2, "t5 r2 first"));
        q.push(5, Ev(0, "t5 r0"));
        q.push(7, Ev(0, "t7 r0"));
        q.push(5, Ev(2, "t5 r2 second"));
        q.push(3, Ev(3, "t3 r3"));
        q.push(5, Ev(1, "t5 r1"));
        q.push(5, Ev(2, "t5 r2 third"));
        assert_eq!(q.len(), 7);
        assert_eq!(q.peek_time_ns(), Some(3), "the earliest time, whatever was pushed last");
        let order: Vec<(u64, &str)> = std::iter::from_fn(|| q.pop()).map(|(t, e)| (t, e.1)).collect();
        assert_eq!(
            order,
            vec![
                (3, "t3 r3"),
                (5, "t5 r0"),
                (5, "t5 r1"),
                (5, "t5 r2 first"),
                (5, "t5 r2 second"),
                (5, "t5 r2 third"),
                (7, "t7 r0"),
            ]
        );
        assert!(q.is_empty());
        assert_eq!(q.peek_time_ns(), None);
    }

    #[test]
    fn many_equal_keys_pop_in_push_order() {
        let mut q = EventQueue::new();
        for i in 0..1000u32 {
            q.push(42, Ev(1, if i % 2 == 0 { "even" } else { "odd" }));
        }
        let names: Vec<&str> = std::iter::from_fn(|| q.pop()).map(|(_, e)| e.1).collect();
        assert!(names.chunks(2).all(|c| c == ["even", "odd"]));
    }
}
