//! `pipeline-zimage generate`: make an image with Z-Image(-Turbo) from a diffusers checkpoint directory, on the
//! CPU, a CUDA device or a wgpu (Vulkan) device, with every component routed by an offload preset (`--preset`,
//! planned and explained) or by hand (`--offload auto|group`).
//!
//! On a real device the manager reads the device's own memory (burn's pool, and the driver where it has a call);
//! `--card SIZE` caps those readings at a smaller card. On the CPU, `--card SIZE` is a simulated card that gives
//! the readings and accounts every byte, the weights staying in host memory.
//!
//! Settings of the planner come, in precedence order, from explicit arguments (`--preset`, `--reserve`,
//! `--profile-name`, `--profile-dir`, `--set key=value`), then `OFFLOAD_*` environment variables, then the TOML
//! file of `--config` (or `OFFLOAD_CONFIG`), then the preset's defaults. `--preset` takes precedence over
//! `--offload`; without `--preset`, the planner is used when `--offload` is absent and a settings source is given
//! (`--config`, `--set`, `--profile-name`, `--profile-dir`, `OFFLOAD_PRESET`, `OFFLOAD_CONFIG`).
//!
//! `--trace FILE.json` and `--memory-plot FILE.png` record the run on one `offload_core::Timeline` and write it as
//! a Chrome trace-event file and as a plot of device memory over time (`docs/trace.md`).

#![forbid(unsafe_code)]
mod cli_donors;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use burn::tensor::{DType, Device, Tensor, TensorData};
use clap::{Parser, Subcommand, ValueEnum};
use group_offload::OffloadDevice;
use group_offload::device::{describe_device, page_policy};
use group_offload::{device::CappedDevice, device::PagePolicy, device::PoolReadings, device::open_device_with};
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::Timeline;
use offload_core::plan::{DeviceFacts, LinkRun, ProfileStore};
use offload_core::plan::{HostMemory, Settings, SettingsLayer};
use offload_core::{DeviceMemory, DeviceName, NoLedger, format_rate, format_size, parse_size};
use pipeline_zimage::loading::LoadOptions;
use pipeline_zimage::lora::{LoraFile, LoraMode, LoraSpec, LoraTarget};
use pipeline_zimage::output::{Format, Output, check_output_dir, check_outputs, write_atomic, write_bytes_atomic};
use pipeline_zimage::pipeline::{DeviceMap, GenerateOptions, ZImagePipeline};
use pipeline_zimage::plot::{PlotOptions, draw_memory_plot};
use pipeline_zimage::presets::{check_capacity, enable_pipeline_offload, exact_reserve, generate_profiled};
use pipeline_zimage::schedule::{StrategyChoice, compare_moves, lookahead_after_first_image};

/// Z-Image(-Turbo) on burn.
#[derive(Parser)]
#[command(name = "pipeline-zimage", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate an image (text-to-image, or image-to-image with --image).
    Generate(Box<Generate>),
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Offload {
    /// Every component is moved onto the execution device on its first run and stays there.
    None,
    /// Components move onto the device when they run; the strategy evicts others to make room.
    Auto,
    /// Auto offload, with the transformer streamed block by block (group offload, prefetched).
    Group,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CardMode {
    /// Allocations past the card fail with out-of-memory, which the manager's OOM retry handles.
    Hard,
    /// Only the readings change.
    Soft,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum WeightDtype {
    /// The dtype each checkpoint file stores.
    Stored,
    /// 32-bit floats.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
}

/// `--lora-mode`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LoraModeArg {
    /// Added into the host weights before anything streams.
    Fused,
    /// Low-rank terms computed at every call, moved with their layer's group.
    Runtime,
}

impl From<LoraModeArg> for LoraMode {
    fn from(mode: LoraModeArg) -> Self {
        match mode {
            LoraModeArg::Fused => LoraMode::Fused,
            LoraModeArg::Runtime => LoraMode::Runtime,
        }
    }
}

/// `--lora FILE[:SCALE]`.
fn parse_lora(text: &str) -> Result<LoraSpec, String> {
    LoraSpec::parse(text).map_err(|e| e.to_string())
}

impl WeightDtype {
    fn load_dtype(self) -> Option<DType> {
        match self {
            WeightDtype::Stored => None,
            WeightDtype::F32 => Some(DType::F32),
            WeightDtype::Bf16 => Some(DType::BF16),
            WeightDtype::F16 => Some(DType::F16),
        }
    }
}

#[derive(clap::Args)]
struct Generate {
    /// A diffusers Z-Image checkpoint directory (with model_index.json). Default: the tiny checkpoint the
    /// repository ships for its tests.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// The prompt.
    #[arg(long, default_value = "a photo of a cat sitting on a windowsill")]
    prompt: String,
    /// The negative prompt (used only with --guidance above 0).
    #[arg(long)]
    negative_prompt: Option<String>,
    /// Denoising steps.
    #[arg(long, default_value_t = 8)]
    steps: usize,
    /// Classifier-free guidance scale; 0 turns guidance off (Turbo).
    #[arg(long, default_value_t = 0.0)]
    guidance: f32,
    /// Height in pixels, a multiple of twice the VAE's scale factor (16 for Z-Image-Turbo's VAE).
    #[arg(long, default_value_t = 1024)]
    height: usize,
    /// Width in pixels, a multiple of twice the VAE's scale factor (16 for Z-Image-Turbo's VAE).
    #[arg(long, default_value_t = 1024)]
    width: usize,
    /// Prompt tokens kept.
    #[arg(long, default_value_t = 512)]
    max_sequence_length: usize,
    /// Seed of the initial noise.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A safetensors file with a tensor named `latents` [1, 16, H/8, W/8] (for the FLUX VAE; H/s, W/s for a VAE
    /// of scale factor s): the initial noise of a diffusers run.
    #[arg(long)]
    latents: Option<PathBuf>,
    /// An input image (PNG) for image-to-image.
    #[arg(long)]
    image: Option<PathBuf>,
    /// Image-to-image strength in [0, 1].
    #[arg(long, default_value_t = 0.6)]
    strength: f64,
    /// Where to write the PNG.
    #[arg(long, default_value = "zimage.png")]
    out: PathBuf,
    /// Also write the image as a safetensors file with an f32 tensor `image` [1, 3, H, W] in [0, 1].
    #[arg(long)]
    out_tensor: Option<PathBuf>,
    /// The execution device: cpu, cuda:N (built with --features cuda) or wgpu (built with --features wgpu: Vulkan,
    /// on a CPU-only machine Mesa's lavapipe). On a real device the manager reads the device's own memory.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Components on devices of their own, as COMPONENT=DEVICE pairs separated by commas (`text_encoder=cpu`):
    /// the component runs there, with its own account, and its output crosses to the execution device at its
    /// boundary (diffusers' device_map with whole components). DEVICE is `cpu` (the host's CPU backend, flex:
    /// nothing moves, nothing is planned for it), the execution device's own name, a second simulated card's
    /// (`cuda:1` for the second --card) or, beside a real --device, another real device by name (`cuda:1`,
    /// `wgpu:1`: the machine's second adapter), opened before the weights load with an account of its own.
    /// COMPONENT is text_encoder, transformer or vae. `balanced` deals the
    /// components over the execution device and the other cards by size, largest first, as diffusers'
    /// device_map="balanced" does (the transformer's device then executes).
    #[arg(long, value_name = "COMPONENT=DEVICE|balanced")]
    device_map: Option<String>,
    /// A further device whose memory holds streamed groups between their uploads (a donor, as ComfyUI-MultiGPU's
    /// DisTorch has them), as DEVICE@LINK. On the CPU, DEVICE is a further --card (`cuda:1` for the second), which
    /// holds as many groups as its memory takes, and LINK how its copies reach the execution card: nvlink,
    /// pcie4x16 or pcie3x8 (memory-sim's links, at DisTorch's measured costs). Beside a real --device, DEVICE is
    /// another real device (`cuda:1`, `wgpu:1`), opened before the weights load, and LINK is optional: without it
    /// the copies are priced at the rate earlier runs measured for the pair, else by copies timed before the load,
    /// and the run's own copies are kept for later runs. Groups it holds are copied from it, the others from the
    /// host; `cargo xtask plan --donor` says which donor pays. Repeat it for several donors (each a different
    /// device): a group goes to the first, in the order given, with room.
    #[arg(long, value_name = "DEVICE[@LINK]")]
    donor: Vec<String>,
    /// The device's total memory, overriding the runtime's reading (on wgpu the adapter's largest device-local
    /// Vulkan heap); CUDA's comes from the driver and is not overridden.
    #[arg(long, value_name = "SIZE")]
    device_memory: Option<String>,
    /// A card of this size (or a catalogue name). On the CPU a simulated card gives the readings; on a real
    /// device it caps the device's own readings (hard mode by default: an allocation or a call past it fails
    /// with out-of-memory, as diffusers' simulate_accelerator_memory does on a real GPU). Given again on the CPU,
    /// each further card is another simulated device (`cuda:1`, `cuda:2`, ..) for --device-map.
    #[arg(long)]
    card: Vec<String>,
    /// Whether allocations past --card fail (hard) or only the readings change (soft).
    #[arg(long, value_enum, default_value = "hard")]
    card_mode: CardMode,
    /// On the simulated card, the share of the link rate a copy from pageable host memory reaches (pinned
    /// copies reach all of it); 1 by default. Try 0.5 to see what the plan's pinned budget buys.
    #[arg(long, default_value_t = 1.0)]
    pageable_fraction: f64,
    /// How components are offloaded by hand, without the planner; --preset takes precedence. Default: none.
    #[arg(long, value_enum)]
    offload: Option<Offload>,
    /// Route every component with the offload planner and print its plan first: auto, one_shot_fast,
    /// low_ram_safe, warm_process, diffusers_offload_compat, diffusers_leaf_offload_compat, no_pin, off. Needs a
    /// device to offload to: a real one (its own readings), or --card on the CPU. Takes precedence over --offload.
    #[arg(long)]
    preset: Option<String>,
    /// A TOML settings file for the planner (below explicit arguments and OFFLOAD_* variables); replaces
    /// OFFLOAD_CONFIG.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Any planner setting as key=value (`--set resident_budget=4MB`); repeatable; explicit, so it beats
    /// OFFLOAD_* variables and the file.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Memory kept free for activations. With --offload: the manager's reserve (default: the workload's largest
    /// activation estimate, the planner's exact reserve, on every device). With the planner:
    /// the `reserve` setting (default: each component's activation estimate plus a margin; on a simulated card,
    /// the largest activation estimate, which is exactly what the card is charged).
    #[arg(long)]
    reserve: Option<String>,
    /// The host RAM the plan may use (the `host_available` setting), in place of what the OS says is available: the
    /// planner keeps host copies in RAM where they fit in it and reads the others from their checkpoint files or the
    /// disk store (`docs/host-memory.md`).
    #[arg(long, value_name = "SIZE")]
    ram: Option<String>,
    /// Named calibration: the first run measures the peak and recommends a resident budget; later runs reuse it.
    #[arg(long)]
    profile_name: Option<String>,
    /// Where capacity profiles are stored (default: the platform's data directory, offload/profiles).
    #[arg(long)]
    profile_dir: Option<PathBuf>,
    /// Print the process's host memory: its peak resident set after loading and during each phase (Linux's
    /// VmHWM, reset between phases; it counts the pages of the mapped checkpoint files too), the peak of its
    /// anonymous memory alone (RssAnon, sampled every 10 ms), and each component's loaded bytes.
    #[arg(long)]
    memory_report: bool,
    /// Refuse file tensors the reference implementation ignores too (a text encoder saved with its causal LM's
    /// lm_head), which are otherwise reported and loaded past.
    #[arg(long)]
    strict_load: bool,
    /// The float dtype the weights are loaded and run in: the checkpoint's own (bf16 for Z-Image-Turbo) by
    /// default.
    #[arg(long, value_enum, default_value = "stored")]
    dtype: WeightDtype,
    /// The manager's offload strategy with --offload auto|group: auto (the anchor's rule), sequential
    /// (everything else leaves before each onload), or lookahead: auto for the first image, then Belady's rule
    /// over the schedule of uses the first image showed, for the images after it (use with --images). The run
    /// prints its bytes moved beside auto's on the same schedule and the optimum.
    #[arg(long, default_value = "auto")]
    strategy: String,
    /// A LoRA file (diffusers/PEFT or Kohya layout, .safetensors) for the transformer and, where the file has
    /// one, the text encoder, at an optional strength (`FILE:0.8`; default 1). Repeat it for several LoRAs. A
    /// file with a key that names no layer, or factors that do not fit, is refused before anything changes.
    #[arg(long = "lora", value_name = "FILE[:SCALE]", value_parser = parse_lora)]
    loras: Vec<LoraSpec>,
    /// How --lora applies: fused into the host weights before anything streams (no cost per step; offload moves
    /// the same bytes as without a LoRA), or runtime (low-rank terms computed at every call, moved with their
    /// layer's group; the base weights untouched).
    #[arg(long, value_enum, default_value = "fused")]
    lora_mode: LoraModeArg,
    /// Images generated one after another in this process, with seeds --seed, --seed + 1, ...; with more than
    /// one, written as OUT-1.png, OUT-2.png, ...
    #[arg(long, default_value_t = 1)]
    images: usize,
    /// Quantize the text encoder's and the transformer's linear weights (burn quantized tensors, their own
    /// kernels) with SCHEME: q8s (the default, 8 bits, one f32 scale per tensor), q4s, q2s, e4m3, e5m2, e2m1,
    /// optionally with -b<N> for one scale per block of N values (q4s-b32). A scheme the backend does not compute
    /// is refused by name (the CPU backend has no fp8 or fp4 values). Quantized components stream like float
    /// ones: the planner routes them resident, whole, or by blocks or leaves when they do not fit whole.
    #[arg(long, value_name = "SCHEME", num_args = 0..=1, default_missing_value = "q8s",
          value_parser = |name: &str| pipeline_zimage::quantize::named_scheme(name).ok_or_else(|| format!(
              "unknown scheme {name:?}; use q8s, q4s, q2s, e4m3, e5m2 or e2m1, optionally with -b<N> (q4s-b32)")))]
    quantize: Option<burn::tensor::quantization::QuantScheme>,
    /// Write a Chrome trace-event file of the run: its phases and denoising steps, each component's run, onload
    /// and offload, each group's upload, compute and release on the thread that made it (prefetches on the
    /// worker's), and a counter track of device memory. Open it in https://ui.perfetto.dev or chrome://tracing
    /// (docs/trace.md).
    #[arg(long, value_name = "FILE.json")]
    trace: Option<PathBuf>,
    /// Draw device memory allocated over time as a PNG, with the phases shaded and the moves marked. Needs device
    /// readings: a simulated --card on the CPU, or a real device.
    #[arg(long, value_name = "FILE.png")]
    memory_plot: Option<PathBuf>,
    /// A TrueType font for the memory plot's text; by default a system font (DejaVu Sans, Liberation Sans,
    /// Arial) is used, and without one the plot is drawn unlabelled.
    #[arg(long, value_name = "FILE.ttf")]
    plot_font: Option<PathBuf>,
}

