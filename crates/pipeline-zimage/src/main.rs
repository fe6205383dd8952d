//! `pipeline-zimage generate`: make an image with Z-Image(-Turbo) from a diffusers checkpoint directory, on the
//! CPU or a CUDA device, optionally on a simulated smaller card, with auto or group offload.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use burn::tensor::{DType, Device, Tensor, TensorData};
use clap::{Parser, Subcommand, ValueEnum};
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::{DeviceLedger, DeviceMemory, DeviceName, NoLedger, parse_size};
use pipeline_zimage::loading::LoadOptions;
use pipeline_zimage::offload::Placement;
use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};

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
    /// Every component stays where it is loaded: on the execution device.
    None,
    /// Components move onto the device when they run; the strategy evicts others to make room.
    Auto,
    /// Auto offload, with the transformer streamed block by block (group offload, prefetched).
    Group,
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
    /// Height in pixels, a multiple of 16.
    #[arg(long, default_value_t = 1024)]
    height: usize,
    /// Width in pixels, a multiple of 16.
    #[arg(long, default_value_t = 1024)]
    width: usize,
    /// Prompt tokens kept.
    #[arg(long, default_value_t = 512)]
    max_sequence_length: usize,
    /// Seed of the initial noise.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A safetensors file with a tensor named `latents` [1, 16, H/8, W/8]: the initial noise of a diffusers run.
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
    /// The execution device: cpu or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Simulate a card of this size (or a catalogue name) on the device: hard mode, allocations past it fail.
    #[arg(long)]
    card: Option<String>,
    /// How components are offloaded.
    #[arg(long, value_enum, default_value_t = Offload::None)]
    offload: Offload,
    /// Memory kept free for activations by auto offload.
    #[arg(long, default_value = "3GB")]
    reserve: String,
    /// Load weights in bf16 instead of the checkpoint's dtype cast to f32.
    #[arg(long)]
    bf16: bool,
}

fn default_weights() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-z-image-turbo")
}

fn burn_device(name: &str) -> anyhow::Result<(Device, DeviceName)> {
    let parsed = DeviceName::parse(name)?;
    match parsed.kind() {
        "cpu" => Ok((Device::flex(), parsed)),
        "cuda" => cuda_device(&parsed),
        other => bail!("unknown device kind {other:?}: use cpu or cuda:N"),
    }
}

#[cfg(feature = "cuda")]
fn cuda_device(name: &DeviceName) -> anyhow::Result<(Device, DeviceName)> {
    let index: usize = name.as_str().split(':').nth(1).unwrap_or("0").parse()?;
    Ok((Device::cuda(index), name.clone()))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_: &DeviceName) -> anyhow::Result<(Device, DeviceName)> {
    bail!("this binary was built without CUDA: run `cargo xtask setup-cuda`, then build with `--features cuda`")
}

fn read_latents(path: &Path) -> anyhow::Result<Tensor<4>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file = safetensors::SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{} is not a safetensors file", path.display()))?;
    let view = file.tensor("latents").with_context(|| format!("{} has no tensor named `latents`", path.display()))?;
    let shape: Vec<usize> = view.shape().to_vec();
    let [a, b, c, d] = shape[..] else { bail!("`latents` in {} has shape {shape:?}, not 4 dimensions", path.display()) };
    let values: Vec<f32> = match view.dtype() {
        safetensors::Dtype::F32 => view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        safetensors::Dtype::BF16 => view.data().chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        safetensors::Dtype::F16 => view.data().chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
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

fn write_outputs(image: Tensor<4>, out: &Path, out_tensor: Option<&Path>) -> anyhow::Result<()> {
    let [_, _, height, width] = image.dims();
    let values: Vec<f32> = image.into_data().try_into_vec_as::<f32>().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    if let Some(path) = out_tensor {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 3, height, width], &bytes)?;
        safetensors::serialize_to_file([("image", view)], None, path)?;
    }
    let mut png = image::RgbImage::new(width as u32, height as u32);
    for (x, y, pixel) in png.enumerate_pixels_mut() {
        for c in 0..3 {
            let v = values[c * height * width + y as usize * width + x as usize];
            pixel[c] = (v * 255.0).round().clamp(0.0, 255.0) as u8;
        }
    }
    png.save(out).with_context(|| format!("cannot write {}", out.display()))?;
    Ok(())
}

fn generate(args: &Generate) -> anyhow::Result<()> {
    let weights = args.weights.clone().unwrap_or_else(default_weights);
    let reserve = parse_size(&args.reserve).context("--reserve")?;
    let (exec, exec_name) = burn_device(&args.device)?;
    let card = args
        .card
        .as_deref()
        .map(|label| -> anyhow::Result<Arc<SimCard>> {
            let spec = CardSpec::parse(label)?.with_mode(Mode::Hard).with_context_overhead(0);
            spec.check_reserve(reserve)?;
            Ok(SimCard::new(spec))
        })
        .transpose()?;
    let (name, ledger): (DeviceName, Arc<dyn DeviceLedger>) = match &card {
        Some(card) => (card.device(), card.clone()),
        None => (exec_name.clone(), Arc::new(NoLedger)),
    };
    if args.offload != Offload::None && card.is_none() {
        bail!(
            "--offload {} needs device readings: pass --card SIZE (your card's size, or a smaller one to simulate); \
             burn exposes no free-memory call",
            if args.offload == Offload::Auto { "auto" } else { "group" }
        );
    }
    let placement = Placement { exec: exec.clone(), host: Device::flex(), name, ledger };
    let dtype = if args.bf16 { Some(DType::BF16) } else { Some(DType::F32) };
    let mut pipeline = ZImagePipeline::load(&weights, placement, &LoadOptions::new().with_dtype(dtype))
        .with_context(|| format!("loading {}", weights.display()))?;
    for report in pipeline.load_reports() {
        eprintln!("{report}");
    }
    if let Some(card) = &card {
        if args.offload == Offload::Group {
            pipeline.enable_group_offload(card.clone(), Some(card.clone()), 1, 1)?;
        }
        let memory: Arc<dyn DeviceMemory> = card.clone();
        pipeline.enable_auto_offload(memory, reserve, true)?;
    }
    let mut opts = GenerateOptions::turbo(args.prompt.clone());
    opts.negative_prompt = args.negative_prompt.clone();
    opts.steps = args.steps;
    opts.guidance = args.guidance;
    opts.height = args.height;
    opts.width = args.width;
    opts.max_sequence_length = args.max_sequence_length;
    opts.seed = args.seed;
    opts.strength = args.strength;
    opts.latents = args.latents.as_deref().map(read_latents).transpose()?;
    opts.image = args.image.as_deref().map(|p| read_image(p, args.height, args.width)).transpose()?;
    opts.validate()?;
    let bar = indicatif::ProgressBar::new(args.steps as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("denoising {bar:40} {pos}/{len} [{elapsed_precise}]")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let image = pipeline.generate(&opts, &mut |step, total| {
        bar.set_length(total as u64);
        bar.set_position(step as u64);
    })?;
    bar.finish();
    write_outputs(image, &args.out, args.out_tensor.as_deref())?;
    println!("wrote {}", args.out.display());
    if let Some(card) = &card {
        println!("\n{}", pipeline.manager().offload_record());
        println!("\npeak on the simulated {} card: {}", card.spec().label, offload_core::format_size(card.peak()));
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).init();
    match Cli::parse().command {
        Command::Generate(args) => generate(&args),
    }
}
