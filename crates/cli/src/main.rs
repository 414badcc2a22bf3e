//! The `pipeshard` binary: the only place that picks implementations, writes files and uses anyhow.

mod models;
mod profile;

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

/// Plan, simulate and run xLM inference on GPUs whose VRAM is too small for the model.
#[derive(Debug, Parser)]
#[command(name = "pipeshard", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Output format of table commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Table,
    Json,
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Models { format } => models::run(format),
        Command::Profile(cmd) => profile::run(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
