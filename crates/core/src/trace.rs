//! Chrome trace events (the JSON Perfetto opens): pid = device or link, tid = stream or thread, times in µs.

use serde::{Deserialize, Serialize};

/// One complete ("X") event or a metadata ("M") event naming a process or thread.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    pub name: String,
    #[serde(skip_serializing_if = "String::is_empty", default)]
    pub cat: String,
    pub ph: String,
    /// Start in microseconds.
    pub ts: f64,
    /// Duration in microseconds (X events).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub dur: Option<f64>,
    pub pid: u32,
    pub tid: u32,
    #[serde(skip_serializing_if = "serde_json::Map::is_empty", default)]
    pub args: serde_json::Map<String, serde_json::Value>,
}

/// A trace: events plus the names of their tracks.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    #[serde(rename = "traceEvents")]
    pub events: Vec<TraceEvent>,
    #[serde(rename = "displayTimeUnit")]
    pub display_time_unit: String,
}

impl Trace {
    #[must_use]
    pub fn new() -> Trace {
        Trace { events: Vec::new(), display_time_unit: "ms".into() }
    }

    /// Names a track (pid, tid) so Perfetto shows it.
    pub fn name_track(&mut self, pid: u32, process: &str, tid: u32, thread: &str) {
        for (name, value, tid) in [("process_name", process, 0), ("thread_name", thread, tid)] {
            let mut args = serde_json::Map::new();
            args.insert("name".into(), value.into());
            self.events.push(TraceEvent {
                name: name.into(),
                cat: String::new(),
                ph: "M".into(),
                ts: 0.0,
                dur: None,
                pid,
                tid,
                args,
            });
        }
    }

    /// Adds a complete event from integer nanoseconds.
    pub fn span(&mut self, pid: u32, tid: u32, name: &str, cat: &str, start_ns: u64, dur_ns: u64) {
        self.events.push(TraceEvent {
            name: name.into(),
            cat: cat.into(),
            ph: "X".into(),
            ts: start_ns as f64 / 1e3,
            dur: Some(dur_ns as f64 / 1e3),
            pid,
            tid,
            args: serde_json::Map::new(),
        });
    }

    #[must_use]
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("traces serialise")
    }
}
