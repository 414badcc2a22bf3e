//! The discrete-event engine that runs one [`StepGraph`].
//!
//! State: per task its unmet dependencies and status; per exclusive lane (GPU stream, CPU pool, H2D engine,
//! D2H engine) a FIFO of its tasks in creation order and what runs now; the ring slots and who holds them; the
//! number of copies in flight. Events are one enum, [`Event`], handled in one `match` (`Engine::handle`)
//! that pushes follow-up events. After every event of an instant, a dispatch starts whatever can start: copies
//! first, since a copy starting changes the rate of the computes that start with it, then computes, then
//! latency-only tasks (hand-offs, the host's enqueues). The dispatch is not queued: it is the instant's last step (as an event it would rank after
//! every other), so the loop runs it once the queue holds nothing more at that time — half the queue's
//! traffic, as every completion asked for one.
//!
//! Shared memory bandwidth: a compute runs at its `duration_ns` rate while no H2D/D2H copy is in flight and at
//! its `duration_contended_ns` rate while one is; a copy at its `duration_ns` rate while the CPU pool is idle
//! and at its `duration_contended_ns` rate while the pool computes (an H2D copy's DMA reads the host DRAM the
//! pool streams from). When the number of copies in flight changes between zero and non-zero, or the pool
//! between idle and busy, every task it affects carries its remaining fraction over to the new rate and its
//! completion is rescheduled; the old completion event is recognised as stale by its generation number. A
//! latency-only task takes its `duration_contended_ns` where an H2D copy is in flight as it starts (a
//! hand-off's reads of host memory queue behind the copy's), and keeps it.

use pipeshard_core::plan::PhaseKind;

use crate::graph::{Lane, StepGraph, Task, TaskKind};
use crate::queue::{EventQueue, Ranked};

/// Something that happens at an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A copy (stream, offload or KV write-back) finished, unless a rate change has since rescheduled it.
    CopyDone { task: u32, generation: u32 },
    /// A latency-only task (a hand-off, the host's enqueue of a streamed part) finished.
    LatencyDone { task: u32 },
    /// A compute finished, unless a rate change has since rescheduled it (a newer `generation`).
    ComputeDone { task: u32, generation: u32 },
}

impl Ranked for Event {
    fn rank(&self) -> u8 {
        match self {
            Event::CopyDone { .. } => 0,
            Event::LatencyDone { .. } => 1,
            Event::ComputeDone { .. } => 2,
        }
    }
}

/// One tenancy of a ring slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotUse {
    pub slot: u32,
    pub item: u32,
    /// When the item's copy started writing the slot.
    pub claimed_ns: u64,
    /// When the last task reading the item ended.
    pub released_ns: u64,
}

/// What a step graph did.
#[derive(Debug, Clone)]
pub struct StepOutcome {
    pub graph: StepGraph,
    /// Start and end of every task (indexed like `graph.tasks`).
    pub start_ns: Vec<u64>,
    pub end_ns: Vec<u64>,
    pub slot_uses: Vec<SlotUse>,
    /// From the start until the last task ends.
    pub makespan_ns: u64,
    /// Per step, when the host had its result (the end of `graph.step_end`).
    pub step_end_ns: Vec<u64>,
    /// Busy time of the GPU stream, H2D engine, D2H engine and CPU pool ([`Lane::EXCLUSIVE`] order), per step.
    pub busy_ns: Vec<[u64; 4]>,
    /// Most ring slots held at once.
    pub max_slots_in_use: u32,
    /// Times of every event handled, in order (only when auditing; empty otherwise).
    pub event_times_ns: Vec<u64>,
}

impl StepOutcome {
    /// Which phase the steps belong to.
    #[must_use]
    pub fn phase_kind(&self) -> PhaseKind {
        self.graph.phase_kind
    }

    /// Busy time of each resource summed over all steps.
    #[must_use]
    pub fn total_busy_ns(&self) -> [u64; 4] {
        let mut b = [0u64; 4];
        for s in &self.busy_ns {
            for (x, y) in b.iter_mut().zip(s) {
                *x += y;
            }
        }
        b
    }
}

/// A task on an exclusive lane, whose rate may change while it runs.
#[derive(Debug, Clone, Copy)]
struct Running {
    task: u32,
    segment_start_ns: u64,
    /// Fraction of the work left at `segment_start_ns`.
    remaining: f64,
    /// Whether it runs at its contended rate.
    contended: bool,
    generation: u32,
}

impl Running {
    fn start(task: &Task, t: u32, now: u64, contended: bool) -> (Running, u64) {
        let d = if contended { task.duration_contended_ns } else { task.duration_ns };
        (Running { task: t, segment_start_ns: now, remaining: 1.0, contended, generation: 0 }, now + d)
    }