/// The most images one process makes (`--images`): each is a file and a run of its own, so more is a mistake
/// rather than a plan (run several processes).
const MAX_IMAGES: usize = 100_000;

/// Arguments refused at the edge, before anything loads: each says what was asked and what to pass instead.
#[derive(Debug, thiserror::Error)]
enum ArgumentError {
    /// The seeds of `--images N` would pass the largest seed.
    #[error(
        "--seed {seed} with --images {images}: the images use seeds {seed} to {seed} + {}, past the largest seed \
         ({}); pass a --seed of at most {}",
        images - 1,
        u64::MAX,
        u64::MAX - (*images as u64 - 1)
    )]
    SeedOverflow {
        /// The first seed.
        seed: u64,
        /// The images asked for.
        images: usize,
    },
    /// No image, or more than one process makes.
    #[error("--images {images}: pass 1 to {MAX_IMAGES} (more images are a run of several processes)")]
    ImageCount {
        /// The images asked for.
        images: usize,
    },
    /// A cap larger than the device it caps.
    #[error(
        "--card {label} ({}) is larger than {device} ({}): a cap can only make the device smaller; pass a --card of \
         at most {}, or none",
        format_size(*cap),
        format_size(*total),
        format_size(*total)
    )]
    CapLargerThanDevice {
        /// The card asked for.
        label: String,
        /// Its size.
        cap: u64,
        /// The device.
        device: DeviceName,
        /// The device's total.
        total: u64,
    },
    /// More than one `--card` on a real device.
    #[error(
        "--card is given {cards} times with --device {device}: on a real device one --card caps it; further cards are \
         simulated devices beside a simulated card on the CPU (--device cpu): give one --card"
    )]
    Cards {
        /// How many were given.
        cards: usize,
        /// The real device.
        device: DeviceName,
    },
    /// A `--donor` that names no further card or real device, a device twice, or a link memory-sim does not know.
    #[error("--donor {given}: {reason}")]
    Donor {
        /// The value as given.
        given: String,
        /// What is wrong and what to pass instead.
        reason: String,
    },
    /// A `--device-map` entry that names no component, names one twice, or places it on a device the run has not.
    #[error("--device-map {entry:?}: {reason}")]
    DeviceMap {
        /// The entry as given.
        entry: String,
        /// What is wrong and what to pass instead.
        reason: String,
    },
}

/// `--device-map`'s pairs, checked: each names one of the pipeline's components once, on `cpu` or on one of
/// `devices` (the execution device, then the other cards) or, where the execution device is a real one (`real`),
/// on another real device by name (`cuda:1`, `wgpu:1`: [`further_real_device`] opens it before the weights load).
/// `balanced` gives no pairs: [`DeviceMap::balanced`] places every component once the sizes are known.
fn parse_device_map(
    text: &str,
    devices: &[DeviceName],
    real: bool,
) -> Result<Vec<(String, DeviceName)>, ArgumentError> {
    if text.trim() == "balanced" {
        return Ok(Vec::new());
    }
    let mut pairs: Vec<(String, DeviceName)> = Vec::new();
    for entry in text.split(',').map(str::trim).filter(|entry| !entry.is_empty()) {
        let wrong = |reason: String| ArgumentError::DeviceMap { entry: entry.to_string(), reason };
        let Some((component, target)) = entry.split_once('=') else {
            return Err(wrong(
                "write each entry as COMPONENT=DEVICE, for example text_encoder=cpu, or the whole \
                              map as balanced"
                    .into(),
            ));
        };
        let component = component.trim();
        if !pipeline_zimage::pipeline::COMPONENTS.contains(&component) {
            let names = pipeline_zimage::pipeline::COMPONENTS.join(", ");
            return Err(wrong(format!("{component:?} is not a component; use one of: {names}")));
        }
        if pairs.iter().any(|(name, _)| name == component) {
            return Err(wrong(format!("{component} is placed twice; give each component one device")));
        }
        let target = DeviceName::parse(target.trim()).map_err(|error| wrong(format!("{error}")))?;
        let further_real = real && REAL_KINDS.contains(&target.kind());
        if !target.is_cpu() && !devices.contains(&target) && !further_real {
            let names: Vec<String> = devices.iter().map(DeviceName::to_string).collect();
            return Err(wrong(if real {
                format!(
                    "place {component} on cpu, {} or another device of this machine by name (cuda:N, wgpu:N)",
                    names.join(", ")
                )
            } else {
                format!(
                    "this run has the devices {} and the host's CPU: place {component} on cpu or {} (a further \
                     --card adds a simulated device)",
                    names.join(", "),
                    names.join(" or ")
                )
            }));
        }
        pairs.push((component.to_string(), target));
    }
    Ok(pairs)
}

/// Whether the execution device is a real one (`--device` other than `cpu`): the device map may then name further
/// real devices.
fn real_execution(args: &Generate) -> bool {
    DeviceName::parse(&args.device).is_ok_and(|name| !name.is_cpu())
}

/// The kinds of real device a device map may name beside a real execution device.
const REAL_KINDS: [&str; 3] = ["cuda", "wgpu", "vulkan"];

/// Opens a real device the device map or a `--donor` names beside the real execution device `exec` (a second GPU:
/// `cuda:1`, `wgpu:1`), with `exec`'s page policy, as a device object of its own over the runtime's pool readings
/// (its total is the runtime's: the driver's, or the adapter's heap). Fails with the runtime's typed error (a
/// build without its backend, an adapter this machine does not list, a runtime that states no total), before any
/// weight loads.
fn further_real_device(name: &DeviceName, exec: &OffloadDevice) -> anyhow::Result<OffloadDevice> {
    // `page_policy` is `None` only for CUDA, whose open keeps its own pool settings and ignores the policy, so the
    // default stands for nothing there.
    let pages = page_policy(exec.exec()).unwrap_or_default();
    let device = open_device_with(name, pages)?;
    if let Some(description) = describe_device(name) {
        println!("device {name}: {description}");
    }
    let readings = PoolReadings::open(device.clone(), name.clone(), None)?;
    Ok(OffloadDevice::pooled(device, name.clone(), readings))
}

/// The simulated devices `--card` names on the CPU, the execution device's first: the first card is `cuda:0`
/// (the card's default name) and each further one `cuda:N`. On a real device only one card is allowed: it caps that
/// device.
fn card_devices(args: &Generate) -> Result<Vec<DeviceName>, ArgumentError> {
    let exec = DeviceName::parse(&args.device)
        .map_err(|error| ArgumentError::DeviceMap { entry: args.device.clone(), reason: format!("{error}") })?;
    if !exec.is_cpu() && args.card.len() > 1 {
        return Err(ArgumentError::Cards { cards: args.card.len(), device: exec });
    }
    if !exec.is_cpu() || args.card.is_empty() {
        return Ok(vec![exec]);
    }
    (0..args.card.len())
        .map(|index| {
            DeviceName::parse(&format!("cuda:{index}")).map_err(|error| ArgumentError::DeviceMap {
                entry: format!("cuda:{index}"),
                reason: format!("{error}"),
            })
        })
        .collect()
}

/// Checks the arguments that need no device and no weights and that only the CLI has: the number of images and
/// the seeds of every image.
fn check_arguments(args: &Generate) -> Result<(), ArgumentError> {
    if args.images == 0 || args.images > MAX_IMAGES {
        return Err(ArgumentError::ImageCount { images: args.images });
    }
    if args.seed.checked_add(args.images as u64 - 1).is_none() {
        return Err(ArgumentError::SeedOverflow { seed: args.seed, images: args.images });
    }
    Ok(())
}

/// Everything the CLI checks before it reads a file, opens a device or reads a weight: the images and seeds, the
/// counts the library bounds (`GenerateOptions::check_counts`: sides, steps, prompt tokens, guidance, strength), the
/// sizes (`--reserve`, `--card`, `--device-memory`) and a reserve the card cannot hold. The fuzzer's target for the
/// CLI's numeric arguments: for any arguments it returns, never panics.
fn preflight(args: &Generate) -> anyhow::Result<()> {
    check_arguments(args)?;
    let devices = card_devices(args)?;
    if let Some(map) = &args.device_map {
        parse_device_map(map, &devices, real_execution(args))?;
    }
    cli_donors::check_donors(args)?;
    options(args).check_counts()?;
    let reserve = args.reserve.as_deref().map(parse_size).transpose().context("--reserve")?;
    let total = args.device_memory.as_deref().map(parse_size).transpose().context("--device-memory")?;
    for label in &args.card {
        let spec = CardSpec::parse(label)?.with_context_overhead(0).with_pageable_fraction(args.pageable_fraction)?;
        if let Some(reserve) = reserve {
            spec.check_reserve(reserve)?;
        }
    }
    if let (Some(reserve), Some(total)) = (reserve, total) {
        CardSpec::parse(&total.to_string())?.with_context_overhead(0).check_reserve(reserve)?;
    }
    Ok(())
}

