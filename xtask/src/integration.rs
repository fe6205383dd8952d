//! `cargo xtask integration` and `cargo xtask compare`: Z-Image-Turbo at real sizes on simulated cards.

use std::sync::Arc;

use anyhow::{Context, bail};
use memory_sim::expect::diff;
use memory_sim::{CardSpec, Expectations, Mode, PipelineProfile, RunOptions, SimRun, simulate};
use offload_core::{format_size, parse_size};
use offload_strategy::{Auto, KeepTogether, Lookahead, OffloadStrategy, Sequential};

/// Arguments of `cargo xtask integration`.
#[derive(clap::Args)]
pub struct Args {
    /// A card: a size ("16GB", "13.5GiB") or a catalogue name ("rtx4090"); repeatable. Default: the four
    /// declared cards, 32GB, 24GB, 16GB and 10GB.
    #[arg(long = "card")]
    pub cards: Vec<String>,
    /// Memory kept free for activations.
    #[arg(long, default_value = "3GB")]
    pub reserve: String,
    /// The offload strategy: auto, sequential, keep-together or lookahead.
    #[arg(long, default_value = "auto")]
    pub strategy: String,
    /// Prompts run back to back.
    #[arg(long, default_value_t = 1)]
    pub prompts: usize,
    /// Denoising steps per prompt.
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// Print each card's offload record.
    #[arg(long)]
    pub print_record: bool,
    /// Hard mode: allocations past the card fail with out-of-memory (default: soft, readings only).
    #[arg(long)]
    pub hard: bool,
}

/// Arguments of `cargo xtask compare`.
#[derive(clap::Args)]
pub struct CompareArgs {
    /// Cards to compare on; repeatable. Default: 10GB, 16GB and 24GB.
    #[arg(long = "card")]
    pub cards: Vec<String>,
    /// Prompts run back to back.
    #[arg(long, default_value_t = 4)]
    pub prompts: usize,
    /// Denoising steps per prompt.
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// Memory kept free for activations.
    #[arg(long, default_value = "3GB")]
    pub reserve: String,
}

/// The strategies the simulation can run, by name.
pub const STRATEGIES: &[&str] = &["auto", "sequential", "keep-together", "lookahead"];

/// Builds a strategy by name. `lookahead` replays the uses captured on a previous run with `auto`.
fn strategy(
    name: &str,
    profile: &PipelineProfile,
    card: &CardSpec,
    options: &RunOptions,
) -> anyhow::Result<Arc<dyn OffloadStrategy>> {
    Ok(match name {
        "auto" => Arc::new(Auto),
        "sequential" => Arc::new(Sequential),
        // The denoiser and the decoder run back to back at the end of every prompt: keep them together.
        "keep-together" => {
            Arc::new(KeepTogether::new([profile.denoise.iter().chain(&profile.decode).cloned().collect::<Vec<_>>()]))
        }
        "lookahead" => {
            let capture = simulate(profile, card.clone(), &RunOptions { strategy: None, ..options.clone() })?;
            Arc::new(Lookahead::new(capture.uses[..capture.completed].to_vec()))
        }
        other => bail!("unknown strategy {other:?}; choose one of: {}", STRATEGIES.join(", ")),
    })
}

fn card_spec(label: &str, hard: bool) -> anyhow::Result<CardSpec> {
    let spec = CardSpec::parse(label)?;
    Ok(if hard { spec.with_mode(Mode::Hard) } else { spec })
}

fn play(
    profile: &PipelineProfile,
    label: &str,
    hard: bool,
    strategy_name: &str,
    options: &RunOptions,
) -> anyhow::Result<SimRun> {
    let card = card_spec(label, hard)?;
    card.check_reserve(options.reserve)?;
    let strategy = strategy(strategy_name, profile, &card, options)?;
    Ok(simulate(profile, card, &RunOptions { strategy: Some(strategy), ..options.clone() })?)
}