    /// Carries the task over to its rate with or without contention: its new end where the rate changed.
    fn rerate(&mut self, task: &Task, now: u64, contended: bool) -> Option<u64> {
        let rate = |c: bool| if c { task.duration_contended_ns } else { task.duration_ns };
        let (old, new) = (rate(self.contended), rate(contended));
        self.contended = contended;
        if old == new {
            return None;
        }
        if old > 0 {
            self.remaining -= (now - self.segment_start_ns) as f64 / old as f64;
        }
        self.remaining = self.remaining.clamp(0.0, 1.0);
        self.segment_start_ns = now;
        self.generation += 1;
        Some(now + (self.remaining * new as f64).ceil() as u64)
    }
}

/// The engine's working memory: per-task and per-lane vectors sized by the step graph. A simulation that runs
/// many step graphs keeps one and reuses it (cleared, not reallocated: fresh multi-megabyte vectors per step
/// cost more in page faults than the event loop itself).
#[derive(Debug, Default)]
pub struct Workspace {
    pending: Vec<u32>,
    succ_start: Vec<u32>,
    succ: Vec<u32>,
    fill: Vec<u32>,
    /// FIFO per exclusive lane.
    fifo: [Vec<u32>; 4],
    /// Latency-only tasks ready to start.
    ready_latency: Vec<u32>,
    slot_holder: Vec<Option<(u32, u64)>>,
    item_readers_left: Vec<u32>,
    start_ns: Vec<u64>,
    end_ns: Vec<u64>,
    slot_uses: Vec<SlotUse>,
    busy_ns: Vec<[u64; 4]>,
    event_times_ns: Vec<u64>,
    queue: EventQueue<Event>,
}

impl Workspace {
    /// Per step of the last graph run, when the host had its result.
    pub(crate) fn step_end_ns(&self, g: &StepGraph, step: usize) -> u64 {
        self.end_ns[g.step_end[step] as usize]
    }

    /// Busy time of each resource in one step of the last graph run.
    pub(crate) fn busy_ns(&self, step: usize) -> [u64; 4] {
        self.busy_ns[step]
    }

    /// The outcome of the last run, of `graph`, with the workspace's per-task vectors moved into it.
    pub(crate) fn outcome(&mut self, graph: StepGraph, summary: RunSummary) -> StepOutcome {
        let step_end_ns = (0..graph.step_end.len()).map(|s| self.step_end_ns(&graph, s)).collect();
        StepOutcome {
            start_ns: std::mem::take(&mut self.start_ns),
            end_ns: std::mem::take(&mut self.end_ns),
            slot_uses: std::mem::take(&mut self.slot_uses),
            makespan_ns: summary.makespan_ns,
            step_end_ns,
            busy_ns: std::mem::take(&mut self.busy_ns),
            max_slots_in_use: summary.max_slots_in_use,
            event_times_ns: std::mem::take(&mut self.event_times_ns),
            graph,
        }
    }
}

/// What a run left besides the workspace's vectors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunSummary {
    pub makespan_ns: u64,
    pub max_slots_in_use: u32,
}

struct Engine<'g> {
    g: &'g StepGraph,
    ws: &'g mut Workspace,
    head: [usize; 4],
    /// Copy lanes (H2D, D2H): what runs.
    copying: [Option<Running>; 2],
    /// Compute lanes (GPU, CPU): what runs.
    running: [Option<Running>; 2],
    slots_in_use: u32,
    /// The instant whose dispatch is due (after its last event).
    dispatch_at: Option<u64>,
    max_slots_in_use: u32,
}