/// The reserve the manager keeps under `--offload`: `--reserve` when given, else the workload's largest activation
/// estimate (what each call needs beside its weights), checked against what the device can hold.
fn check_manual_reserve(
    reserve: u64,
    spec: Option<&CardSpec>,
    memory: Option<&dyn DeviceMemory>,
) -> anyhow::Result<()> {
    if let Some(spec) = spec {
        spec.check_reserve(reserve)?;
    }
    if let Some(memory) = memory {
        let total = memory.try_reading().map_err(group_offload::Error::from)?.total;
        CardSpec::parse(&total.to_string())?.with_context_overhead(0).check_reserve(reserve)?;
    }
    Ok(())
}

/// The generation options the arguments give, without the input files (`--latents`, `--image`), which
/// [`read_inputs`] reads.
fn options(args: &Generate) -> GenerateOptions {
    let mut opts = GenerateOptions::turbo(args.prompt.clone());
    opts.negative_prompt = args.negative_prompt.clone();
    opts.steps = args.steps;
    opts.guidance = args.guidance;
    opts.height = args.height;
    opts.width = args.width;
    opts.max_sequence_length = args.max_sequence_length;
    opts.seed = args.seed;
    opts.strength = args.strength;
    opts
}

/// The input files, read before anything loads: a missing or malformed one is refused in milliseconds, not after
/// the checkpoint has loaded.
struct Inputs {
    latents: Option<Tensor<4>>,
    image: Option<Tensor<4>>,
    loras: Vec<(LoraSpec, LoraFile)>,
}

/// Reads `--latents`, `--image` and every `--lora` file (each LoRA checked as a file here; against the models once
/// they are loaded).
fn read_inputs(args: &Generate) -> anyhow::Result<Inputs> {
    let latents = args.latents.as_deref().map(read_latents).transpose()?;
    let image = args.image.as_deref().map(|p| read_image(p, args.height, args.width)).transpose()?;
    let loras = args
        .loras
        .iter()
        .map(|spec| Ok((spec.clone(), LoraFile::read(&spec.path)?)))
        .collect::<Result<Vec<_>, pipeline_zimage::error::Error>>()?;
    Ok(Inputs { latents, image, loras })
}

/// The files the run reads, for the outputs' check (no output may replace one).
fn input_paths(args: &Generate) -> Vec<(&'static str, &Path)> {
    let mut inputs: Vec<(&'static str, &Path)> = Vec::new();
    inputs.extend(args.latents.as_deref().map(|p| ("--latents", p)));
    inputs.extend(args.image.as_deref().map(|p| ("--image", p)));
    inputs.extend(args.config.as_deref().map(|p| ("--config", p)));
    inputs.extend(args.plot_font.as_deref().map(|p| ("--plot-font", p)));
    inputs.extend(args.loras.iter().map(|spec| ("--lora", spec.path.as_path())));
    inputs
}

/// Every file the run writes: each image's PNG and tensor (numbered with several images), the trace and the plot.
fn outputs(args: &Generate) -> Vec<Output> {
    let mut outputs = Vec::new();
    for index in 0..args.images {
        outputs.push(Output::new("--out", numbered(&args.out, index, args.images), Format::Png));
        if let Some(path) = &args.out_tensor {
            outputs.push(Output::new("--out-tensor", numbered(path, index, args.images), Format::Safetensors));
        }
    }
    outputs.extend(args.trace.iter().map(|path| Output::new("--trace", path, Format::Any)));
    outputs.extend(args.memory_plot.iter().map(|path| Output::new("--memory-plot", path, Format::Png)));
    outputs
}

fn default_weights() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-z-image-turbo")
}

fn read_latents(path: &Path) -> anyhow::Result<Tensor<4>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file = safetensors::SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{} is not a safetensors file", path.display()))?;
    let view = file.tensor("latents").with_context(|| format!("{} has no tensor named `latents`", path.display()))?;
    let shape: Vec<usize> = view.shape().to_vec();
    let [a, b, c, d] = shape[..] else {
        bail!("`latents` in {} has shape {shape:?}, not 4 dimensions", path.display())
    };
    let values: Vec<f32> = match view.dtype() {
        safetensors::Dtype::F32 => {
            view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
        safetensors::Dtype::BF16 => {
            view.data().chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        }
        safetensors::Dtype::F16 => {
            view.data().chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        }
        other => bail!("`latents` in {} is {other:?}; write it as f32, bf16 or f16", path.display()),
    };
    Ok(Tensor::from_data(TensorData::new(values, [a, b, c, d]), (&Device::flex(), DType::F32)))
}

fn read_image(path: &Path, height: usize, width: usize) -> anyhow::Result<Tensor<4>> {
    let image = image::open(path).with_context(|| format!("cannot read the image {}", path.display()))?.to_rgb8();
    if (image.height() as usize, image.width() as usize) != (height, width) {
        bail!(
            "{} is {}x{}, but --width {width} --height {height} were asked: resize the image or pass its size",
            path.display(),
            image.width(),
            image.height()
        );
    }
    let mut planar = vec![0.0f32; 3 * height * width];
    for (x, y, pixel) in image.enumerate_pixels() {
        for c in 0..3 {
            planar[c * height * width + y as usize * width + x as usize] = f32::from(pixel[c]) / 255.0;
        }
    }
    Ok(Tensor::from_data(TensorData::new(planar, [1, 3, height, width]), (&Device::flex(), DType::F32)))
}

/// Writes the image as a PNG at `out` and, when asked, as an f32 safetensors file at `out_tensor`, each encoded in
/// memory first and written atomically ([`write_bytes_atomic`]): a failure leaves any file there as it was. Both
/// paths were checked before the run ([`check_outputs`]).
fn write_outputs(image: Tensor<4>, out: &Path, out_tensor: Option<&Path>) -> anyhow::Result<()> {
    let [batch, channels, height, width] = image.dims();
    if (batch, channels) != (1, 3) {
        bail!("the pipeline made an image of shape {:?}, not [1, 3, H, W]; nothing was written", image.dims());
    }
    let data = image.try_into_data().map_err(|e| anyhow::anyhow!("cannot read the image back from the device: {e}"))?;
    let values: Vec<f32> = data.try_into_vec_as::<f32>().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    if let Some(path) = out_tensor {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 3, height, width], &bytes)?;
        let file = safetensors::serialize([("image", view)], None)
            .with_context(|| format!("cannot encode --out-tensor {}", path.display()))?;
        write_bytes_atomic(path, &file)?;
    }
    let mut png = image::RgbImage::new(width as u32, height as u32);
    for (x, y, pixel) in png.enumerate_pixels_mut() {
        for c in 0..3 {
            let v = values[c * height * width + y as usize * width + x as usize];
            pixel[c] = (v * 255.0).round().clamp(0.0, 255.0) as u8;
        }
    }
    let mut encoded = Vec::new();
    png.write_to(&mut std::io::Cursor::new(&mut encoded), image::ImageFormat::Png)
        .with_context(|| format!("cannot encode {} as PNG", out.display()))?;
    write_bytes_atomic(out, &encoded)?;
    Ok(())
}

/// Writes the `--trace` file and draws the `--memory-plot` of the run recorded in `timeline`, on `device`.
fn write_timeline(args: &Generate, timeline: &Timeline, device: &OffloadDevice) -> anyhow::Result<()> {
    let memory = device.memory().clone();
    if let Some(path) = &args.trace {
        write_atomic(path, |out| timeline.write_chrome_trace(out))?;
        println!(
            "wrote the trace {}: {} events on {} threads; open it in https://ui.perfetto.dev or chrome://tracing",
            path.display(),
            timeline.events().len(),
            timeline.threads().len()
        );
    }
    if let Some(path) = &args.memory_plot {
        let options = PlotOptions {
            capacity: memory.as_ref().map(|m| m.total()),
            title: match (device.account::<SimCard>(), &memory) {
                (Some(card), _) => {
                    format!("device memory on the simulated {} card ({})", card.spec().label, format_size(card.total()))
                }
                (None, Some(memory)) => {
                    format!("device memory on {} ({})", memory.device(), format_size(memory.total()))
                }
                (None, None) => "device memory".into(),
            },
            font: args.plot_font.clone(),
            ..PlotOptions::default()
        };
        let summary = draw_memory_plot(timeline, path, &options)?;
        println!(
            "wrote the memory plot {}: {} samples, {} moves marked, {} group uploads in the link panel",
            path.display(),
            summary.samples,
            summary.marks,
            summary.link_samples
        );
        if !summary.labelled {
            eprintln!(
                "the memory plot has no text: no font was found; pass --plot-font FILE.ttf (any TrueType font) to \
                 label its axes and legend"
            );
        }
    }
    Ok(())
}

/// The store capacity profiles and link figures go to: the planner's settings' (`profile_dir`, or the platform's
/// data directory) under a plan; otherwise where the planner would look: --profile-dir, then
/// `OFFLOAD_PROFILE_DIR`, then the data directory.
fn profile_store(args: &Generate, settings: Option<&Settings>) -> anyhow::Result<ProfileStore> {
    Ok(match settings {
        Some(settings) => ProfileStore::from_settings(settings)?,
        None => args
            .profile_dir
            .clone()
            .or_else(|| std::env::var_os("OFFLOAD_PROFILE_DIR").map(PathBuf::from))
            .map_or_else(ProfileStore::default_dir, Ok)
            .map(ProfileStore::at)?,
    })
}

/// The environment as text pairs (values that are not Unicode are read lossily, as `Settings::from_process` does).
fn environment() -> Vec<(String, String)> {
    std::env::vars_os().map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned())).collect()
}

/// Whether the planner routes the components: `--preset`, or no `--offload` and some settings source.
fn uses_planner(args: &Generate, env: &[(String, String)]) -> bool {
    if args.preset.is_some() {
        return true;
    }
    let from_env = env.iter().any(|(k, _)| k == "OFFLOAD_PRESET" || k == "OFFLOAD_CONFIG");
    args.offload.is_none()
        && (args.config.is_some()
            || args.ram.is_some()
            || !args.set.is_empty()
            || args.profile_name.is_some()
            || args.profile_dir.is_some()
            || from_env)
}

/// The planner's settings: explicit arguments, then `OFFLOAD_*`, then the TOML file, then the preset. When
/// nothing sets `reserve` and the card is simulated, `simulated_reserve` is passed as an explicit reserve (a
/// simulated card charges exactly the estimates, so the planner's margin has nothing to cover). Returns whether
/// it was.
fn resolve_settings(
    args: &Generate,
    env: &[(String, String)],
    simulated_reserve: Option<u64>,
) -> anyhow::Result<(Settings, bool)> {
    let mut explicit = SettingsLayer::default();
    if let Some(preset) = &args.preset {
        explicit.set("preset", preset)?;
    }
    if let Some(reserve) = &args.reserve {
        explicit.set("reserve", reserve)?;
    }
    if let Some(ram) = &args.ram {
        explicit.set("host_available", ram).context("--ram")?;
    }
    if let Some(name) = &args.profile_name {
        explicit.set("profile_name", name)?;
    }
    if let Some(dir) = &args.profile_dir {
        explicit.profile_dir = Some(dir.clone());
    }
    for pair in &args.set {
        let Some((key, value)) = pair.split_once('=') else {
            bail!("--set {pair:?} is not key=value; write it as --set resident_budget=4MB");
        };
        explicit.set(key.trim(), value.trim())?;
    }
    let config =
        args.config.clone().or_else(|| env.iter().find(|(k, _)| k == "OFFLOAD_CONFIG").map(|(_, v)| PathBuf::from(v)));
    let file = config
        .as_ref()
        .map(|path| {
            std::fs::read_to_string(path).with_context(|| format!("cannot read the settings file {}", path.display()))
        })
        .transpose()?;
    let settings = Settings::resolve(&explicit, env.iter().cloned(), file.as_deref())?;
    match simulated_reserve {
        Some(reserve) if settings.reserve.is_none() => {
            explicit.reserve = Some(reserve);
            Ok((Settings::resolve(&explicit, env.iter().cloned(), file.as_deref())?, true))
        }
        _ => Ok((settings, false)),
    }
}

