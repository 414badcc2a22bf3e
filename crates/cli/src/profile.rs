//! `pipeshard profile`: machine profiles.

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;
use pipeshard_core::reference;

#[derive(Debug, Subcommand)]
pub enum ProfileCommand {
    /// Write the derived reference profile of one of the paper's client systems (cli1, cli2, cli3).
    Derive {
        #[arg(long)]
        system: String,
        /// Output file (default: `profiles/SYSTEM.json`).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

pub fn run(cmd: ProfileCommand) -> anyhow::Result<()> {
    match cmd {
        ProfileCommand::Derive { system, out } => {
            let profile = reference::derived(&system).with_context(|| {
                format!(
                    "no derived profile for `{system}`; known systems: {}",
                    reference::systems().join(", ")
                )
            })?;
            let out = out.unwrap_or_else(|| PathBuf::from(format!("profiles/{system}.json")));
            std::fs::write(&out, profile.to_json() + "\n")
                .with_context(|| format!("writing {}", out.display()))?;
            println!("wrote {}", out.display());
            Ok(())
        }
    }
}