impl Engine<'_> {
    /// Handles one event at `now`, pushing follow-ups onto `q`; a completion makes the instant's dispatch due.
    fn handle(&mut self, now: u64, event: Event, q: &mut EventQueue<Event>) {
        match event {
            Event::CopyDone { task, generation } => {
                let lane = usize::from(self.g.tasks[task as usize].lane == Lane::D2h);
                match self.copying[lane] {
                    Some(r) if r.task == task && r.generation == generation => self.copying[lane] = None,
                    // Rescheduled by a rate change: a newer event stands for it.
                    _ => return,
                }
                if !self.copy_in_flight() {
                    self.rerate_computes(now, false, q);
                }
                self.finish(now, task);
            }
            Event::LatencyDone { task } => self.finish(now, task),
            Event::ComputeDone { task, generation } => {
                let lane = usize::from(self.g.tasks[task as usize].lane == Lane::Cpu);
                match self.running[lane] {
                    Some(r) if r.task == task && r.generation == generation => {
                        self.running[lane] = None;
                        if lane == 1 {
                            self.rerate_copies(now, false, q);
                        }
                        self.finish(now, task);
                    }
                    // Rescheduled by a rate change: a newer event stands for it.
                    _ => return,
                }
            }
        }
        self.dispatch_at = Some(now);
    }

    fn finish(&mut self, now: u64, task: u32) {
        self.ws.end_ns[task as usize] = now;
        let (a, b) =
            (self.ws.succ_start[task as usize] as usize, self.ws.succ_start[task as usize + 1] as usize);
        for i in a..b {
            let s = self.ws.succ[i];
            self.ws.pending[s as usize] -= 1;
            if self.ws.pending[s as usize] == 0 && self.g.tasks[s as usize].lane.exclusive_index().is_none() {
                self.ws.ready_latency.push(s);
            }
        }
        let t = &self.g.tasks[task as usize];
        if let (false, Some(item)) = (matches!(t.kind, TaskKind::Stream { .. }), t.item) {
            self.ws.item_readers_left[item as usize] -= 1;
            if self.ws.item_readers_left[item as usize] == 0 {
                let slot = self.g.items[item as usize].slot;
                let (holder, claimed_ns) =
                    self.ws.slot_holder[slot as usize].take().expect("a read item holds its slot");
                debug_assert_eq!(holder, item);
                self.ws.slot_uses.push(SlotUse { slot, item, claimed_ns, released_ns: now });
                self.slots_in_use -= 1;
            }
        }
    }

    /// The item whose slot `task` claims: the first copy of a ring item.
    fn claims(&self, task: u32) -> Option<u32> {
        match (self.g.tasks[task as usize].kind, self.g.tasks[task as usize].item) {
            (TaskKind::Stream { .. }, Some(item)) if self.g.items[item as usize].copy == task => Some(item),
            _ => None,
        }
    }

    /// Whether `task` (an H2D copy) may start: an item's first copy needs its slot free.
    fn slot_free(&self, task: u32) -> bool {
        self.claims(task)
            .is_none_or(|item| self.ws.slot_holder[self.g.items[item as usize].slot as usize].is_none())
    }

    fn claim(&mut self, now: u64, task: u32) {
        if let Some(item) = self.claims(task) {
            self.ws.slot_holder[self.g.items[item as usize].slot as usize] = Some((item, now));
            self.slots_in_use += 1;
            self.max_slots_in_use = self.max_slots_in_use.max(self.slots_in_use);
        }
    }

    fn head_ready(&self, lane: usize) -> Option<u32> {
        let t = *self.ws.fifo[lane].get(self.head[lane])?;
        (self.ws.pending[t as usize] == 0).then_some(t)
    }

    fn dispatch(&mut self, now: u64, q: &mut EventQueue<Event>) {
        // Copies first: one starting changes the rate of computes that start with it.
        for (copy_lane, lane) in [(0usize, 1usize), (1, 2)] {
            if self.copying[copy_lane].is_some() {
                continue;
            }
            let Some(t) = self.head_ready(lane) else { continue };
            if !self.slot_free(t) {
                continue;
            }
            self.head[lane] += 1;
            self.claim(now, t);
            if !self.copy_in_flight() {
                self.rerate_computes(now, true, q);
            }
            let (r, end) = Running::start(&self.g.tasks[t as usize], t, now, self.running[1].is_some());
            self.copying[copy_lane] = Some(r);
            self.ws.start_ns[t as usize] = now;
            q.push(end, Event::CopyDone { task: t, generation: 0 });
        }
        for (compute_lane, lane) in [(0usize, 0usize), (1, 3)] {
            if self.running[compute_lane].is_some() {
                continue;
            }
            let Some(t) = self.head_ready(lane) else { continue };
            self.head[lane] += 1;
            let (r, end) = Running::start(&self.g.tasks[t as usize], t, now, self.copy_in_flight());
            self.running[compute_lane] = Some(r);
            self.ws.start_ns[t as usize] = now;
            q.push(end, Event::ComputeDone { task: t, generation: 0 });
            if compute_lane == 1 {
                self.rerate_copies(now, true, q);
            }
        }
        // A hand-off's reads of host memory queue behind an H2D copy in flight as it starts, for as long as
        // the profile measured beside one (its contended duration); it is not rerated after.
        let h2d_busy = self.copying[0].is_some();
        for i in 0..self.ws.ready_latency.len() {
            let t = self.ws.ready_latency[i];
            self.ws.start_ns[t as usize] = now;
            let task = &self.g.tasks[t as usize];
            let d = if h2d_busy { task.duration_contended_ns } else { task.duration_ns };
            q.push(now + d, Event::LatencyDone { task: t });
        }
        self.ws.ready_latency.clear();
    }

    /// Whether an H2D or D2H copy runs.
    fn copy_in_flight(&self) -> bool {
        self.copying.iter().any(Option::is_some)
    }

    /// Carries running computes over to the rate with (`under_dma`) or without concurrent copies.
    fn rerate_computes(&mut self, now: u64, under_dma: bool, q: &mut EventQueue<Event>) {
        for r in self.running.iter_mut().flatten() {
            if let Some(end) = r.rerate(&self.g.tasks[r.task as usize], now, under_dma) {
                q.push(end, Event::ComputeDone { task: r.task, generation: r.generation });
            }
        }
    }

    /// Carries copies in flight over to the rate with (`cpu_busy`) or without the CPU pool computing.
    fn rerate_copies(&mut self, now: u64, cpu_busy: bool, q: &mut EventQueue<Event>) {
        for r in self.copying.iter_mut().flatten() {
            if let Some(end) = r.rerate(&self.g.tasks[r.task as usize], now, cpu_busy) {
                q.push(end, Event::CopyDone { task: r.task, generation: r.generation });
            }
        }
    }
}