fn generate(args: &Generate) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let weights = args.weights.clone().unwrap_or_else(default_weights);
    let env = environment();
    let planner = uses_planner(args, &env);
    if args.preset.is_some() && args.offload.is_some() {
        eprintln!("--preset takes precedence over --offload: the planner routes every component");
    }
    let offload = if planner { Offload::None } else { args.offload.unwrap_or(Offload::None) };
    let strategy = StrategyChoice::parse(&args.strategy)?;
    preflight(args)?;
    // Everything a user gives is checked before any device opens or any weight loads, which takes minutes at real
    // size: every file the run writes, every file it reads, the settings, and the options against the checkpoint's
    // configs (read, and checked against each other, without a weight).
    check_outputs(&outputs(args), &input_paths(args))?;
    let inputs = read_inputs(args)?;
    let mut opts = options(args);
    opts.latents = inputs.latents;
    opts.image = inputs.image;
    pipeline_zimage::pipeline::check_before_loading(&weights, &opts)
        .with_context(|| format!("checking {} before loading it", weights.display()))?;
    // Bad settings (and the settings file) are reported before the weights load; the simulated card's reserve is
    // added once they have.
    let settings = planner.then(|| resolve_settings(args, &env, None)).transpose()?.map(|(settings, _)| settings);
    let device_name = DeviceName::parse(&args.device)?;
    // Capacity profiles and link figures are written into the profile directory after the run: checked now.
    if planner || !device_name.is_cpu() {
        let store = profile_store(args, settings.as_ref())?;
        check_output_dir("--profile-dir", store.dir())?;
    }
    if strategy != StrategyChoice::Auto && (planner || offload == Offload::None) {
        bail!(
            "--strategy {} chooses the manager's strategy under --offload auto or --offload group; {}",
            strategy.name(),
            if planner { "a preset chooses its own (drop --strategy or --preset)" } else { "add --offload auto" }
        );
    }
    // An explicit reserve is checked against the card before anything loads; without one the reserve is the
    // workload's largest activation estimate, known once the configs are read.
    let explicit_reserve = match (&args.reserve, planner) {
        (Some(reserve), false) => Some(parse_size(reserve).context("--reserve")?),
        _ => None,
    };
    let name = device_name;
    let (exec, placement, card_spec) = open_execution_device(args, &name, offload, planner, explicit_reserve)?;
    let simulated = placement.account::<SimCard>();
    if let Some(scheme) = &args.quantize {
        // The scheme is checked for the host that quantizes and the device that runs it before the weights load.
        for component in ["text_encoder", "transformer"] {
            group_offload::quant::check_placement(component, scheme, &Device::flex(), &exec)?;
        }
    }
    let (map, mut others) = device_map(args, &placement, &weights, explicit_reserve)?;
    // Each donor opens, and a real one's copies are timed, before the weights load: a wrong name costs no load.
    let priced =
        cli_donors::price_donors(args, &placement, &map, &others, &profile_store(args, settings.as_ref())?, planner)?;
    let anonymous = args
        .memory_report
        .then(|| Arc::new(pipeline_zimage::host::AnonymousPeak::start(std::time::Duration::from_millis(10))));
    let load = LoadOptions::new().with_dtype(args.dtype.load_dtype()).with_strict(args.strict_load);
    // Under the planner every component is registered from its checkpoint files (nothing but their headers is read):
    // the plan keeps each in RAM or reads it from its files as the host's budget allows. On the CPU a --quantize
    // scheme quantizes the linear weights as they are read; elsewhere (a device that packs them) the whole model
    // is loaded and quantized in memory, as without the planner.
    let quantize_as_read = planner && exec == Device::flex();
    // Before any offload is set up: every group offloader keeps the timeline it is built with.
    let timeline =
        if args.trace.is_some() || args.memory_plot.is_some() { Timeline::enabled() } else { Timeline::disabled() };
    let mut pipeline = if planner {
        let scheme = args.quantize.as_ref().filter(|_| quantize_as_read);
        ZImagePipeline::bind_mapped(&weights, map, &load, scheme, timeline.clone())
    } else {
        ZImagePipeline::load_mapped(&weights, map, &load)
    }
    .with_context(|| format!("loading {}", weights.display()))?;
    for (component, placement) in &pipeline.device_map().components {
        println!(
            "device map: {component} runs on {}, with its own account: nothing is planned for it or charged to {}",
            placement.name(),
            pipeline.placement().name()
        );
    }
    let mut donors = Vec::new();
    for donor in priced {
        if cli_donors::set_donor(&mut pipeline, &donor, planner)? {
            donors.push(donor);
        }
    }
    // A further card the map uses onloads its components at their first run, on its own account, and keeps them.
    others.retain(|(_, other)| {
        pipeline.device_map().components.iter().any(|(_, placed)| placed.is(other))
            || donors.iter().any(|donor| donor.device().is(other))
    });
    for (_, other) in &others {
        other.enable_auto_offload(0)?;
    }
    if !exec.supports_dtype(pipeline.dtype()) {
        bail!(
            "{name} cannot compute in {:?}, the dtype the weights were loaded in (Vulkan devices often store bf16 \
             but have no arithmetic for it): pass --dtype f32",
            pipeline.dtype()
        );
    }
    for report in pipeline.load_reports() {
        eprintln!("{report}");
    }
    if !inputs.loras.is_empty() {
        apply_loras(&mut pipeline, inputs.loras, args.lora_mode)?;
    }
    // The device's peak in use during each phase, for the host budget's lines: a simulated card's own, reset at
    // each phase's end; a real device's pool peak, reset the same way.
    // The per-phase peaks are reset only under --memory-report; the run's own peak is kept beside them, so the
    // peak printed at the end is the whole run's.
    let run_peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let device_peak = phase_peak(&placement, run_peak.clone());
    let whole_run_peak = |now: u64| now.max(run_peak.load(std::sync::atomic::Ordering::Relaxed));
    if let Some(anonymous) = &anonymous {
        report_loaded(&pipeline, anonymous, device_peak());
    }
    if let (Some(scheme), true) = (&args.quantize, quantize_as_read) {
        eprintln!(
            "text_encoder, transformer: linear weights quantized ({}) as they are read from the checkpoint files",
            group_offload::quant::scheme_name(scheme)
        );
    } else if let Some(scheme) = &args.quantize {
        let name = group_offload::quant::scheme_name(scheme);
        let report = |component: &str, done: pipeline_zimage::quantize::Quantized| {
            let left = match done.left_float.as_slice() {
                [] => String::new(),
                [(first, shape), ..] => format!(
                    "; {} left float, their rows not a whole number of the device's packed words (first {first} \
                     {shape:?})",
                    done.left_float.len()
                ),
            };
            eprintln!("{component}: {} linear weights quantized ({name}){left}", done.weights);
        };
        report("text_encoder", pipeline_zimage::quantize::quantize_with(pipeline.text_encoder_mut(), scheme)?);
        report("transformer", pipeline_zimage::quantize::quantize_with(pipeline.transformer_mut(), scheme)?);
    }
    if !planner {
        pipeline.set_timeline(timeline.clone())?;
    }
    if let Some(anonymous) = anonymous.clone() {
        let weights = loaded_weight_bytes(&pipeline);
        pipeline.set_phase_observer(Arc::new(move |phase: &str| {
            use pipeline_zimage::host::{peak_resident_bytes, reset_peak_resident};
            let peak = peak_resident_bytes();
            let anonymous_peak = anonymous.peak();
            println!(
                "memory: host peak during {phase}: {peak} bytes ({}), anonymous {anonymous_peak} bytes",
                format_size(peak),
            );
            println!("{}", host_budget_line(phase, anonymous_peak, device_peak(), weights));
            if phase == "encode" {
                // The first denoising step starts now: what a user waits for, loading included.
                println!("time_to_first_step seconds={:.3}", started.elapsed().as_secs_f64());
            }
            let _ = reset_peak_resident();
            anonymous.reset();
        }));
    }
    pipeline.validate(&opts)?;
    // The manager's reserve under --offload: the one given, or the workload's largest activation estimate (the
    // planner's exact reserve), checked against the card and the device before anything runs.
    let manual_reserve = explicit_reserve.unwrap_or_else(|| exact_reserve(&pipeline, &opts));
    if offload != Offload::None && !planner {
        check_manual_reserve(manual_reserve, card_spec.as_ref(), placement.memory().as_deref())?;
        if explicit_reserve.is_none() {
            println!(
                "reserve: {} (the workload's largest activation estimate; pass --reserve to change it)",
                format_size(manual_reserve)
            );
        }
    }

    let mut plan = None;
    if planner {
        let exact = simulated.is_some().then(|| exact_reserve(&pipeline, &opts));
        let (settings, exact_used) = resolve_settings(args, &env, exact)?;
        if exact_used {
            println!(
                "reserve: {} (the largest activation estimate: the simulated card is charged exactly that, so no \
                 margin is added; pass --reserve or set OFFLOAD_RESERVE to change it)",
                format_size(settings.reserve.unwrap_or(0))
            );
        }
        let host = match (HostMemory::read(), settings.host_available) {
            // Read after binding: no weight is in host memory yet; the plan decides which copies go there.
            (Ok(host), _) => host,
            (Err(_), Some(available)) => HostMemory::new(available, available),
            (Err(error), None) => return Err(error.into()),
        };
        let facts = device_facts(&placement, &settings, host)?;
        let facts = donors.iter().fold(facts, |facts, donor| facts.with_peer(donor.peer.clone()));
        // The read rate earlier runs measured on the checkpoint's disk, in place of the assumed one.
        let measured_disk = ProfileStore::from_settings(&settings)?.measured_disk(&disk_label(&weights))?;
        let facts = facts.with_measured_disk(measured_disk);
        let applied = enable_pipeline_offload(&mut pipeline, settings, &facts, &opts)?;
        println!("{applied}");
        plan = Some(applied);
    } else if placement.memory().is_some() && offload != Offload::None {
        if offload == Offload::Group {
            pipeline.enable_group_offload(1, 1)?;
        }
        pipeline.enable_auto_offload(manual_reserve, true)?;
        pipeline.manager().set_offload_strategy(strategy.first_image())?;
    } else if !pipeline.placement().name().is_cpu() {
        // No offload: every component is onloaded on its first run and stays (weights load on the host; on a
        // device this is what moves them there). The moves still go through the manager's record.
        pipeline.enable_auto_offload(0, true)?;
    }

    let bar = indicatif::ProgressBar::new(args.steps as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("denoising {bar:40} {pos}/{len} [{elapsed_precise}]")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut progress = |step: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(step as u64);
    };
    // Between the samples taken at each move, one every millisecond shows what each call holds while it runs.
    let sampler =
        placement.memory().clone().map(|memory| timeline.sample_every(memory, std::time::Duration::from_millis(1)));
    let mut record = None;
    let mut first_image_uses = 0;
    // Per image: its wall time and what the record shows moving during it, for the images-after-the-first line.
    let mut per_image: Vec<ImageFigures> = Vec::new();
    let mut events_seen = pipeline.manager().offload_record().events().len();
    for index in 0..args.images {
        // Checked before anything loaded (check_arguments): the last image's seed fits.
        opts.seed = args.seed.saturating_add(index as u64);
        let started = std::time::Instant::now();
        let mark = pipeline.manager().offload_record().total_added();
        let outcome = match &plan {
            Some(plan) => {
                if index == 0 {
                    for warning in check_capacity(plan, &opts)? {
                        eprintln!("capacity: {warning}");
                    }
                }
                generate_profiled(&pipeline, plan, &opts, &mut progress)
                    .map(|run| (run.image, run.phases, Some(run.record)))
            }
            None => pipeline.generate_with_report(&opts, &mut progress).map(|run| (run.image, run.phases, None)),
        };
        let (image, phases, profiled) = match outcome {
            Ok(run) => run,
            Err(error) => {
                bar.finish();
                drop(sampler);
                // A failed run is written too: its trace shows what led to the failure.
                if let Err(write_error) = write_timeline(args, &timeline, &placement) {
                    eprintln!("{write_error:#}");
                }
                return Err(error.into());
            }
        };
        record = profiled.or(record);
        // A refused prefetch costs time, never correctness: it is said once per image, never left silent.
        if let Some(refused) = pipeline.manager().offload_record().refusals_since(mark) {
            eprintln!("image {}: {refused}", index + 1);
        }
        let events = pipeline.manager().offload_record().events();
        per_image.push(ImageFigures::of(started.elapsed(), &events[events_seen.min(events.len())..]));
        events_seen = events.len();
        if index == 0 && strategy == StrategyChoice::Lookahead {
            // The first image showed the schedule; every image after it repeats it.
            let first = pipeline.manager().uses();
            first_image_uses = first.len();
            let lookahead = lookahead_after_first_image(&first, args.images);
            pipeline.manager().set_offload_strategy(Arc::new(lookahead))?;
        }
        let out = numbered(&args.out, index, args.images);
        write_outputs(image, &out, args.out_tensor.as_deref().map(|p| numbered(p, index, args.images)).as_deref())?;
        if args.images > 1 {
            let figures = &per_image[index];
            println!(
                "image {} of {} (seed {}): wrote {} in {:.3} s, {} onloads ({}), {} offloads",
                index + 1,
                args.images,
                opts.seed,
                out.display(),
                figures.seconds,
                figures.onloads,
                format_size(figures.bytes_onloaded),
                figures.offloads
            );
        } else {
            println!("wrote {}", out.display());
        }
        println!("\nphases:\n{phases}");
    }
    bar.finish();
    drop(sampler);
    if let Some(line) = ImageFigures::after_the_first(&per_image) {
        println!("\n{line}");
    }
    // Each move onto the device, whole or by group, from its first copy to its synced read-back; on the CPU
    // backend a host copy, whatever a simulated card's link is said to take.
    let link = pipeline.placement().link().clone();
    if let Some(rate) = link.rate() {
        println!("link to {name}: {rate}");
    }
    // Each group read from a checkpoint file, timed: printed, kept for the next plan, and held against the plan.
    if let Some(plan) = &plan {
        report_file_reads(&pipeline, plan, &weights, args.steps)?;
    }
    if !name.is_cpu() {
        record_measurements(args, plan.as_ref(), &pipeline, &name)?;
    }
    write_timeline(args, &timeline, &placement)?;
    report_devices(&pipeline, &others, &donors, &whole_run_peak)?;
    if offload != Offload::None
        && let Some(memory) = placement.memory().clone()
    {
        // Bytes moved beside auto's on the same schedule, and the optimum: replayed on the simulated card that
        // charged the run, or predicted on a card of the real device's size.
        let (card, exact) = match &simulated {
            Some(card) => (card.spec().clone(), true),
            None => {
                (CardSpec::parse(&memory.total().to_string())?.with_mode(Mode::Hard).with_context_overhead(0), false)
            }
        };
        let comparison = compare_moves(&pipeline, &opts, strategy, first_image_uses, card, manual_reserve, exact)?;
        println!("\n{comparison}");
    }
    if let Some(record) = record {
        println!("capacity profile: {}", record.path.display());
        if let Some(recommendation) = record.calibration {
            println!(
                "calibrated: peak {} of {} available, recommended resident budget {} for later runs",
                format_size(recommendation.measured_peak),
                format_size(recommendation.device_available),
                format_size(recommendation.resident_budget)
            );
        }
    }
    Ok(())
}

