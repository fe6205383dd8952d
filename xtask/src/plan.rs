//! `cargo xtask plan`: the offload plan for Z-Image-Turbo at real sizes on a simulated card and host.
//!
//! Weights, activations and FLOPs come from `memory_sim::PipelineProfile::z_image_turbo`, the block structure
//! from `memory_sim::profile::z_image_turbo` (the one place Z-Image's real-size numbers are written, from
//! `shared/reference/zimage-burn.md` A.2); the link and compute figures from memory-sim's card timing. The
//! components are file-backed: the real checkpoint is a file of the bf16 weights they upload, so the planner may
//! read a host copy from it when RAM cannot hold it.

use anyhow::{Context, bail};
use memory_sim::profile::z_image_turbo as facts;
use memory_sim::{CardSpec, DonorMachine, Mode, PeerCard, PipelineProfile, SimCard, run_step};
use offload_core::plan::{
    BlockLayout, ComponentSpec, HostMemory, HostTier, Machine, Plan, Settings, SettingsLayer, StreamedGroup, TimeModel,
    plan_pipeline,
};
use offload_core::{format_rate, format_size, parse_size};

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
    /// A second card that can hold the transformer's streamed groups, as CARD@LINK (`24GB@nvlink`,
    /// `rtx3090@pcie3x8`; links: nvlink, pcie4x16, pcie3x8); repeatable, named cuda:1, cuda:2, … With at least
    /// one, the plan is followed by where each streamed group lives (these cards, pinned or pageable RAM, the
    /// checkpoint file), placed by cost, and the step simulated on the cards.
    #[arg(long = "donor", value_name = "CARD@LINK")]
    pub donors: Vec<String>,
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
    leaves: Vec<u64>,
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
        leaf_count: leaves.len(),
        first_leaf_bytes: first_leaf,
        leaf_bytes: leaves,
    })
}