/// Runs a step graph to completion. With `audit`, the time of every event handled is recorded.
#[must_use]
pub fn execute(graph: StepGraph, audit: bool) -> StepOutcome {
    let mut ws = Workspace::default();
    let summary = run(&graph, audit, &mut ws);
    ws.outcome(graph, summary)
}

/// Runs a step graph to completion in `ws` (whatever it held before is cleared): start and end of every
/// task, slot uses, busy time per step and, with `audit`, the time of every event handled stay in `ws`.
pub(crate) fn run(graph: &StepGraph, audit: bool, ws: &mut Workspace) -> RunSummary {
    let n = graph.tasks.len();
    let reset = |v: &mut Vec<u32>, len: usize| {
        v.clear();
        v.resize(len, 0);
    };
    reset(&mut ws.pending, n);
    // Successor lists in one flat vector: `succ_start` first counts, then offsets.
    reset(&mut ws.succ_start, n + 1);
    for t in 0..n as u32 {
        let deps = graph.deps(t);
        ws.pending[t as usize] = deps.len() as u32;
        for &d in deps {
            ws.succ_start[d as usize + 1] += 1;
        }
    }
    for i in 0..n {
        ws.succ_start[i + 1] += ws.succ_start[i];
    }
    ws.fill.clear();
    ws.fill.extend_from_slice(&ws.succ_start[..n]);
    reset(&mut ws.succ, ws.succ_start[n] as usize);
    for t in 0..n as u32 {
        for &d in graph.deps(t) {
            ws.succ[ws.fill[d as usize] as usize] = t;
            ws.fill[d as usize] += 1;
        }
    }
    for f in &mut ws.fifo {
        f.clear();
    }
    ws.ready_latency.clear();
    for (i, t) in graph.tasks.iter().enumerate() {
        match t.lane.exclusive_index() {
            Some(l) => ws.fifo[l].push(i as u32),
            None if ws.pending[i] == 0 => ws.ready_latency.push(i as u32),
            None => {}
        }
    }
    ws.item_readers_left.clear();
    ws.item_readers_left.extend(graph.items.iter().map(|p| p.readers));
    ws.slot_holder.clear();
    ws.slot_holder.resize(graph.pipeline_depth as usize, None);
    for v in [&mut ws.start_ns, &mut ws.end_ns] {
        v.clear();
        v.resize(n, 0);
    }
    ws.slot_uses.clear();
    ws.busy_ns.clear();
    ws.busy_ns.resize(graph.step_end.len(), [0; 4]);
    ws.event_times_ns.clear();
    let mut q = std::mem::take(&mut ws.queue);
    q.clear();
    let mut e = Engine {
        g: graph,
        ws,
        head: [0; 4],
        copying: [None; 2],
        running: [None; 2],
        slots_in_use: 0,
        dispatch_at: Some(0),
        max_slots_in_use: 0,
    };
    let mut now = 0;
    loop {
        // Every event at the due dispatch's instant comes first (the queue holds none earlier).
        let (t, event) = match e.dispatch_at {
            Some(d) if q.peek_time_ns().is_none_or(|t| t > d) => (d, None),
            _ => match q.pop() {
                Some((t, ev)) => (t, Some(ev)),
                None => break,
            },
        };
        now = t;
        if audit {
            e.ws.event_times_ns.push(t);
        }
        if let Some(ev) = event {
            e.handle(t, ev, &mut q);
        } else {
            e.dispatch_at = None;
            e.dispatch(t, &mut q);
        }
    }
    for (lane, h) in e.head.iter().enumerate() {
        assert_eq!(
            *h,
            e.ws.fifo[lane].len(),
            "internal: lane {lane} stalled; the step graph is not topological"
        );
    }
    let max_slots_in_use = e.max_slots_in_use;
    for (i, t) in graph.tasks.iter().enumerate() {
        if let Some(l) = t.lane.exclusive_index() {
            ws.busy_ns[t.step as usize][l] += ws.end_ns[i] - ws.start_ns[i];
        }
    }
    ws.queue = q;
    RunSummary { makespan_ns: now, max_slots_in_use }
}