/// Opens the execution device `name` and builds its one object, its account built once: a simulated card on the CPU
/// (the first `--card`), a real device's pool readings, a cap over them (`--card` on a device), or nothing
/// accounted. Refuses, before any weight loads, an offload or a plot with nothing to offload to or to read, and a
/// cap or a reserve the device cannot hold. Returns the burn device, the device object and the first card's spec.
fn open_execution_device(
    args: &Generate,
    name: &DeviceName,
    offload: Offload,
    planner: bool,
    explicit_reserve: Option<u64>,
) -> anyhow::Result<(Device, OffloadDevice, Option<CardSpec>)> {
    let name = name.clone();
    // Under a card, the pool takes one page per allocation (where the runtime lets it choose), so a cap on its
    // pages is a cap on what the calls allocate rather than on cubecl's page sizes; under the planner too, so that
    // what a component's onload adds to the pool is its own (its footprint, which later plans count it as).
    let pages = if !args.card.is_empty() || planner { PagePolicy::Exclusive } else { PagePolicy::Adaptive };
    let exec = open_device_with(&name, pages)?;
    if let Some(description) = describe_device(&name) {
        println!("device {name}: {description}");
    }
    let spec = args
        .card
        .first()
        .map(|label| -> anyhow::Result<CardSpec> {
            let mode = if args.card_mode == CardMode::Hard { Mode::Hard } else { Mode::Soft };
            let spec = CardSpec::parse(label)?
                .with_mode(mode)
                .with_context_overhead(0)
                .with_pageable_fraction(args.pageable_fraction)?;
            if offload != Offload::None
                && let Some(reserve) = explicit_reserve
            {
                spec.check_reserve(reserve)?;
            }
            Ok(spec)
        })
        .transpose()?;
    // The execution device's one object, its account built once: a simulated card on the CPU, a real device's
    // pool readings, a cap over them, or nothing accounted. Every later reading and report asks it.
    let card_spec = spec.clone();
    let placement = if name.is_cpu() {
        match spec {
            Some(spec) => OffloadDevice::simulated(SimCard::new(spec)),
            None => OffloadDevice::on_device(exec.clone(), name.clone(), Arc::new(NoLedger), None),
        }
    } else {
        // A real device: the readings are its own; a card caps them and never stands in for them.
        let total = args.device_memory.as_deref().map(parse_size).transpose().context("--device-memory")?;
        let decides = offload != Offload::None || planner || spec.is_some();
        let readings = match PoolReadings::open(exec.clone(), name.clone(), total) {
            Ok(readings) => Some(readings),
            // A resident run decides nothing from the readings: it runs without them rather than ask for a size.
            Err(group_offload::Error::UnknownTotal { .. }) if !decides => None,
            Err(error) => return Err(error.into()),
        };
        let cap = match (spec, &readings) {
            (Some(spec), Some(readings)) => {
                // A cap the device cannot hold is refused before the weights load.
                let total = readings.try_reading().map_err(group_offload::Error::from)?.total;
                if spec.capacity > total {
                    return Err(ArgumentError::CapLargerThanDevice {
                        label: spec.label,
                        cap: spec.capacity,
                        device: name.clone(),
                        total,
                    }
                    .into());
                }
                Some(CappedDevice::new(readings.clone(), spec.capacity, spec.mode == Mode::Hard, spec.label))
            }
            _ => None,
        };
        if offload != Offload::None
            && let (Some(reserve), Some(readings)) = (explicit_reserve, &readings)
        {
            // The device's size is known before anything loads (the driver, the runtime's heap or
            // --device-memory): a reserve it cannot hold is refused now.
            check_manual_reserve(reserve, None, Some(readings.as_ref()))?;
        }
        match (cap, readings) {
            (Some(cap), _) => OffloadDevice::capped(exec.clone(), name.clone(), cap),
            (None, Some(readings)) => OffloadDevice::pooled(exec.clone(), name.clone(), readings),
            (None, None) => OffloadDevice::on_device(exec.clone(), name.clone(), Arc::new(NoLedger), None),
        }
    };
    if (offload != Offload::None || planner) && name.is_cpu() && placement.account::<SimCard>().is_none() {
        bail!(
            "{} needs an execution device to offload to, but --device cpu runs everything in host memory: pass \
             --card SIZE to simulate a card on the CPU, or run on a device (--device cuda:0, --device wgpu)",
            if planner {
                "the offload planner (--preset)"
            } else if offload == Offload::Auto {
                "--offload auto"
            } else {
                "--offload group"
            }
        );
    }
    if args.memory_plot.is_some() && placement.memory().is_none() {
        bail!(
            "--memory-plot draws the device's memory readings, but --device {name} has none here: pass --card SIZE \
             to simulate a card on the CPU, or --device-memory SIZE on a runtime that reports no total"
        );
    }
    Ok((exec, placement, card_spec))
}

/// The further `--card`s, each a simulated card and its device object.
type FurtherCards = Vec<(Arc<SimCard>, OffloadDevice)>;

/// The device map of `--device-map` over the execution device and each further `--card` (a simulated device of its
/// own, `cuda:1`, `cuda:2`, ...): `balanced` (diffusers' rule, printed), or `COMPONENT=DEVICE` pairs. Returns the
/// map and the further cards with their device objects.
fn device_map(
    args: &Generate,
    placement: &OffloadDevice,
    weights: &Path,
    explicit_reserve: Option<u64>,
) -> anyhow::Result<(DeviceMap, FurtherCards)> {
    // Each further --card is a simulated device of its own beside the first (cuda:1, cuda:2, ..), for the map.
    let mode = if args.card_mode == CardMode::Hard { Mode::Hard } else { Mode::Soft };
    let mut others: FurtherCards = Vec::new();
    for (label, device) in args.card.iter().zip(card_devices(args)?).skip(1) {
        let mut spec = CardSpec::parse(label)?.with_mode(mode).with_context_overhead(0);
        spec.device = device;
        let card = SimCard::new(spec);
        others.push((card.clone(), OffloadDevice::simulated(card)));
    }
    let map_text = args.device_map.as_deref().unwrap_or("");
    let mut map = DeviceMap::single(placement.clone());
    if map_text.trim() == "balanced" {
        let devices: Vec<OffloadDevice> =
            std::iter::once(placement.clone()).chain(others.iter().map(|(_, device)| device.clone())).collect();
        let sizes = pipeline_zimage::pipeline::component_weight_bytes(weights, args.dtype.load_dtype())?;
        let (balanced, placed) = DeviceMap::balanced(&devices, &sizes, explicit_reserve.unwrap_or(0))?;
        println!("device map balanced over {} device(s), largest first:", devices.len());
        for assignment in &placed.assignments {
            let device = assignment.device.map_or_else(
                || "cpu (larger than its turn's device had left)".to_string(),
                |i| devices[i].name().to_string(),
            );
            println!("  {} ({}) -> {device}", assignment.component, format_size(assignment.bytes));
        }
        map = balanced;
    } else {
        let real = real_execution(args);
        // Each further real device is opened once, however many components the map places on it.
        let mut opened: Vec<OffloadDevice> = Vec::new();
        for (component, device) in parse_device_map(map_text, &card_devices(args)?, real)? {
            if device.is_cpu() {
                map = map.with(&component, OffloadDevice::host_only())?;
            } else if let Some((_, other)) = others.iter().find(|(_, other)| *other.name() == device) {
                map = map.with(&component, other.clone())?;
            } else if real && device != *placement.name() {
                let further = match opened.iter().find(|opened| *opened.name() == device) {
                    Some(further) => further.clone(),
                    None => {
                        let further = further_real_device(&device, placement)?;
                        opened.push(further.clone());
                        further
                    }
                };
                map = map.with(&component, further)?;
            }
        }
    }
    Ok((map, others))
}

/// Keeps what a run on a real device measured beside the capacity profiles, for the next plan on it: the link's
/// rates, each component's footprint in the device's pages and its first call's.
fn record_measurements(
    args: &Generate,
    plan: Option<&pipeline_zimage::presets::PipelinePlan>,
    pipeline: &ZImagePipeline,
    name: &DeviceName,
) -> anyhow::Result<()> {
    let link = pipeline.placement().link().clone();
    // Kept beside the capacity profiles: the next plan on this device predicts from them.
    let store = match &plan {
        Some(plan) => plan.profile_store()?,
        None => profile_store(args, None)?,
    };
    if let Some(run) = LinkRun::from_rates(link.rate(), link.rate_of(false), link.rate_of(true)) {
        let measured = store.record_link(name.as_str(), run)?;
        let path = store.link_path(name.as_str());
        println!("link figures for later plans on {name}: {measured} ({})", path.display());
    }
    // What a real donor's copies onto the device reached, in place of its probe's or its declared rate next time.
    cli_donors::record_peer_rates(pipeline, &store)?;
    // What each component moved whole took in the device's pages, measured at its first onload.
    let footprints = pipeline.manager().device_footprints();
    if !footprints.is_empty() {
        store.record_footprints(name.as_str(), &footprints)?;
        println!("footprints for later plans on {name} ({}):", store.footprint_path(name.as_str()).display());
        for footprint in &footprints {
            println!("  {footprint}");
        }
    }
    // What each component's first call took in them, where it ran whole.
    let calls = pipeline.manager().call_footprints();
    if !calls.is_empty() {
        store.record_call_footprints(name.as_str(), &calls)?;
        println!("call footprints for later plans on {name} ({}):", store.footprint_path(name.as_str()).display());
        for call in &calls {
            println!("  {call}");
        }
    }
    Ok(())
}