/// Z-Image-Turbo's components as plan input: memory-sim's sizes, activations and FLOPs, the block structure, and
/// file-backed (the checkpoint's files hold the weights as they are uploaded).
pub fn z_image_turbo(steps: u32) -> anyhow::Result<Vec<ComponentSpec>> {
    let profile = PipelineProfile::z_image_turbo(steps as usize);
    let mut specs = Vec::new();
    for component in &profile.components {
        let activation = component.activations.working + component.activations.left_behind;
        let calls = if profile.denoise.contains(&component.name) { steps } else { 1 };
        let spec = ComponentSpec::new(&component.name, component.bytes)
            .with_activation(activation)
            .with_cost(component.flops, calls)
            .with_file_backed(true);
        let spec = match component.name.as_str() {
            "text_encoder" => spec.with_layout(layout(
                &component.name,
                component.bytes,
                facts::text_layers(),
                facts::TEXT_GATE_PROJ_BYTES,
                facts::text_leaves(),
                facts::TEXT_FIRST_LEAF_BYTES,
            )?),
            "transformer" => spec.with_layout(layout(
                &component.name,
                component.bytes,
                facts::transformer_blocks(),
                facts::TRANSFORMER_W1_BYTES,
                facts::transformer_leaves(),
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
    print!("{}", render(args, &Settings::from_process(&explicit(args)?)?)?);
    Ok(())
}

/// The explicit settings layer of the arguments: `--preset` and every `--set`.
fn explicit(args: &Args) -> anyhow::Result<SettingsLayer> {
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
    Ok(explicit)
}

/// The plan's text for the arguments under resolved `settings`: the machine line, then the plan.
fn render(args: &Args, settings: &Settings) -> anyhow::Result<String> {
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
    let peers: Vec<PeerCard> = (args.donors.iter().enumerate())
        .map(|(index, label)| PeerCard::parse(&format!("cuda:{}", index + 1), label))
        .collect::<Result<_, _>>()?;
    let machine = (peers.iter())
        .fold(Machine::new(card.capacity, card.usable(), host).with_time(time), |machine, peer| {
            machine.with_peer(peer.peer_device())
        });

    let mut out = format!(
        "Z-Image-Turbo, {} steps, card {} ({} link, {:.0} µs, {:.1} TFLOP/s; pageable copies at {:.0}% of the link)\n",
        args.steps,
        card.label,
        format_rate(timing.link_bytes_per_second),
        timing.link_latency.as_secs_f64() * 1e6,
        timing.flops_per_second / 1e12,
        time.pageable_fraction * 100.0
    );
    let specs = z_image_turbo(args.steps)?;
    let plan = plan_pipeline(&specs, settings.clone(), &machine)?;
    out.push_str(&plan.to_string());
    if !args.donors.is_empty() {
        out.push_str(&donors(args, &card, &peers, &plan)?);
    }
    Ok(out)
}

/// With `--donor`: the transformer's streamed groups placed over the second cards, the host RAM the plan leaves
/// and the checkpoint file, by cost, with the step run on the simulated cards beside the prediction.
fn donors(args: &Args, card: &CardSpec, peers: &[PeerCard], plan: &Plan) -> anyhow::Result<String> {
    let profile = PipelineProfile::z_image_turbo(args.steps as usize);
    let transformer = profile.components.iter().find(|c| c.name == "transformer").context("the transformer")?;
    let routed = plan.component("transformer").context("the transformer's plan")?;
    // Group offload keeps groups resident in the order the model declares them while they fit the resident budget.
    let blocks = facts::transformer_blocks();
    let outside = transformer.bytes - blocks.iter().sum::<u64>();
    let mut room = routed.resident_weight_bytes.saturating_sub(outside);
    let mut groups = Vec::new();
    for (index, bytes) in blocks.into_iter().enumerate() {
        if groups.is_empty() && bytes <= room {
            room -= bytes;
        } else {
            groups.push(StreamedGroup::new(&format!("block.{index}"), bytes));
        }
    }
    // The host's sources the plan gave the transformer: its copy in RAM (or the reads kept there under a split),
    // of which its pinned bytes, and its file.
    let host_bytes = if routed.host_tier == HostTier::Ram { routed.host_bytes } else { routed.ram_streamed_bytes };
    let pinned_bytes = routed.pinned_bytes;
    let exec = card.clone().with_mode(Mode::Hard).with_pageable_fraction(plan.machine.time.pageable_fraction)?;
    let machine = DonorMachine {
        exec: SimCard::new(exec),
        peers: peers.to_vec(),
        host_bytes,
        pinned_bytes,
        file_bytes_per_second: Some(plan.machine.time.disk_bytes_per_second),
    };
    let streamed: u64 = groups.iter().map(|g| g.bytes).sum();
    let mut out = format!(
        "\ndonors for the transformer's {} streamed groups ({} per step; {} of RAM the plan gives its copies, {} of \
         it pinned):\n",
        groups.len(),
        format_size(streamed),
        format_size(host_bytes),
        format_size(pinned_bytes)
    );
    for peer in &machine.peers {
        out.push_str(&format!("  {}: {} over {}\n", peer.name, peer.card.spec().label, peer.link.description));
    }
    let problem = machine.problem(groups, transformer.flops);
    let placement = problem.place()?;
    out.push_str(&problem.explain(&placement));
    let step = run_step(&machine, &problem, &placement, transformer.flops)?;
    for (index, peer) in machine.peers.iter().enumerate() {
        out.push_str(&format!(
            "{}: this placement holds {} of the transformer's groups there, the pipeline's plan {}\n",
            peer.name,
            format_size(placement.bytes_from(&problem, index)),
            format_size(routed.peer_bytes(&peer.name))
        ));
    }
    out.push_str(&format!(
        "simulated on the cards: {:.3} s per step ({:.3} s copies, {:.3} s compute), {:+.2}% from the prediction\n",
        step.seconds,
        step.copy_seconds,
        step.compute_seconds,
        (step.seconds / placement.step_seconds - 1.0) * 100.0
    ));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    use expect_test::{Expect, expect};

    /// `cargo xtask plan` with these arguments, settings from the arguments alone (no environment, no file).
    fn plan(arguments: &[&str]) -> anyhow::Result<String> {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Command {
            #[command(flatten)]
            args: Args,
        }
        let args = Command::try_parse_from(std::iter::once("plan").chain(arguments.iter().copied()))?.args;
        let settings = Settings::resolve(&explicit(&args)?, std::iter::empty::<(String, String)>(), None)?;
        render(&args, &settings)
    }

    /// The plan's text as the snapshot says, and as docs/presets.md shows it under its command.
    fn check(arguments: &[&str], expect: Expect) -> anyhow::Result<()> {
        check_in("presets.md", arguments, expect)
    }

    /// The plan's text as the snapshot says, and as `docs/{page}` shows it under its command.
    fn check_in(page: &str, arguments: &[&str], expect: Expect) -> anyhow::Result<()> {
        let text = plan(arguments)?;
        expect.assert_eq(&text);
        let docs = std::fs::read_to_string(format!("{}/../docs/{page}", env!("CARGO_MANIFEST_DIR")))?;
        let command = format!("`cargo xtask plan {}`", arguments.join(" "));
        assert!(docs.contains(&command), "docs/{page} must show {command}");
        assert!(docs.contains(&text), "docs/{page} must show the output of {command} as it is:\n{text}");
        Ok(())
    }

    /// 16 GB of RAM and a 4 GB card over NVLink: the copies do not fit, and the card joins the split of the
    /// streamed groups over RAM and the files: the transformer's groups it holds need no RAM, which keeps the text
    /// encoder's leaves instead, and the plan is faster than without the card.
    #[test]
    fn a_second_card_joins_the_split_when_the_host_copies_do_not_fit() -> anyhow::Result<()> {
        let with = ["--card", "8GB", "--ram", "16GB", "--preset", "auto", "--donor", "4GB@nvlink"];
        check_in(
            "donors.md",
            &with,
            expect![[r#"
                Z-Image-Turbo, 8 steps, card 8GB (31.50 GB/s link, 10 µs, 100.0 TFLOP/s; pageable copies at 50% of the link)
                plan for preset auto: device 6.84 GB available of 7.45 GB; host 13.41 GB available of 14.90 GB (11.41 GB usable)
                link: 31.50 GB/s from pinned memory, 15.75 GB/s pageable (given)
                disk: 2.00 GB/s read (assumed, not measured: a run that reads from the files measures it)
                component     route                 host              resident  pinned  streamed/step  time/step     peak
                text_encoder  leaf, prefetch        file+ram+cuda:1  741.88 MB     0 B        7.49 GB    0.899 s  1.25 GB
                transformer   block x1, prefetch 1  file+ram+cuda:1    5.40 GB     0 B        6.74 GB    0.965 s  6.58 GB
                vae           component offload     ram              159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
                per image (8 steps): 8.72 s predicted, peak 6.58 GB of 6.84 GB available; host copies: 9.87 GB in RAM of 11.41 GB usable, 0 B pinned, 18.96 GB in checkpoint files
                why:
                  text_encoder: 7.49 GB of weights do not fit whole in the 6.16 GB left after 696.32 MB for activations (estimate 440.32 MB + margin 256.00 MB, sized from the workload rather than DDO's fixed headroom tiers), so it streams its blocks leaf by leaf with prefetch: at most 95.00 MB of leaves on the device beside the 741.88 MB outside the blocks, which stay resident; 7.49 GB stream in its one call; its host copy is the checkpoint file: the host copies (19.11 GB) do not fit in the 11.41 GB of usable RAM, and reading text_encoder and transformer from disk is the way to fit that costs the least predicted time (+10.18 s per image, against +27.67 s for transformer); 249 of its 324 streamed groups (6.68 GB) keep their host copy in RAM after their first read: the 11.25 GB of RAM the other copies leave is placed over the streamed groups by cost, RAM at 0.063 s per GB against 0.563 s per GB from disk, each group counted once per copy (1 an image), which saves 7.04 s per image in all (text_encoder and transformer) over leaving that RAM to the page cache; its one call reads 741.88 MB from the file at 2.00 GB/s (assumed); predicted 0.899 s per call (copies 0.899 s, compute 0.043 s); nothing pinned: its host copy is the checkpoint file, whose pages are read, not pinned; chosen at 0.51 s per image before its host tier and pinning, over component does not fit (needs 8.17 GB), block 0.51 s per image; 75 of its 324 streamed groups (87.87 MB) live on cuda:1 between their uploads, copied at 0.020 s per GB against 0.063 s per GB from RAM, 0.563 s per GB from disk, placed by cost with each group counted once per copy (1 an image)
                  transformer: 11.46 GB of weights do not fit whole in the 6.08 GB left after 778.24 MB for activations (estimate 522.24 MB + margin 256.00 MB, sized from the workload rather than DDO's fixed headroom tiers), so it streams 1 block per group with prefetch depth 1; 16 of 34 groups (5.38 GB) stay resident beside the 22.61 MB outside the blocks; 11.46 GB stream on the first step, 6.07 GB on each later one; its host copy is the checkpoint file: the host copies (19.11 GB) do not fit in the 11.41 GB of usable RAM, and reading text_encoder and transformer from disk is the way to fit that costs the least predicted time (+10.18 s per image, against +27.67 s for transformer); 9 of its 18 streamed groups (3.03 GB) keep their host copy in RAM after their first read: the 11.25 GB of RAM the other copies leave is placed over the streamed groups by cost, RAM at 0.063 s per GB against 0.563 s per GB from disk, each group counted once per copy (8 an image), which saves 7.04 s per image in all (text_encoder and transformer) over leaving that RAM to the page cache; the first step reads 5.40 GB from the file at 2.00 GB/s (assumed), the rest of its 11.46 GB from RAM and cuda:1, each later step its 6.07 GB from RAM and cuda:1 (6.07 GB kept there); predicted 0.965 s per step (copies 0.272 s, compute 0.597 s); nothing pinned: its host copy is the checkpoint file, whose pages are read, not pinned; chosen at 4.96 s per image before its host tier and pinning, over component does not fit (needs 12.22 GB), leaf 6.27 s per image; 9 of its 18 streamed groups (3.03 GB) live on cuda:1 between their uploads, copied at 0.020 s per GB against 0.063 s per GB from RAM, 0.563 s per GB from disk, placed by cost with each group counted once per copy (8 an image)
                  vae: 159.87 MB of weights fit whole in the 3.92 GB left after 2.92 GB for activations (estimate 2.34 GB + margin 597.98 MB, sized from the workload rather than DDO's fixed headroom tiers), so it moves whole onto the device when it runs (159.87 MB per image); its host copy stays in RAM (159.87 MB): with text_encoder and transformer read from disk, the copies kept in RAM (159.87 MB) fit in the 11.41 GB of usable RAM; predicted 0.099 s per call (copies 0.011 s, compute 0.088 s); nothing pinned: it crosses the link once per image

                donors for the transformer's 18 streamed groups (6.07 GB per step; 3.03 GB of RAM the plan gives its copies, 0 B of it pinned):
                  cuda:1: 4GB over NVLink between two RTX 3090s: 0.02 s/it per GB streamed (DisTorch), 50 GB/s
                donor   kind             link        budget     groups       bytes/step  copies/step
                cuda:1  card             50.00 GB/s  3.12 GB    block.16-24  3.03 GB     0.065 s
                pinned  pinned RAM       31.50 GB/s  0 B        -            0 B         0.000 s
                ram     pageable RAM     15.75 GB/s  3.03 GB    block.25-33  3.03 GB     0.207 s
                file    checkpoint file  2.00 GB/s   unbounded  -            0 B         0.000 s
                step: 0.869 s predicted (0.597 s compute + 0.272 s copies); lower bound 0.865 s; placement exact: branch and bound, 190 nodes
                why:
                  cuda:1: 0.020 s per GB streamed (card, given); the cheapest donor, filled to 3.03 GB of 3.12 GB
                  pinned: 0.032 s per GB streamed (pinned RAM, given); holds nothing: the cheaper donors hold every group
                  ram: 0.063 s per GB streamed (pageable RAM, given); #3 by cost, filled to 3.03 GB of 3.03 GB
                  file: 0.500 s per GB streamed (checkpoint file, given); holds nothing: the cheaper donors hold every group
                cuda:1: this placement holds 3.03 GB of the transformer's groups there, the pipeline's plan 3.03 GB
                simulated on the cards: 0.869 s per step (0.272 s copies, 0.597 s compute), +0.00% from the prediction
            "#]],
        )?;
        let seconds = |text: &str| -> anyhow::Result<f64> {
            let line = text.lines().find(|l| l.starts_with("per image")).context("the per-image line")?;
            let figure = line.split(": ").nth(1).and_then(|rest| rest.split(" s predicted").next());
            Ok(figure.context("the predicted seconds")?.parse()?)
        };
        let alone = plan(&with[..6])?;
        assert!(seconds(&plan(&with)?)? < seconds(&alone)?, "{alone}");
        Ok(())
    }

    /// A second card over NVLink too small for the streamed groups, another over PCIe 3.0 x8, and 32 GB of RAM:
    /// NVLink fills first, pinned RAM takes the rest, and the PCIe 3.0 card (3.1 GB/s) holds nothing while RAM
    /// has room. The step simulated on the cards matches the prediction.
    #[test]
    fn donors_are_filled_cheapest_first_and_a_slow_second_card_comes_after_ram() -> anyhow::Result<()> {
        check_in(
            "donors.md",
            &["--card", "8GB", "--ram", "32GB", "--preset", "auto", "--donor", "4GB@nvlink", "--donor", "24GB@pcie3x8"],
            expect![[r#"
                Z-Image-Turbo, 8 steps, card 8GB (31.50 GB/s link, 10 µs, 100.0 TFLOP/s; pageable copies at 50% of the link)
                plan for preset auto: device 6.84 GB available of 7.45 GB; host 26.82 GB available of 29.80 GB (23.10 GB usable)
                link: 31.50 GB/s from pinned memory, 15.75 GB/s pageable (given)
                component     route                 host         resident  pinned  streamed/step  time/step     peak
                text_encoder  leaf, prefetch        ram+cuda:1  741.88 MB     0 B        7.49 GB    0.510 s  1.25 GB
                transformer   block x1, prefetch 1  ram+cuda:1    5.40 GB     0 B        6.74 GB    0.603 s  6.58 GB
                vae           component offload     ram         159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
                per image (8 steps): 5.43 s predicted, peak 6.58 GB of 6.84 GB available; host copies: 19.11 GB in RAM of 23.10 GB usable, 0 B pinned
                why:
                  text_encoder: 7.49 GB of weights do not fit whole in the 6.16 GB left after 696.32 MB for activations (estimate 440.32 MB + margin 256.00 MB, sized from the workload rather than DDO's fixed headroom tiers), so it streams its blocks leaf by leaf with prefetch: at most 95.00 MB of leaves on the device beside the 741.88 MB outside the blocks, which stay resident; 7.49 GB stream in its one call; its host copy stays in RAM (7.49 GB): the host copies (19.11 GB) fit in the 23.10 GB of usable RAM; predicted 0.510 s per call (copies 0.510 s, compute 0.043 s); nothing pinned: it crosses the link once per image; chosen at 0.51 s per image before pinning, over component does not fit (needs 8.17 GB), block 0.51 s per image; 75 of its 324 streamed groups (87.87 MB) live on cuda:1 between their uploads, copied at 0.020 s per GB against 0.063 s per GB from pageable RAM, placed by cost with each group counted once per copy (1 an image), which saves 0.004 s per image
                  transformer: 11.46 GB of weights do not fit whole in the 6.08 GB left after 778.24 MB for activations (estimate 522.24 MB + margin 256.00 MB, sized from the workload rather than DDO's fixed headroom tiers), so it streams 1 block per group with prefetch depth 1; 16 of 34 groups (5.38 GB) stay resident beside the 22.61 MB outside the blocks; 11.46 GB stream on the first step, 6.07 GB on each later one; its host copy stays in RAM (11.46 GB): the host copies (19.11 GB) fit in the 23.10 GB of usable RAM; predicted 0.603 s per step (copies 0.272 s, compute 0.597 s); nothing pinned: pinning would save 0.18 s of 4.96 s per image, under 5%, as pageable copies (0.414 s a step) mostly hide under compute (0.597 s); chosen at 4.96 s per image before pinning, over component does not fit (needs 12.22 GB), leaf 6.27 s per image; 9 of its 18 streamed groups (3.03 GB) live on cuda:1 between their uploads, copied at 0.020 s per GB against 0.063 s per GB from pageable RAM, placed by cost with each group counted once per copy (8 an image), which saves 0.142 s per image
                  vae: 159.87 MB of weights fit whole in the 3.92 GB left after 2.92 GB for activations (estimate 2.34 GB + margin 597.98 MB, sized from the workload rather than DDO's fixed headroom tiers), so it moves whole onto the device when it runs (159.87 MB per image); its host copy stays in RAM (159.87 MB): the host copies (19.11 GB) fit in the 23.10 GB of usable RAM; predicted 0.099 s per call (copies 0.011 s, compute 0.088 s); nothing pinned: it crosses the link once per image

                donors for the transformer's 18 streamed groups (6.07 GB per step; 11.46 GB of RAM the plan gives its copies, 0 B of it pinned):
                  cuda:1: 4GB over NVLink between two RTX 3090s: 0.02 s/it per GB streamed (DisTorch), 50 GB/s
                  cuda:2: 24GB over a second RTX 3090 on PCIe 3.0 x8: 0.32 s/it per GB streamed (DisTorch), 3.1 GB/s
                donor   kind             link        budget     groups       bytes/step  copies/step
                cuda:1  card             50.00 GB/s  3.12 GB    block.16-24  3.03 GB     0.065 s
                cuda:2  card             3.12 GB/s   21.75 GB   -            0 B         0.000 s
                pinned  pinned RAM       31.50 GB/s  0 B        -            0 B         0.000 s
                ram     pageable RAM     15.75 GB/s  11.46 GB   block.25-33  3.03 GB     0.207 s
                file    checkpoint file  2.00 GB/s   unbounded  -            0 B         0.000 s
                step: 0.869 s predicted (0.597 s compute + 0.272 s copies); lower bound 0.865 s; placement exact: branch and bound, 280 nodes
                why:
                  cuda:1: 0.020 s per GB streamed (card, given); the cheapest donor, filled to 3.03 GB of 3.12 GB
                  pinned: 0.032 s per GB streamed (pinned RAM, given); holds nothing: the cheaper donors hold every group
                  ram: 0.063 s per GB streamed (pageable RAM, given); #3 by cost, filled to 3.03 GB of 11.46 GB
                  cuda:2: 0.320 s per GB streamed (card, given); holds nothing: the cheaper donors hold every group
                  file: 0.500 s per GB streamed (checkpoint file, given); holds nothing: the cheaper donors hold every group
                cuda:1: this placement holds 3.03 GB of the transformer's groups there, the pipeline's plan 3.03 GB
                cuda:2: this placement holds 0 B of the transformer's groups there, the pipeline's plan 0 B
                simulated on the cards: 0.869 s per step (0.272 s copies, 0.597 s compute), +0.00% from the prediction
            "#]],
        )
    }

    /// 16 GB of RAM holds 11.41 GB of host copies, not Z-Image-Turbo's 19.11 GB: the plan reads the text encoder
    /// and the transformer from their files instead of warning that the OS will swap.
    #[test]
    fn sixteen_gigabytes_of_ram_plan_a_run_from_the_checkpoint_files() -> anyhow::Result<()> {
        check(
            &["--card", "8GB", "--ram", "16GB", "--preset", "auto"],
            expect![[r#"
                Z-Image-Turbo, 8 steps, card 8GB (31.50 GB/s link, 10 µs, 100.0 TFLOP/s; pageable copies at 50% of the link)
                plan for preset auto: device 6.84 GB available of 7.45 GB; host 13.41 GB available of 14.90 GB (11.41 GB usable)
                link: 31.50 GB/s from pinned memory, 15.75 GB/s pageable (given)
                disk: 2.00 GB/s read (assumed, not measured: a run that reads from the files measures it)
                component     route                 host       resident  pinned  streamed/step  time/step     peak
                text_encoder  leaf, prefetch        file+ram  741.88 MB     0 B        7.49 GB    1.751 s  1.25 GB
                transformer   block x1, prefetch 1  file+ram    5.40 GB     0 B        6.74 GB    0.983 s  6.58 GB
                vae           component offload     ram       159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
                per image (8 steps): 9.71 s predicted, peak 6.58 GB of 6.84 GB available; host copies: 11.41 GB in RAM of 11.41 GB usable, 0 B pinned, 18.96 GB in checkpoint files
                why:
                  text_encoder: 7.49 GB of weights do not fit whole in the 6.16 GB left after 696.32 MB for activations (estimate 440.32 MB + margin 256.00 MB, sized from the workload rather than DDO's fixed headroom tiers), so it streams its blocks leaf by leaf with prefetch: at most 95.00 MB of leaves on the device beside the 741.88 MB outside the blocks, which stay resident; 7.49 GB stream in its one call; its host copy is the checkpoint file: the host copies (19.11 GB) do not fit in the 11.41 GB of usable RAM, and reading text_encoder and transformer from disk is the way to fit that costs the least predicted time (+10.18 s per image, against +27.67 s for transformer); 192 of its 324 streamed groups (5.19 GB) keep their host copy in RAM after their first read: the 11.25 GB of RAM the other copies leave is placed over the streamed groups by cost, RAM at 0.063 s per GB against 0.563 s per GB from disk, each group counted once per copy (1 an image), which saves 6.04 s per image in all (text_encoder and transformer) over leaving that RAM to the page cache; its one call reads 2.30 GB from the file at 2.00 GB/s (assumed); predicted 1.751 s per call (copies 1.751 s, compute 0.043 s); nothing pinned: its host copy is the checkpoint file, whose pages are read, not pinned; chosen at 0.51 s per image before its host tier and pinning, over component does not fit (needs 8.17 GB), block 0.51 s per image
                  transformer: 11.46 GB of weights do not fit whole in the 6.08 GB left after 778.24 MB for activations (estimate 522.24 MB + margin 256.00 MB, sized from the workload rather than DDO's fixed headroom tiers), so it streams 1 block per group with prefetch depth 1; 16 of 34 groups (5.38 GB) stay resident beside the 22.61 MB outside the blocks; 11.46 GB stream on the first step, 6.07 GB on each later one; its host copy is the checkpoint file: the host copies (19.11 GB) do not fit in the 11.41 GB of usable RAM, and reading text_encoder and transformer from disk is the way to fit that costs the least predicted time (+10.18 s per image, against +27.67 s for transformer); 18 of its 18 streamed groups (6.07 GB) keep their host copy in RAM after their first read: the 11.25 GB of RAM the other copies leave is placed over the streamed groups by cost, RAM at 0.063 s per GB against 0.563 s per GB from disk, each group counted once per copy (8 an image), which saves 6.04 s per image in all (text_encoder and transformer) over leaving that RAM to the page cache; the first step reads 5.40 GB from the file at 2.00 GB/s (assumed), the rest of its 11.46 GB from RAM, each later step its 6.07 GB from RAM (6.07 GB kept there); predicted 0.983 s per step (copies 0.414 s, compute 0.597 s); nothing pinned: its host copy is the checkpoint file, whose pages are read, not pinned; chosen at 4.96 s per image before its host tier and pinning, over component does not fit (needs 12.22 GB), leaf 6.27 s per image
                  vae: 159.87 MB of weights fit whole in the 3.92 GB left after 2.92 GB for activations (estimate 2.34 GB + margin 597.98 MB, sized from the workload rather than DDO's fixed headroom tiers), so it moves whole onto the device when it runs (159.87 MB per image); its host copy stays in RAM (159.87 MB): with text_encoder and transformer read from disk, the copies kept in RAM (159.87 MB) fit in the 11.41 GB of usable RAM; predicted 0.099 s per call (copies 0.011 s, compute 0.088 s); nothing pinned: it crosses the link once per image
            "#]],
        )
    }

    /// low_ram_safe on 4 GB of RAM (1.35 GB usable) reads every copy from its file.
    #[test]
    fn low_ram_safe_plans_a_run_on_four_gigabytes_of_ram() -> anyhow::Result<()> {
        check(
            &["--card", "8GB", "--ram", "4GB", "--preset", "low_ram_safe"],
            expect![[r#"
            Z-Image-Turbo, 8 steps, card 8GB (31.50 GB/s link, 10 µs, 100.0 TFLOP/s; pageable copies at 50% of the link)
            plan for preset low_ram_safe: device 6.84 GB available of 7.45 GB; host 3.35 GB available of 3.73 GB (1.35 GB usable)
            link: 31.50 GB/s from pinned memory, 15.75 GB/s pageable (given)
            disk: 2.00 GB/s read (assumed, not measured: a run that reads from the files measures it)
            component     route                 host   resident  pinned  streamed/step  time/step     peak
            text_encoder  block x1, prefetch 1  file  741.88 MB     0 B        7.49 GB    4.534 s  1.53 GB
            transformer   block x1, prefetch 1  file   22.61 MB     0 B       11.45 GB    6.925 s  1.21 GB
            vae           component offload     file  159.87 MB     0 B      159.87 MB    0.183 s  2.49 GB
            per image (8 steps): 60.12 s predicted, peak 2.49 GB of 6.84 GB available; host copies: 0 B in RAM of 1.35 GB usable, 0 B pinned, 19.11 GB in checkpoint files
            why:
              text_encoder: 7.49 GB of weights do not fit whole in the 6.16 GB left after 696.32 MB for activations (estimate 440.32 MB + margin 256.00 MB, sized from the workload rather than DDO's fixed headroom tiers), so it streams 1 block per group with prefetch depth 1; preset low_ram_safe keeps only the 741.88 MB outside the blocks resident; 7.49 GB stream in its one call; its host copy is the checkpoint file: preset low_ram_safe spares host RAM, keeping no copy there that a file or the disk store can serve; its one call reads 7.49 GB from the file at 2.00 GB/s (assumed); predicted 4.534 s per call (copies 4.534 s, compute 0.043 s); nothing pinned: its host copy is the checkpoint file, whose pages are read, not pinned
              transformer: 11.46 GB of weights do not fit whole in the 6.08 GB left after 778.24 MB for activations (estimate 522.24 MB + margin 256.00 MB, sized from the workload rather than DDO's fixed headroom tiers), so it streams 1 block per group with prefetch depth 1; preset low_ram_safe keeps only the 22.61 MB outside the blocks resident; 11.46 GB stream on the first step, 11.44 GB on each later one; its host copy is the checkpoint file: preset low_ram_safe spares host RAM, keeping no copy there that a file or the disk store can serve; the first step reads 11.46 GB from the file at 2.00 GB/s (assumed), each later step 11.44 GB from the file again: the 1.35 GB left to the page cache cannot hold them; predicted 6.925 s per step (copies 6.923 s, compute 0.597 s); nothing pinned: its host copy is the checkpoint file, whose pages are read, not pinned
              vae: 159.87 MB of weights fit whole in the 3.92 GB left after 2.92 GB for activations (estimate 2.34 GB + margin 597.98 MB, sized from the workload rather than DDO's fixed headroom tiers), so it moves whole onto the device when it runs (159.87 MB per image); its host copy is the checkpoint file: preset low_ram_safe spares host RAM, keeping no copy there that a file or the disk store can serve; each image reads its 159.87 MB from the file at 2.00 GB/s (assumed); predicted 0.183 s per call (copies 0.094 s, compute 0.088 s); nothing pinned: its host copy is the checkpoint file, whose pages are read, not pinned
        "#]],
        )
    }

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
