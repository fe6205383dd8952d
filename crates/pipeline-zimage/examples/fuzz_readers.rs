//! Fuzzes the checkpoint readers: `model_index.json`, the sharded index, the four component configs and the
//! safetensors header and loader, a million mutated inputs each by default.
//!
//! `cargo xtask fuzz` runs it after its own targets; alone:
//! `cargo run --release -p pipeline-zimage --example fuzz_readers -- --executions 1000000 --seed 24301`.
//! Seeds come from `fuzz/corpus/<target>/`; a crash prints the input and makes the run fail.

#![forbid(unsafe_code)]

#[path = "fuzz_readers/targets.rs"]
mod targets;

use std::path::PathBuf;

use anyhow::bail;
use clap::Parser;
use tests::fuzz::{corpus, fuzz};

/// Fuzz the checkpoint readers of pipeline-zimage.
#[derive(Parser)]
struct Args {
    /// Inputs per target.
    #[arg(long, default_value_t = 1_000_000)]
    executions: u64,
    /// The generator's seed, for reproducing a run.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Only this target; default: all.
    #[arg(long)]
    target: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let corpus_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let all = targets::targets();
    let chosen: Vec<_> = all.iter().filter(|(name, _)| args.target.as_deref().is_none_or(|t| t == *name)).collect();
    if chosen.is_empty() {
        let names: Vec<&str> = all.iter().map(|(name, _)| *name).collect();
        bail!("no reader target named {:?}; the targets are: {}", args.target.unwrap_or_default(), names.join(", "));
    }
    let mut crashed = 0;
    for (name, target) in chosen {
        let seeds = corpus(&corpus_root.join(name));
        if seeds.is_empty() {
            bail!("no seeds for {name} in {}; run from the workspace checkout", corpus_root.join(name).display());
        }
        let report = fuzz(name, &seeds, args.executions, args.seed, target);
        // Each input is read twice: as it is, and as the structured edit of a seed it drives.
        println!("{report}; {} of {} reads accepted", targets::accepted(name), 2 * report.executions);
        for input in &report.crashes {
            // Escaped exactly, so the line pastes into a regression test as a byte string.
            println!("crash in {name}: b\"{}\"", input.escape_ascii());
        }
        crashed += usize::from(!report.crashes.is_empty());
    }
    if crashed > 0 {
        bail!("{crashed} reader target(s) crashed; add each input above as a regression test");
    }
    Ok(())
}