/// The closing report on every device: the record, then a simulated card's peak and link (and each further
/// card's peak), or a real device's pool (and its cap). `whole_run_peak` turns a peak read now into the whole
/// run's (the per-phase peaks are reset as the run goes).
fn report_devices(
    pipeline: &ZImagePipeline,
    others: &[(Arc<SimCard>, OffloadDevice)],
    donors: &[cli_donors::Donor],
    whole_run_peak: &dyn Fn(u64) -> u64,
) -> anyhow::Result<()> {
    let placement = pipeline.placement();
    let name = placement.name();
    match (placement.account::<SimCard>(), placement.pool_readings()) {
        (Some(card), _) => {
            print_record(pipeline);
            println!(
                "\npeak on the simulated {} card: {}",
                card.spec().label,
                format_size(whole_run_peak(card.peak()))
            );
            let stats = card.stats();
            println!(
                "link: {} to the device ({} of it from pinned host memory), {:.3} s simulated",
                format_size(stats.bytes_to_device),
                format_size(stats.bytes_pinned_to_device),
                stats.transfer_seconds
            );
            cli_donors::print_donors(pipeline);
            // The peer meter's clock: on the CPU a copy from a simulated card is a host copy, not the card's link.
            for (peer, rate) in placement.peer_rates() {
                println!("copies from {peer}: {rate} (host copies: the simulated cards' link is priced above)");
            }
            for (other, device) in others {
                println!(
                    "peak on the simulated {} card {}: {}",
                    other.spec().label,
                    device.name(),
                    format_size(other.peak())
                );
            }
        }
        (None, Some(readings)) => {
            print_record(pipeline);
            print_pool(name, &readings, whole_run_peak(readings.peak()))?;
            // Each further real device the map placed a component on: its own pool, since it opened.
            let mut shown: Vec<&DeviceName> = vec![name];
            for (_, further) in &pipeline.device_map().components {
                if let Some(readings) = further.pool_readings().filter(|_| !shown.contains(&further.name())) {
                    print_pool(further.name(), &readings, readings.peak())?;
                    shown.push(further.name());
                }
            }
            // Each real donor's pool, and what it held of the transformer's groups.
            for (donor, readings) in cli_donors::real_donor_pools(donors, &shown) {
                print_pool(donor, &readings, readings.peak())?;
            }
            cli_donors::print_donors(pipeline);
            if readings.total_source() == group_offload::device::TotalSource::RuntimeHeap
                && let Err(why) = group_offload::device::runtime_budget(readings.burn_device())
            {
                println!("no heap budget read: {why}");
            }
            if let Some(cap) = placement.account::<CappedDevice>() {
                println!(
                    "capped at {} ({}): available under the cap now {}",
                    cap.label(),
                    if cap.is_hard() { "hard" } else { "soft" },
                    format_size(cap.available())
                );
            }
        }
        (None, None) => {}
    }
    Ok(())
}

/// One real device's pool after the run: the peak in use (`peak`, the whole run's), the reserved high-water, what
/// it holds now and where its total came from.
fn print_pool(name: &DeviceName, readings: &PoolReadings, peak: u64) -> anyhow::Result<()> {
    let now = readings.observe().map_err(group_offload::Error::from)?;
    println!(
        "device memory on {name} (burn's pool{}): peak in use {} (sampled every {} µs), reserved high-water {}, in \
         use now {}, reserved now {}, available now {} of {} ({})",
        if readings.has_driver_readings() { " and the driver" } else { "" },
        format_size(peak),
        PoolReadings::SAMPLE_EVERY.as_micros(),
        format_size(readings.reserved_peak()),
        format_size(now.in_use),
        format_size(now.reserved),
        format_size(now.available()),
        format_size(now.total),
        readings.total_source()
    );
    Ok(())
}

/// Applies `--lora` files to the pipeline in `mode`, says what they updated (and when a fused request ran at run
/// time), and gives back what removing them would need: a run never removes its LoRAs.
fn apply_loras(
    pipeline: &mut ZImagePipeline,
    loras: Vec<(LoraSpec, LoraFile)>,
    mode: LoraModeArg,
) -> anyhow::Result<()> {
    let applied = pipeline.set_lora_files(loras, mode.into())?;
    eprintln!(
        "lora ({}): {} file(s), {} transformer and {} text encoder layers updated{}{}",
        applied.mode(),
        applied.specs().len(),
        applied.layers(LoraTarget::Transformer),
        applied.layers(LoraTarget::TextEncoder),
        if applied.skipped().is_empty() {
            String::new()
        } else {
            format!(", {} keys skipped (layers the pipeline never runs)", applied.skipped().len())
        },
        if applied.fused_elements() == 0 {
            String::new()
        } else {
            format!("; {} elements fused", applied.fused_elements())
        }
    );
    if mode == LoraModeArg::Fused && applied.mode() == LoraMode::Runtime {
        eprintln!(
            "lora: applied at run time, not fused: the components read their weights from their checkpoint files, \
             and fusing would copy every updated layer into host memory"
        );
    }
    // A run applies its LoRAs once and never removes them: what removal would need is given back.
    let freed = pipeline.keep_loras();
    if freed > 0 {
        eprintln!(
            "lora: {} of removal records given back (this run never removes its LoRAs)",
            format_size(freed as u64)
        );
    }
    Ok(())
}

/// What the planner knows of the execution device: a simulated card's facts, or a real device's readings with the
/// link rate and footprints earlier runs on it measured (and its cap's label).
fn device_facts(placement: &OffloadDevice, settings: &Settings, host: HostMemory) -> anyhow::Result<DeviceFacts> {
    let name = placement.name();
    Ok(match placement.account::<SimCard>() {
        Some(card) => card.device_facts(host),
        None if name.is_cpu() => bail!("the offload planner needs a device to offload to (refused above)"),
        None => {
            let memory = placement.memory().clone().context("a real device has readings")?;
            // The link speed earlier runs measured on this device, in place of the generic assumption.
            let store = ProfileStore::from_settings(settings)?;
            let measured = store.measured_link(name.as_str())?;
            // What earlier runs measured each component's weights to take in this device's pages.
            let facts = DeviceFacts::new(memory, host)
                .with_measured_link(measured)
                .with_footprints(store.footprints(name.as_str())?)
                .with_call_footprints(store.call_footprints(name.as_str())?);
            match placement.account::<CappedDevice>() {
                Some(cap) => DeviceFacts { label: format!("{name} capped at {}", cap.label()), ..facts },
                None => facts,
            }
        }
    })
}

/// A reader of the device's peak in use since it last read, for each phase's host budget line: a simulated card's
/// own peak, or a real device's pool high-water, each reset as it is read; `run_peak` keeps the highest reading,
/// the whole run's. 0 where nothing reads the device.
fn phase_peak(
    placement: &OffloadDevice,
    run_peak: Arc<std::sync::atomic::AtomicU64>,
) -> Arc<dyn Fn() -> u64 + Send + Sync> {
    match (placement.account::<SimCard>(), placement.pool_readings()) {
        (Some(card), _) => {
            let (card, run_peak) = (card.clone(), run_peak.clone());
            Arc::new(move || {
                let peak = card.peak();
                run_peak.fetch_max(peak, std::sync::atomic::Ordering::Relaxed);
                card.reset_peak();
                peak
            })
        }
        (None, Some(readings)) => {
            let run_peak = run_peak.clone();
            Arc::new(move || {
                let peak = readings.peak();
                run_peak.fetch_max(peak, std::sync::atomic::Ordering::Relaxed);
                let _ = readings.reset_peak();
                peak
            })
        }
        (None, None) => Arc::new(|| 0),
    }
}

/// Prints the manager's decisions as the anchor's table, then one line for the group offloaders' moves, which the
/// trace (`--trace`) shows one by one.
fn print_record(pipeline: &ZImagePipeline) {
    let record = pipeline.manager().offload_record();
    println!("\n{}", record.decisions());
    let moves = record.group_moves().events();
    if !moves.is_empty() {
        let uploads: Vec<_> = moves.iter().filter(|e| e.action == offload_core::Action::Onload).collect();
        let prefetched = uploads.iter().filter(|e| matches!(e.reason, Some(offload_core::Reason::Prefetch))).count();
        let refused = moves.iter().filter(|e| e.is_refusal()).count();
        let mut peers: Vec<(&str, usize)> = Vec::new();
        for peer in uploads.iter().filter_map(|e| e.from_peer.as_deref()) {
            match peers.iter_mut().find(|(name, _)| *name == peer) {
                Some((_, count)) => *count += 1,
                None => peers.push((peer, 1)),
            }
        }
        let from_peers: String = peers.iter().map(|(peer, count)| format!(", {count} copied from {peer}")).collect();
        println!(
            "group moves: {} uploads ({}), {prefetched} of them prefetched{from_peers}, {} releases, {refused} refused \
             (rows of the record's group moves; --trace shows each on its thread)",
            uploads.len(),
            format_size(uploads.iter().map(|e| e.bytes).sum()),
            moves.iter().filter(|e| e.action == offload_core::Action::Offload).count()
        );
    }
    // Several devices (a --device-map): every device's decisions in one table, a column naming the device.
    let map = pipeline.device_map();
    if !map.components.is_empty() {
        let mut devices = vec![(map.default.name().clone(), pipeline.manager().offload_record())];
        for (_, placed) in &map.components {
            if !devices.iter().any(|(name, _)| name == placed.name()) {
                devices.push((placed.name().clone(), placed.manager().offload_record()));
            }
        }
        println!("\nevery device's decisions:\n{}", offload_core::DeviceRecords::new(devices).decisions());
    }
}

/// The bytes of the components' weights as loaded (in host memory until the manager moves them).
fn loaded_weight_bytes(pipeline: &ZImagePipeline) -> u64 {
    pipeline
        .components()
        .map(|c| c.id())
        .into_iter()
        .filter_map(|id| pipeline.managers().find_map(|manager| manager.component_info(id).ok()))
        .map(|info| info.bytes)
        .sum()
}

/// One image of `--images N`: its wall time (a clock) and what the offload record shows moving during it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ImageFigures {
    seconds: f64,
    onloads: usize,
    bytes_onloaded: u64,
    offloads: usize,
}

impl ImageFigures {
    fn of(elapsed: std::time::Duration, events: &[offload_core::OffloadEvent]) -> Self {
        let onloads = events.iter().filter(|e| e.action == offload_core::Action::Onload);
        Self {
            seconds: elapsed.as_secs_f64(),
            onloads: onloads.clone().count(),
            bytes_onloaded: onloads.map(|e| e.bytes).sum(),
            offloads: events.iter().filter(|e| e.action == offload_core::Action::Offload).count(),
        }
    }

    /// Images 2 to N side by side: their spread in wall time (slowest ÷ fastest − 1) and whether each moved what
    /// the second did. `None` with fewer than three images (nothing to compare the second with).
    fn after_the_first(images: &[ImageFigures]) -> Option<String> {
        let later = images.get(1..).filter(|later| later.len() >= 2)?;
        let fastest = later.iter().map(|f| f.seconds).fold(f64::INFINITY, f64::min);
        let slowest = later.iter().map(|f| f.seconds).fold(0.0, f64::max);
        let same = later.iter().all(|f| {
            (f.onloads, f.bytes_onloaded, f.offloads) == (later[0].onloads, later[0].bytes_onloaded, later[0].offloads)
        });
        Some(format!(
            "images 2 to {}: wall time {:.3} to {:.3} s (spread {:.1}%), {}",
            images.len(),
            fastest,
            slowest,
            (slowest / fastest.max(f64::MIN_POSITIVE) - 1.0) * 100.0,
            if same { "each moved what image 2 moved" } else { "their moves differ (see each image's line)" }
        ))
    }
}

