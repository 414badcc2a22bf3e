//! Arbitrary bytes through the CLI's experiment reader (`Experiment::from_untrusted`: toml, serde, then the
//! same checks as `Experiment::load`). The CLI is a binary crate, so its two modules are compiled in here.
#![no_main]
#![allow(dead_code)]

#[path = "../../crates/cli/src/args.rs"]
mod args;
#[path = "../../crates/cli/src/experiment.rs"]
mod experiment;

use std::path::Path;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let csv = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../experiments/paper/baseline_ngl_5090.csv"));
    let _ = experiment::Experiment::from_untrusted(data, csv);
});
