//! `cargo xtask plan`: the offload plan for Z-Image-Turbo at real sizes on a simulated card and host.
//!
//! Weights, activations and FLOPs come from `memory_sim::PipelineProfile::z_image_turbo`, the block structure
//! from `memory_sim::profile::z_image_turbo` (the one place Z-Image's real-size numbers are written, from
//! `shared/reference/zimage-burn.md` A.2); the link and compute figures from memory-sim's card timing.

use anyhow::{Context, bail};
use memory_sim::profile::z_image_turbo as facts;
use memory_sim::{CardSpec, PipelineProfile};
use offload_core::parse_size;
use offload_core::plan::{
    BlockLayout, ComponentSpec, HostMemory, Machine, Settings, SettingsLayer, TimeModel, plan_pipeline,
};

/// Arguments of `cargo xtask plan`.
#[derive(clap::Args)]
pub struct Args {
    /// The card: a size ("8GB", "13.5GiB") or a catalogue name ("rtx4060"). A CUDA context is taken off.
    #[arg(long, default_value = "8GB")]
    pub card: String,
    /// Installed host RAM ("32GB"), or "host" to read this machine's.
    #[arg(long, default_value = "32GB")]
    pub ram: String,
    /// Host RAM available to the pipeline; default: 90% of --ram (or the OS reading with --ram host).
    #[arg(long)]
    pub ram_available: Option<String>,
    /// The preset; an explicit argument, so it beats OFFLOAD_PRESET and the settings file.
    #[arg(long)]
    pub preset: Option<String>,
    /// Denoising steps per image (transformer calls).
    #[arg(long, default_value_t = 8)]
    pub steps: u32,
    /// Any other setting as key=value (`--set resident_budget=4GiB`); repeatable. OFFLOAD_* variables and the
    /// file named by OFFLOAD_CONFIG apply below these.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Instead of the real-size plan: every preset's predicted device peak, bytes moved and moves beside the
    /// measured ones on the tiny checkpoint (runs `pipeline-zimage`'s `validate` example with cargo), on the
    /// simulated card or, with `--device wgpu`, on the wgpu device.
    #[arg(long)]
    pub validate: bool,
    /// With `--validate`: `cpu` (a hard simulated card) or `wgpu` (builds `pipeline-zimage` with `wgpu`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// `plan --validate`: the tiny pipeline's predicted beside measured figures, from burn's side of the workspace.
fn validate(args: &Args) -> anyhow::Result<()> {
    let mut command = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command.args(["run", "--quiet", "-p", "pipeline-zimage"]);
    match args.device.as_str() {
        "cpu" => {}
        "wgpu" => {
            command.args(["--features", "wgpu"]);
        }
        other => bail!("--device {other:?} is not a validation target; pass cpu (a simulated card) or wgpu"),
    }
    command.args(["--example", "validate", "--", "--device", &args.device]);
    crate::tasks::status(command, "the validate example of pipeline-zimage")
}

fn layout(
    name: &str,
    total: u64,
    blocks: Vec<u64>,
    largest_leaf: u64,
    leaf_count: usize,
    first_leaf: u64,
) -> anyhow::Result<BlockLayout> {
    let in_blocks: u64 = blocks.iter().sum();
    let outside = total.checked_sub(in_blocks).with_context(|| {
        format!("{name}: the blocks ({in_blocks} bytes) exceed memory-sim's weights ({total} bytes)")
    })?;
    Ok(BlockLayout {
        block_bytes: blocks,
        outside_bytes: outside,
        largest_leaf_bytes: largest_leaf,
        leaf_count,
        first_leaf_bytes: first_leaf,
    })
}

/// Z-Image-Turbo's components as plan input: memory-sim's sizes, activations and FLOPs, and the block structure.
pub fn z_image_turbo(steps: u32) -> anyhow::Result<Vec<ComponentSpec>> {
    let profile = PipelineProfile::z_image_turbo(steps as usize);
    let mut specs = Vec::new();
    for component in &profile.components {
        let activation = component.activations.working + component.activations.left_behind;
        let calls = if profile.denoise.contains(&component.name) { steps } else { 1 };
        let spec = ComponentSpec::new(&component.name, component.bytes)
            .with_activation(activation)
            .with_cost(component.flops, calls);
        let spec = match component.name.as_str() {
            "text_encoder" => spec.with_layout(layout(
                &component.name,
                component.bytes,
                facts::text_layers(),
                facts::TEXT_GATE_PROJ_BYTES,
                facts::TEXT_LEAVES,
                facts::TEXT_FIRST_LEAF_BYTES,
            )?),
            "transformer" => spec.with_layout(layout(
                &component.name,
                component.bytes,
                facts::transformer_blocks(),
                facts::TRANSFORMER_W1_BYTES,
                facts::TRANSFORMER_LEAVES,
                facts::TRANSFORMER_FIRST_LEAF_BYTES,
            )?),
            _ => spec,
        };
        specs.push(spec);
    }
    Ok(specs)
}

/// Prints the plan.
pub fn run(args: &Args) -> anyhow::Result<()> {
    if args.validate {
        return validate(args);
    }
    let card = CardSpec::parse(&args.card)?;
    let host = if args.ram.trim().eq_ignore_ascii_case("host") {
        HostMemory::read()?
    } else {
        let total = parse_size(&args.ram).context("--ram")?;
        HostMemory::new(total, total / 10 * 9)
    };
    let host = match &args.ram_available {
        Some(available) => host.with_available(parse_size(available).context("--ram-available")?),
        None => host,
    };
    if args.steps == 0 {
        bail!("--steps is 0; give at least 1 denoising step");
    }
    let timing = card.timing;
    let time = TimeModel::new(timing.link_bytes_per_second, timing.link_latency.as_secs_f64(), timing.flops_per_second);
    let machine = Machine::new(card.capacity, card.usable(), host).with_time(time);

    let mut explicit = SettingsLayer::default();
    if let Some(preset) = &args.preset {
        explicit.set("preset", preset)?;
    }
    for pair in &args.set {
        let Some((key, value)) = pair.split_once('=') else {
            bail!("--set {pair:?} is not key=value; write it as --set resident_budget=4GiB");
        };
        explicit.set(key.trim(), value.trim())?;
    }
    let settings = Settings::from_process(&explicit)?;

    println!(
        "Z-Image-Turbo, {} steps, card {} ({} link, {:.0} µs, {:.1} TFLOP/s; pageable copies at {:.0}% of the link)",
        args.steps,
        card.label,
        format_rate(timing.link_bytes_per_second),
        timing.link_latency.as_secs_f64() * 1e6,
        timing.flops_per_second / 1e12,
        time.pageable_fraction * 100.0
    );
    print!("{}", plan_pipeline(&z_image_turbo(args.steps)?, settings, &machine)?);
    Ok(())
}

fn format_rate(bytes_per_second: f64) -> String {
    format!("{:.2} GB/s", bytes_per_second / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_structure_adds_up_to_memory_sims_weights() -> anyhow::Result<()> {
        let specs = z_image_turbo(8)?;
        for spec in &specs {
            spec.validate()?;
        }
        let outside =
            |name: &str| specs.iter().find(|s| s.name == name).and_then(|s| s.layout.as_ref()).map(|l| l.outside_bytes);
        // 22.6 MiB outside the transformer's blocks; the text encoder's embedding and final norm outside its layers.
        assert_eq!(outside("transformer"), Some(23_704_704));
        // The text encoder's token embedding and its final norm are outside its layers.
        assert_eq!(outside("text_encoder"), Some(151_936 * 2560 * 2 + 2560 * 2));
        assert_eq!(specs.iter().find(|s| s.name == "transformer").map(|s| s.calls_per_image), Some(8));
        Ok(())
    }
}