/// `path` for image `index` of `images`: itself for a single image, `stem-N.ext` (N from 1) for several.
fn numbered(path: &Path, index: usize, images: usize) -> PathBuf {
    if images == 1 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}-{}.{}", index + 1, ext.to_string_lossy()),
        None => format!("{stem}-{}", index + 1),
    };
    path.with_file_name(name)
}

/// The name the measured read rates of a checkpoint's disk are stored under: the checkpoint directory, resolved.
fn disk_label(weights: &Path) -> String {
    weights.canonicalize().unwrap_or_else(|_| weights.to_path_buf()).display().to_string()
}

/// Prints each component's reads from its checkpoint files (median and 10th percentile of the rate), stores them
/// beside the capacity profiles for the next plan, and says once when the reads made a step slower than the plan
/// predicted by more than a quarter, with the likely reason and what to do.
fn report_file_reads(
    pipeline: &ZImagePipeline,
    plan: &pipeline_zimage::presets::PipelinePlan,
    weights: &Path,
    steps: usize,
) -> anyhow::Result<()> {
    let store = plan.profile_store()?;
    let label = disk_label(weights);
    let time = plan.plan.machine.time;
    let mut warned = false;
    for component in pipeline.components() {
        let Some(table) = pipeline.file_table(component.name()) else { continue };
        let meter = table.meter();
        let Some(rate) = meter.rate() else { continue };
        println!("disk, {}'s checkpoint files: {rate}", component.name());
        if let Some(run) = offload_core::plan::DiskRun::from_rate(Some(rate)) {
            store.record_disk(&label, run)?;
        }
        // The plan's file reads per step against the measured ones: the bytes it streams each step at the rate it
        // assumed, beside the seconds the reads took per step.
        let Some(planned) = plan.plan.component(component.name()) else { continue };
        let calls = if component.name() == "transformer" { steps.max(1) } else { 1 };
        let totals = meter.totals();
        let measured = totals.seconds / calls as f64;
        let predicted = planned.streamed_per_step as f64 / time.disk_bytes_per_second;
        // A quarter slower than the plan's step, and by at least 10 ms a call: tiny reads vary by more than that.
        let slower = measured - predicted;
        let matters = slower > 0.25 * planned.seconds_per_step.max(predicted) && slower > 0.010;
        if !warned && planned.host_tier.reads_disk() && predicted > 0.0 && matters {
            warned = true;
            eprintln!(
                "file reads: {}'s reads took {measured:.2} s per call against the {predicted:.2} s the plan \
                 predicted ({}) at {} ({}): the measured median was {}, so the page cache was cold or \
                 the disk is slower than assumed; give the plan more RAM with --ram SIZE so copies stay in host \
                 memory, or run again: the next plan predicts from this run's rate",
                component.name(),
                format_size(planned.streamed_per_step),
                format_rate(time.disk_bytes_per_second),
                time.disk_source,
                format_rate(rate.median)
            );
        }
    }
    Ok(())
}

/// One line of the host budget for `phase` (`load`, `encode`, `denoise`, `decode`), as the real-size benchmark
/// reads it: the process's anonymous peak during the phase (sampled), the device's peak in use during it (on the
/// CPU backend a simulated card's tensors live in the same RAM, so the host's own copies are the difference) and the
/// weights' bytes.
fn host_budget_line(phase: &str, anonymous_peak: u64, device_peak: u64, weights: u64) -> String {
    format!("host_budget phase={phase} anonymous_peak={anonymous_peak} card_peak={device_peak} weights={weights}")
}

/// Prints each component's loaded bytes and the host's peak after loading, then starts a new peak and has the
/// pipeline print each phase's peak as it finishes (`--memory-report`).
fn report_loaded(pipeline: &ZImagePipeline, anonymous: &pipeline_zimage::host::AnonymousPeak, device_peak: u64) {
    use pipeline_zimage::host::{peak_resident_bytes, reset_peak_resident, resident_bytes};
    let mut weights = 0;
    for (component, id) in pipeline.components().map(|c| (c.name(), c.id())) {
        let bytes =
            pipeline.managers().find_map(|manager| manager.component_info(id).ok()).map_or(0, |info| info.bytes);
        weights += bytes;
        println!("memory: loaded {component}: {bytes} bytes ({})", format_size(bytes));
    }
    println!(
        "memory: weights {weights} bytes ({}); host peak while loading {} bytes ({}), anonymous {} bytes; resident \
         now {} bytes",
        format_size(weights),
        peak_resident_bytes(),
        format_size(peak_resident_bytes()),
        anonymous.peak(),
        resident_bytes()
    );
    println!("{}", host_budget_line("load", anonymous.peak(), device_peak, weights));
    if let Err(error) = reset_peak_resident() {
        println!("memory: cannot reset the peak ({error}); phase peaks count from the start");
    }
    anonymous.reset();
}