/// Runs `cargo xtask integration`.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let reserve = parse_size(&args.reserve).context("--reserve")?;
    if args.steps == 0 || args.prompts == 0 {
        bail!("--steps and --prompts must be at least 1");
    }
    let profile = PipelineProfile::z_image_turbo(args.steps);
    let expectations = Expectations::z_image_turbo();
    let cards: Vec<String> =
        if args.cards.is_empty() { expectations.cards.keys().rev().cloned().collect() } else { args.cards.clone() };
    let declared_reserve = parse_size(&expectations.reserve)?;
    // The declarations hold for the anchor's exact setting only.
    let comparable = reserve == declared_reserve
        && args.steps == expectations.steps
        && args.prompts == 1
        && args.strategy == "auto"
        && !args.hard;
    let options = RunOptions { reserve, prompts: args.prompts, retry_on_oom: true, strategy: None };
    let mut failures = Vec::new();
    let mut checked = 0;
    println!(
        "Z-Image-Turbo at 1024x1024 in bf16 ({} steps, {} prompt(s)), reserve {}, strategy {}, {} mode",
        args.steps,
        args.prompts,
        args.reserve,
        args.strategy,
        if args.hard { "hard" } else { "soft" }
    );
    for label in &cards {
        let run = play(&profile, label, args.hard, &args.strategy, &options)?;
        println!();
        if args.print_record {
            println!("{}\n", run.record);
        }
        println!("{}", run.summary());
        match (expectations.for_card(label), comparable) {
            (Some(declared), true) => {
                checked += 1;
                match diff(declared, &run.observed()) {
                    None => println!("  expectations: met (offload counts, OOM retries, final devices)"),
                    Some(difference) => {
                        println!("  expectations: NOT met\n{difference}");
                        failures.push(label.clone());
                    }
                }
            }
            (Some(_), false) => println!(
                "  expectations: declared for reserve {}, {} steps, 1 prompt, auto, soft mode; not checked here",
                expectations.reserve, expectations.steps
            ),
            (None, _) => println!("  expectations: none declared for this card; reported only"),
        }
    }
    println!();
    if !failures.is_empty() {
        bail!("{} card(s) differ from their declarations: {}", failures.len(), failures.join(", "));
    }
    println!("{checked} card declaration(s) checked, {checked} met");
    Ok(())
}

/// Runs `cargo xtask compare`.
pub fn compare(args: &CompareArgs) -> anyhow::Result<()> {
    let reserve = parse_size(&args.reserve).context("--reserve")?;
    let profile = PipelineProfile::z_image_turbo(args.steps);
    let cards: Vec<String> =
        if args.cards.is_empty() { ["10GB", "16GB", "24GB"].map(String::from).to_vec() } else { args.cards.clone() };
    let options = RunOptions { reserve, prompts: args.prompts, retry_on_oom: true, strategy: None };
    println!(
        "Bytes moved (both ways) for {} prompt(s) of Z-Image-Turbo, {} steps, reserve {}, soft mode",
        args.prompts, args.steps, args.reserve
    );
    println!("The optimum is a lower bound for the run beside it: the fewest bytes any offloader moves when the");
    println!("resident weights, each call's working set and the outputs held fit the card (or, for a soft run that");
    println!("overcommits, the memory the run itself took); the reserve is a strategy's margin, not a rule.");
    println!("{:<8} {:<14} {:>12} {:>12} {:>6} {:>10}  note", "card", "strategy", "moved", "optimum", "ratio", "peak");
    for label in &cards {
        for name in STRATEGIES {
            let run = play(&profile, label, false, name, &options)?;
            let optimum = run.optimum.map(|m| m.total());
            let ratio = optimum
                .filter(|o| *o > 0)
                .map_or_else(|| "-".to_string(), |o| format!("{:.2}", run.moved() as f64 / o as f64));
            let usable = run.card.usable();
            let note = if run.peak > usable { "peak above the card: soft mode only" } else { "" };
            println!(
                "{:<8} {:<14} {:>12} {:>12} {:>6} {:>10}  {note}",
                label,
                name,
                format_size(run.moved()),
                optimum.map_or_else(|| "-".to_string(), format_size),
                ratio,
                format_size(run.peak),
            );
        }
    }
    Ok(())
}
