//! The `pipeshard` binary: the only place that picks implementations, writes files and uses anyhow.

mod args;
mod compare;
mod exec;
mod exec_bench;
mod exec_bounds;
mod experiment;
mod interrupt;
mod llama_cpp;
mod models;
mod output;
mod plan;
mod plots;
mod profile;
mod repro;
mod sim;
mod stress;
mod study;
mod sweep;
mod table8;
#[cfg(test)]
mod testfiles;
mod validate;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use output::Format;

/// Plan, simulate and run xLM inference on GPUs whose VRAM is too small for the model.
#[derive(Debug, Parser)]
#[command(name = "pipeshard", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the built-in models: parameters, active parameters per token, bytes, KV bytes per token, layers.
    Models {
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Measure or derive machine profiles.
    #[command(subcommand)]
    Profile(profile::ProfileCommand),
    /// Simulate plans: one workload (`run`) or a grid with CSV, plots and a summary (`sweep`).
    #[command(subcommand)]
    Sim(sim::SimCommand),
    /// Run plans for real on this machine's GPU and CPU: measured TTFT, TPS, E2EL, peak VRAM.
    #[command(subcommand)]
    Exec(exec::ExecCommand),
    /// Compare every planner in the simulator on an experiment's cells; fails if `ilp` falls behind.
    Compare(compare::CompareArgs),
    /// Check the simulator against the executor: plan, predict and run every cell of an experiment on this
    /// machine; CSV, error summary, scatter plot and the worst cells' traces side by side.
    Validate(validate::ValidateArgs),
    /// Reproduce the paper's Table 4 or Figure 2 in the simulator, side by side with the paper; calibrate.
    #[command(subcommand)]
    Repro(repro::ReproCommand),
    /// Plan one workload: per-layer placement per phase, VRAM breakdown, predicted times (`--format json`: the
    /// plan).
    Plan(plan::PlanArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Models { format } => models::run(format),
        Command::Profile(cmd) => profile::run(cmd),
        Command::Sim(cmd) => sim::run(cmd),
        Command::Compare(args) => compare::run(&args),
        Command::Plan(args) => plan::run(&args),
        Command::Exec(cmd) => exec::run(cmd),
        Command::Validate(args) => validate::run(&args),
        Command::Repro(cmd) => repro::run(cmd, &std::env::args().collect::<Vec<_>>().join(" ")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