/// Every exit goes through here: `generate` has returned, so the pipeline and its components are dropped; the
/// devices the process opened are then drained (their queued work waited for, so no runtime thread is still
/// working when the process leaves), and the exit code says what happened: 0 for success, 1 for an error, which
/// is printed with its causes. `std::process::exit` is never called mid-flight.
fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().command {
        Command::Generate(args) => generate(&args),
    };
    let drained = group_offload::device::drain_devices();
    match (result, drained) {
        (Ok(()), Ok(())) => std::process::ExitCode::SUCCESS,
        (Err(error), _) => {
            eprintln!("Error: {error:?}");
            std::process::ExitCode::FAILURE
        }
        (Ok(()), Err(error)) => {
            eprintln!("Error: the image was written, but the device did not finish cleanly: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use offload_core::plan::{Origin, Preset};

    fn args(extra: &[&str]) -> Generate {
        let argv = ["pipeline-zimage", "generate"].iter().chain(extra).copied();
        match Cli::try_parse_from(argv).map(|cli| cli.command) {
            Ok(Command::Generate(args)) => *args,
            Err(error) => panic!("{error}"),
        }
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// The README's `generate` commands that run on the CPU (no `--features`), each argument list as written, with
    /// the files they write sent to a temporary directory.
    fn readme_cpu_commands() -> Vec<Vec<String>> {
        let readme =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md")).expect("the README");
        let mut commands = Vec::new();
        let mut lines = readme.lines();
        while let Some(line) = lines.next() {
            let Some(rest) = line.trim().strip_prefix("cargo run --release -p pipeline-zimage -- generate") else {
                continue;
            };
            let mut command = rest.trim().to_string();
            while command.ends_with('\\') {
                command.pop();
                command.push(' ');
                command.push_str(lines.next().expect("a continued line").trim());
            }
            commands.push(split_shell_words(&command));
        }
        commands
    }

    /// Splits a command line as a shell would for these commands: on spaces, with double quotes kept together.
    fn split_shell_words(line: &str) -> Vec<String> {
        let (mut words, mut word, mut quoted) = (Vec::new(), String::new(), false);
        for c in line.chars() {
            match c {
                '"' => quoted = !quoted,
                ' ' if !quoted => {
                    if !word.is_empty() {
                        words.push(std::mem::take(&mut word));
                    }
                }
                c => word.push(c),
            }
        }
        if !word.is_empty() {
            words.push(word);
        }
        words
    }

    /// What a user is shown, CI runs: every README command that runs on the CPU goes through the CLI's own parse
    /// and `generate`, with the README's arguments (only the output files moved to a temporary directory). The
    /// README shows them with `--release`; the test runs the same argument lists in the test profile.
    #[test]
    fn every_readme_command_that_runs_on_the_cpu_runs() {
        let commands = readme_cpu_commands();
        assert!(commands.len() >= 7, "the README's CPU commands: {commands:?}");
        let dir = std::env::temp_dir().join(format!("pipeline-zimage-readme-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        for (index, command) in commands.iter().enumerate() {
            let mut argv: Vec<String> = Vec::new();
            let mut words = command.iter();
            while let Some(word) = words.next() {
                argv.push(word.clone());
                if ["--out", "--trace", "--memory-plot"].contains(&word.as_str()) {
                    let file = words.next().expect("a file name");
                    argv.push(dir.join(format!("{index}-{file}")).display().to_string());
                }
                // The README runs from the repository's root; the test from the crate's.
                if word == "--lora" {
                    let file = words.next().expect("a LoRA file");
                    argv.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(file).display().to_string());
                }
            }
            if !argv.iter().any(|word| word == "--out") {
                argv.extend(["--out".to_string(), dir.join(format!("{index}-zimage.png")).display().to_string()]);
            }
            let words: Vec<&str> = argv.iter().map(String::as_str).collect();
            let parsed = args(&words);
            if let Err(error) = generate(&parsed) {
                panic!("README command `generate {}` failed: {error:#}", command.join(" "));
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The fuzzer's target for the CLI: lines `flag=value` become `--flag value`; whatever the values, parsing
    /// and the pre-flight checks return (an error is fine) and never panic.
    fn cli_target(input: &[u8]) {
        let Ok(text) = std::str::from_utf8(input) else { return };
        let mut argv = vec!["pipeline-zimage".to_string(), "generate".to_string()];
        for (flag, value) in text.lines().filter_map(|line| line.split_once('=')) {
            argv.push(format!("--{}", flag.trim()));
            argv.push(value.to_string());
        }
        if let Ok(Command::Generate(args)) = Cli::try_parse_from(&argv).map(|cli| cli.command) {
            let _ = preflight(&args);
        }
    }

    fn cli_corpus() -> Vec<Vec<u8>> {
        ::tests::fuzz::corpus(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/cli"))
    }

    #[test]
    fn the_clis_numeric_arguments_survive_a_short_fuzz_run() {
        let seeds = cli_corpus();
        assert!(seeds.len() >= 3, "the cli corpus");
        let report = ::tests::fuzz::fuzz("cli", &seeds, 20_000, 3, cli_target);
        assert!(report.crashes.is_empty(), "{report}: {:?}", report.crashes);
    }

    /// `cargo xtask fuzz --target cli` runs this with `CLI_FUZZ_EXECUTIONS` (a million by default).
    #[test]
    #[ignore = "long: run by `cargo xtask fuzz`"]
    fn fuzz_the_clis_numeric_arguments() {
        let executions = std::env::var("CLI_FUZZ_EXECUTIONS").ok().and_then(|n| n.parse().ok()).unwrap_or(1_000_000);
        let seed = std::env::var("CLI_FUZZ_SEED").ok().and_then(|n| n.parse().ok()).unwrap_or(0x5eed);
        let report = ::tests::fuzz::fuzz("cli", &cli_corpus(), executions, seed, cli_target);
        println!("{report}");
        assert!(report.crashes.is_empty(), "{report}: {:?}", report.crashes);
    }

    #[test]
    fn a_device_map_is_checked_before_anything_loads() {
        let wgpu = DeviceName::parse("wgpu").expect("a name");
        let pairs = parse_device_map("text_encoder=cpu, vae=wgpu", std::slice::from_ref(&wgpu), true).expect("a map");
        assert_eq!(pairs, [("text_encoder".to_string(), DeviceName::cpu()), ("vae".to_string(), wgpu.clone())]);
        // Beside a real execution device, another real one by name: opened before the weights load.
        let pairs = parse_device_map("text_encoder=wgpu:1", std::slice::from_ref(&wgpu), true).expect("a second");
        assert_eq!(pairs, [("text_encoder".to_string(), DeviceName::parse("wgpu:1").expect("a name"))]);
        for (map, says) in [
            ("unet=cpu", "\"unet\" is not a component; use one of: text_encoder, transformer, vae"),
            ("vae=cpu,vae=cpu", "vae is placed twice"),
            ("text_encoder", "write each entry as COMPONENT=DEVICE"),
            ("text_encoder=tpu:1", "place text_encoder on cpu, wgpu:0 or another device of this machine by name"),
        ] {
            let error = parse_device_map(map, std::slice::from_ref(&wgpu), true).expect_err(map);
            assert!(matches!(error, ArgumentError::DeviceMap { .. }) && error.to_string().contains(says), "{error}");
        }
        // Further cards are further simulated devices on the CPU, by index; `balanced` is a whole map.
        let cards = card_devices(&args(&["--card", "8GB", "--card", "4GB"])).expect("two cards");
        assert_eq!(cards.iter().map(DeviceName::to_string).collect::<Vec<_>>(), ["cuda:0", "cuda:1"]);
        let pairs = parse_device_map("text_encoder=cuda:1", &cards, false).expect("the second card");
        assert_eq!(pairs, [("text_encoder".to_string(), cards[1].clone())]);
        assert_eq!(parse_device_map("balanced", &cards, false).expect("balanced"), []);
        let error = parse_device_map("vae=cuda:2", &cards, false).expect_err("no third card");
        assert!(error.to_string().contains("place vae on cpu or cuda:0 or cuda:1"), "{error}");
        let error = card_devices(&args(&["--device", "wgpu", "--card", "8GB", "--card", "4GB"])).expect_err("caps");
        assert!(matches!(error, ArgumentError::Cards { cards: 2, .. }), "{error}");
        assert!(error.to_string().contains("with --device wgpu:0: on a real device one --card caps it"), "{error}");
        // Through generate, before the weights would load (a directory that is no checkpoint).
        let missing = std::env::temp_dir().join("pipeline-zimage-no-checkpoint-here");
        let weights = missing.display().to_string();
        let error = generate(&args(&["--weights", &weights, "--device-map", "unet=cpu"])).expect_err("refused");
        assert!(error.to_string().starts_with("--device-map \"unet=cpu\""), "{error:#}");
    }

    #[test]
    fn a_donor_is_a_further_card_and_a_known_link() {
        use cli_donors::parse_donor;
        let cards = card_devices(&args(&["--card", "8GB", "--card", "4GB"])).expect("two cards");
        let (device, link) = parse_donor("cuda:1@nvlink", &cards, false).expect("the second card over NVLink");
        assert_eq!((device.as_str(), link.map(|link| link.name)), ("cuda:1", Some("nvlink")));
        for (given, says) in [
            ("cuda:1", "give DEVICE@LINK"),
            ("cuda:0@nvlink", "cuda:0 is not a further card; the further cards are cuda:1"),
            ("cuda:2@nvlink", "cuda:2 is not a further card"),
            ("cuda:1@usb", "nvlink, pcie4x16, pcie3x8"),
        ] {
            let error = parse_donor(given, &cards, false).expect_err(given);
            assert!(matches!(error, ArgumentError::Donor { .. }) && error.to_string().contains(says), "{error}");
        }
        let one = card_devices(&args(&["--card", "8GB"])).expect("one card");
        let error = parse_donor("cuda:1@nvlink", &one, false).expect_err("no further card");
        assert!(error.to_string().contains("add a second --card"), "{error}");
        // Through the pre-flight, before anything loads.
        let error = preflight(&args(&["--card", "8GB", "--donor", "cuda:1@nvlink"])).expect_err("refused");
        assert!(error.to_string().starts_with("--donor cuda:1@nvlink: no further card"), "{error:#}");
        // The same card twice, whatever its links.
        let twice = ["--card", "8GB", "--card", "8GB", "--donor", "cuda:1@nvlink", "--donor", "cuda:1@pcie3x8"];
        let error = preflight(&args(&twice)).expect_err("refused");
        assert_eq!(
            error.to_string(),
            "--donor cuda:1@pcie3x8: cuda:1 is given as a donor twice; give each further device once"
        );
    }

    /// Beside a real execution device a donor is another real device by name; its link is optional (without
    /// one its copies are timed), and the execution device itself or a simulated kind is refused before anything
    /// opens.
    #[test]
    fn beside_a_real_device_a_donor_is_another_real_device_its_link_optional() {
        use cli_donors::parse_donor;
        let wgpu = card_devices(&args(&["--device", "wgpu"])).expect("the execution device");
        let (device, link) = parse_donor("wgpu:1", &wgpu, true).expect("a second adapter, its rate measured");
        assert_eq!((device.as_str(), link.is_none()), ("wgpu:1", true));
        let (device, link) = parse_donor("cuda:1@pcie4x16", &wgpu, true).expect("a declared link");
        assert_eq!((device.as_str(), link.map(|link| link.name)), ("cuda:1", Some("pcie4x16")));
        for given in ["wgpu", "wgpu:0@nvlink", "cpu", "tpu:1"] {
            let error = parse_donor(given, &wgpu, true).expect_err(given);
            assert!(
                error.to_string().contains("name another device of this machine than the execution device wgpu:0"),
                "{error}"
            );
        }
        let twice = ["--device", "wgpu", "--donor", "wgpu:1", "--donor", "wgpu:1@nvlink"];
        let error = preflight(&args(&twice)).expect_err("refused");
        assert!(error.to_string().contains("wgpu:1 is given as a donor twice"), "{error}");
        preflight(&args(&["--device", "wgpu", "--donor", "wgpu:1"])).expect("a real donor passes the pre-flight");
    }

    #[test]
    fn seeds_and_sides_are_checked_before_anything_loads() {
        let error = check_arguments(&args(&["--seed", "18446744073709551615", "--images", "2"])).expect_err("overflow");
        assert!(matches!(error, ArgumentError::SeedOverflow { images: 2, .. }), "{error}");
        assert!(error.to_string().contains("pass a --seed of at most 18446744073709551614"), "{error}");
        assert!(check_arguments(&args(&["--seed", "18446744073709551615"])).is_ok());
        assert!(check_arguments(&args(&["--seed", "18446744073709551614", "--images", "2"])).is_ok());
        // The library bounds the sides (and every other count); the CLI asks it before anything loads.
        let error = preflight(&args(&["--height", "18446744073709551615"])).expect_err("too tall");
        assert!(
            error.to_string().starts_with("invalid height: 18446744073709551615 is more than the largest"),
            "{error}"
        );
        let error = preflight(&args(&["--width", "16400"])).expect_err("too wide");
        assert!(error.to_string().contains("(16384 pixels); pass a smaller value"), "{error}");
        for images in ["0", "100001", "1000000000000000"] {
            let error = check_arguments(&args(&["--images", images])).expect_err("images");
            assert!(matches!(error, ArgumentError::ImageCount { .. }), "{error}");
        }
        // Through generate, the refusal comes before the weights would load (a directory that is no checkpoint).
        let missing = std::env::temp_dir().join("pipeline-zimage-no-checkpoint-here");
        let weights = missing.display().to_string();
        let error = generate(&args(&["--weights", &weights, "--seed", "18446744073709551615", "--images", "3"]))
            .expect_err("refused");
        assert!(error.to_string().starts_with("--seed 18446744073709551615 with --images 3"), "{error:#}");
    }

    #[test]
    fn a_reserve_the_card_cannot_hold_is_refused_before_the_weights_load() {
        let missing = std::env::temp_dir().join("pipeline-zimage-no-checkpoint-here");
        let weights = missing.display().to_string();
        let error =
            generate(&args(&["--weights", &weights, "--card", "12MB", "--offload", "group", "--reserve", "3GB"]))
                .expect_err("refused");
        let message = format!("{error:#}");
        assert!(message.contains("the reserve (2.79 GB) is not smaller than the memory left"), "{message}");
        assert!(!message.contains("loading"), "refused before loading: {message}");
    }

    #[test]
    fn the_planner_runs_for_a_preset_or_a_settings_source_without_offload() {
        assert!(uses_planner(&args(&["--preset", "auto"]), &[]));
        assert!(uses_planner(&args(&["--preset", "auto", "--offload", "group"]), &[]));
        assert!(!uses_planner(&args(&[]), &[]));
        assert!(!uses_planner(&args(&["--offload", "auto"]), &env(&[("OFFLOAD_PRESET", "no_pin")])));
        assert!(uses_planner(&args(&[]), &env(&[("OFFLOAD_PRESET", "no_pin")])));
        assert!(uses_planner(&args(&["--set", "prefetch=false"]), &[]));
    }

    #[test]
    fn every_output_file_is_checked_before_the_run_with_the_fix_in_the_message() {
        let dir = std::env::temp_dir().join(format!("pipeline-zimage-cli-outputs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let at = |name: &str| dir.join(name).display().to_string();
        let message = |extra: &[&str]| {
            let parsed = args(extra);
            check_outputs(&outputs(&parsed), &input_paths(&parsed)).expect_err("refused").to_string()
        };
        let shown = dir.display().to_string();
        let error = message(&["--trace", &shown]);
        assert!(error.starts_with(&format!("--trace {shown}: it is a directory; give a file name in it")), "{error}");
        let error = message(&["--trace", &at("missing/run.json")]);
        assert!(error.contains("missing does not exist; create it first or write elsewhere"), "{error}");
        let error = message(&["--memory-plot", &at("memory.jpg")]);
        assert!(error.ends_with("memory.jpg: the file is written as a PNG image (this build encodes no other image format); give a name ending in .png"), "{error}");
        let error = message(&["--out", &at("image.jpg")]);
        assert!(error.starts_with("--out "), "{error}");
        // A good path is accepted and left as it was: nothing created, an existing file kept.
        let fresh = dir.join("run.json");
        let good = args(&["--out", &at("image.png"), "--trace", &at("run.json"), "--memory-plot", &at("memory.PNG")]);
        check_outputs(&outputs(&good), &input_paths(&good)).expect("writable");
        assert!(!fresh.exists());
        std::fs::write(&fresh, "kept").expect("written");
        check_outputs(&outputs(&good), &input_paths(&good)).expect("writable");
        assert_eq!(std::fs::read_to_string(&fresh).expect("read"), "kept");
        // Several images: every numbered name is an output.
        let several = args(&["--out", &at("image.png"), "--images", "3", "--out-tensor", &at("image.safetensors")]);
        let names: Vec<String> = outputs(&several).iter().map(|o| o.path.display().to_string()).collect();
        assert_eq!(names.len(), 6);
        assert!(names.contains(&at("image-3.png")) && names.contains(&at("image-2.safetensors")), "{names:?}");
        // The flags parse.
        let parsed = args(&["--trace", "t.json", "--memory-plot", "m.png", "--plot-font", "f.ttf"]);
        assert_eq!(parsed.trace.as_deref(), Some(Path::new("t.json")));
        assert_eq!(parsed.memory_plot.as_deref(), Some(Path::new("m.png")));
        assert_eq!(parsed.plot_font.as_deref(), Some(Path::new("f.ttf")));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn explicit_arguments_beat_the_environment_which_beats_the_file() {
        let dir = std::env::temp_dir().join(format!("pipeline-zimage-cli-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let file = dir.join("offload.toml");
        std::fs::write(&file, "preset = \"one_shot_fast\"\nprefetch_depth = 3\nblocks_per_group = 2\n")
            .expect("written");
        let config = file.display().to_string();
        let environment = env(&[("OFFLOAD_PRESET", "no_pin"), ("OFFLOAD_PREFETCH_DEPTH", "2")]);

        let (settings, simulated) =
            resolve_settings(&args(&["--config", &config, "--set", "prefetch_depth=4"]), &environment, None)
                .expect("valid");
        assert!(!simulated);
        assert_eq!(settings.preset, Preset::NoPin);
        assert_eq!(settings.prefetch_depth, 4);
        assert_eq!(settings.blocks_per_group, 2);
        assert_eq!(settings.origin("blocks_per_group"), Origin::File);
        let (settings, _) =
            resolve_settings(&args(&["--config", &config, "--preset", "auto"]), &environment, None).expect("valid");
        assert_eq!(settings.preset, Preset::Auto);
        assert_eq!(settings.prefetch_depth, 2);

        // The simulated card's reserve applies only when nothing sets one.
        let (settings, simulated) = resolve_settings(&args(&["--preset", "auto"]), &[], Some(1234)).expect("valid");
        assert!(simulated);
        assert_eq!(settings.reserve, Some(1234));
        let (settings, simulated) =
            resolve_settings(&args(&["--preset", "auto"]), &env(&[("OFFLOAD_RESERVE", "2MB")]), Some(1234))
                .expect("valid");
        assert!(!simulated);
        assert_eq!(settings.reserve, Some(2_000_000));

        let error = resolve_settings(&args(&["--set", "prefetch"]), &[], None).expect_err("not key=value");
        assert!(error.to_string().contains("is not key=value"), "{error}");
        let error = resolve_settings(&args(&["--preset", "fast"]), &[], None).expect_err("unknown preset");
        assert!(error.to_string().starts_with("invalid value \"fast\" for setting preset"), "{error}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
