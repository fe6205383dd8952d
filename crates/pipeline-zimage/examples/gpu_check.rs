//! The checks to run on an accelerator, in one binary (so one compressed file travels to the device machine):
//!
//! - `parity`: the three whole-pipeline goldens of the tiny checkpoint (text-to-image, with guidance,
//!   image-to-image) on the given device, with every component onloaded there through the manager; prints the
//!   max abs error of each against diffusers' output.
//! - `readings`: the tiny pipeline under auto offload on the device's own readings (no card), then under a hard
//!   cap over them (`--cap`): one JSON line per run with our readings (burn's pool, the driver's free and total
//!   where the runtime has a call) beside the record, for comparison with `nvidia-smi`.
//! - `bench`: the Z-Image transformer at its real size (or the peer's tiny one) with random bf16 weights,
//!   timed resident and under block-level group offload with a hard cap over the device's readings (a
//!   simulated card on the CPU): our side of `shared/gpu/diffusers_zimage_offload_bench.py`, one JSON line per
//!   mode with the peer's fields.
//!
//! ```text
//! cargo run --release -p pipeline-zimage --features cuda --example gpu_check -- parity --device cuda:0
//! cargo run --release -p pipeline-zimage --features cuda --example gpu_check -- readings --device cuda:0 --cap 16GB
//! cargo run -p pipeline-zimage --features wgpu --example gpu_check -- readings --device wgpu --total 1GiB --cap 8MB
//! cargo run --release -p pipeline-zimage --features cuda --example gpu_check -- bench --device cuda:0 --cap 16GB --size 1024 --steps 6
//! cargo run -p pipeline-zimage --example gpu_check -- bench --tiny --size 256 --steps 2 --cap 20MB   # a CPU dry run
//! cargo run -p pipeline-zimage --example gpu_check -- parity                                        # on the CPU
//! ```

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, FloatDType, Tensor};
use group_offload::{GroupLevel, GroupOptions, OffloadDevice, handle::GroupedModel};
use group_offload::{config::GroupOffloadConfig, device::CappedDevice, device::PoolReadings};
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::{DeviceMemory, DeviceName, parse_size};
use pipeline_zimage::config::TransformerConfig;
use pipeline_zimage::transformer::ZImageTransformer2DModel;

struct Args {
    device: String,
    cap: String,
    size: usize,
    steps: usize,
    warmup: usize,
    cap_len: usize,
    tiny: bool,
    total: Option<String>,
}

fn parse_args() -> Args {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| args.windows(2).find(|w| w[0] == name).map(|w| w[1].clone());
    Args {
        device: value("--device").unwrap_or_else(|| "cpu".into()),
        cap: value("--cap").unwrap_or_else(|| "16GB".into()),
        size: value("--size").and_then(|v| v.parse().ok()).unwrap_or(1024),
        steps: value("--steps").and_then(|v| v.parse().ok()).unwrap_or(6),
        warmup: value("--warmup").and_then(|v| v.parse().ok()).unwrap_or(1),
        cap_len: value("--cap-len").and_then(|v| v.parse().ok()).unwrap_or(128),
        tiny: args.iter().any(|a| a == "--tiny"),
        total: value("--total"),
    }
}

fn device(name: &str) -> anyhow::Result<Device> {
    Ok(group_offload::device::open_device(&DeviceName::parse(name)?)?)
}

/// The device's own readings (burn's pool, the driver where it has a call); `total` for a runtime without one.
fn readings_of(exec: &Device, name: &str, total: Option<u64>) -> anyhow::Result<Arc<PoolReadings>> {
    Ok(PoolReadings::open(exec.clone(), DeviceName::parse(name)?, total)?)
}

fn config(tiny: bool) -> TransformerConfig {
    let mut config = TransformerConfig::z_image_turbo();
    if tiny {
        // The peer's TINY: dim 96, 4 layers, 1 refiner layer, 3 heads.
        config.dim = 96;
        config.n_layers = 4;
        config.n_refiner_layers = 1;
        config.n_heads = 3;
        config.n_kv_heads = 3;
        config.cap_feat_dim = 48;
        config.axes_dims = vec![8, 12, 12];
    }
    config
}

fn time<F: FnMut() -> anyhow::Result<()>>(device: &Device, args: &Args, mut forward: F) -> anyhow::Result<(f64, f64)> {
    let mut times = Vec::new();
    for i in 0..args.warmup + args.steps {
        device.sync().map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let start = Instant::now();
        forward()?;
        device.sync().map_err(|e| anyhow::anyhow!("{e:?}"))?;
        if i >= args.warmup {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], times[0]))
}

fn main() -> anyhow::Result<()> {
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        println!(
            "usage: gpu_check parity|readings|bench [--device cuda:0] [--cap 16GB] [--total SIZE] [--size 1024] [--steps 6] [--tiny]"
        );
        return Ok(());
    }
    match std::env::args().nth(1).as_deref() {
        Some("parity") => parity(&parse_args()),
        Some("bench") => bench(&parse_args()),
        Some("readings") => readings(&parse_args()),
        _ => anyhow::bail!(
            "usage: gpu_check parity|readings|bench [--device cuda:0] [--cap 16GB] [--total SIZE] [--size 1024] [--steps 6] [--tiny]"
        ),
    }
}

/// The fixtures: at `$CARGO_MANIFEST_DIR/tests/fixtures` when that is set at run time (a binary carried to
/// another machine), else where this crate was built.
fn fixtures() -> std::path::PathBuf {
    let crate_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), std::path::PathBuf::from);
    crate_dir.join("tests/fixtures")
}

/// Reads the f32 tensors of a golden file into `[1, ...]`-shaped rank-4 tensors by name.
fn golden(name: &str, tensor: &str) -> anyhow::Result<Tensor<4>> {
    let path = fixtures().join("golden").join(name);
    let bytes = std::fs::read(&path)?;
    let file = safetensors::SafeTensors::deserialize(&bytes)?;
    let view = file.tensor(tensor)?;
    let shape: [usize; 4] = view.shape().to_vec().try_into().map_err(|_| anyhow::anyhow!("{tensor} is not 4-d"))?;
    let values: Vec<f32> = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok(Tensor::from_data(burn::tensor::TensorData::new(values, shape), (&Device::flex(), DType::F32)))
}

fn parity(args: &Args) -> anyhow::Result<()> {
    use group_offload::OffloadDevice;
    use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};
    let exec = device(&args.device)?;
    let name = DeviceName::parse(&args.device)?;
    let weights = fixtures().join("tiny-z-image-turbo");
    let memory: Option<Arc<dyn DeviceMemory>> = if name.is_cpu() {
        None
    } else {
        let total = args.total.as_deref().map(parse_size).transpose()?;
        Some(readings_of(&exec, &args.device, total)?)
    };
    let placement = OffloadDevice::on_device(exec, name.clone(), Arc::new(offload_core::NoLedger), memory);
    let pipeline = ZImagePipeline::load(&weights, placement, &pipeline_zimage::loading::LoadOptions::new())?;
    if !name.is_cpu() {
        pipeline.enable_auto_offload(0, true)?;
    }
    // (golden file, steps, guidance, negative prompt, noise tensor, image-to-image)
    type Case<'a> = (&'a str, usize, f32, Option<&'a str>, &'a str, bool);
    let cases: [Case; 3] = [
        ("pipeline_t2i_turbo.safetensors", 4, 0.0, None, "latents", false),
        ("pipeline_t2i_cfg.safetensors", 3, 4.0, Some("blurry, low quality"), "latents", false),
        ("pipeline_img2img.safetensors", 4, 0.0, None, "noise", true),
    ];
    for (file, steps, guidance, negative, noise, img2img) in cases {
        let mut opts = GenerateOptions::turbo("a red fox in the snow");
        (opts.steps, opts.guidance, opts.height, opts.width, opts.max_sequence_length) = (steps, guidance, 64, 64, 32);
        opts.negative_prompt = negative.map(str::to_string);
        opts.latents = Some(golden(file, noise)?);
        if img2img {
            opts.image = Some(golden(file, "init_image")?);
        }
        let image = pipeline.generate(&opts, &mut |_, _| {})?;
        let expected = golden(file, "image")?;
        let error: f32 = (image.to_device(&Device::flex()) - expected).abs().max().into_scalar();
        println!(
            "{{\"parity\": \"{file}\", \"device\": \"{}\", \"max_abs_error\": {error:e}, \"within_1e-3\": {}}}",
            args.device,
            error <= 1e-3
        );
    }
    println!("{}", pipeline.manager().offload_record());
    Ok(())
}

/// The tiny pipeline under auto offload on the device's own readings, then under a hard cap over them.
fn readings(args: &Args) -> anyhow::Result<()> {
    use group_offload::OffloadDevice;
    use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};
    let exec = device(&args.device)?;
    let name = DeviceName::parse(&args.device)?;
    anyhow::ensure!(!name.is_cpu(), "readings needs a device with a memory pool: --device cuda:0 or wgpu");
    let total = args.total.as_deref().map(parse_size).transpose()?;
    let weights = fixtures().join("tiny-z-image-turbo");
    for cap in [None, Some(parse_size(&args.cap)?)] {
        exec.memory_cleanup();
        let readings = readings_of(&exec, &args.device, total)?;
        let capped = cap.map(|bytes| CappedDevice::new(readings.clone(), bytes, true, args.cap.clone()));
        let (memory, ledger): (Arc<dyn DeviceMemory>, Arc<dyn offload_core::DeviceLedger>) = match &capped {
            Some(capped) => (capped.clone(), capped.clone()),
            None => (readings.clone(), Arc::new(offload_core::NoLedger)),
        };
        let placement = OffloadDevice::on_device(exec.clone(), name.clone(), ledger, Some(memory.clone()));
        let pipeline = ZImagePipeline::load(&weights, placement, &pipeline_zimage::loading::LoadOptions::new())?;
        pipeline.enable_auto_offload(parse_size("1MB")?, true)?;
        let mut opts = GenerateOptions::turbo("a red fox in the snow");
        (opts.steps, opts.height, opts.width, opts.max_sequence_length) = (4, 64, 64, 32);
        opts.latents = Some(golden("pipeline_t2i_turbo.safetensors", "latents")?);
        let image = pipeline.generate(&opts, &mut |_, _| {})?;
        let expected = golden("pipeline_t2i_turbo.safetensors", "image")?;
        let error: f32 = (image.to_device(&Device::flex()) - expected).abs().max().into_scalar();
        let now = readings.observe()?;
        println!(
            "{{\"readings\": \"{}\", \"device\": \"{name}\", \"max_abs_error\": {error:e}, \"in_use\": {}, \"reserved\": {}, \"padding\": {}, \"peak_in_use_sampled\": {}, \"reserved_high\": {}, \"available\": {}, \"available_under_cap\": {}, \"total\": {}, \"driver_free\": {}, \"outside_pool\": {}}}",
            cap.map_or("own".to_string(), |_| format!("capped at {}", args.cap)),
            now.in_use,
            now.reserved,
            now.padding,
            readings.peak(),
            readings.reserved_peak(),
            now.available(),
            memory.available(),
            now.total,
            now.driver_free.map_or_else(|| "null".to_string(), |free| free.to_string()),
            now.outside_pool()
        );
        println!("{}", pipeline.manager().offload_record());
    }
    Ok(())
}

fn bench(args: &Args) -> anyhow::Result<()> {
    let mut exec = device(&args.device)?;
    // Weights and activations in bf16, as the peer runs them.
    exec.configure(FloatDType::BF16).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let config = config(args.tiny);
    let lat = args.size / 8;
    let inputs = |device: &Device| {
        let x = Tensor::<5>::random([1, 16, 1, lat, lat], Distribution::Normal(0.0, 1.0), device).cast(DType::BF16);
        let cap = Tensor::<3>::random([1, args.cap_len, config.cap_feat_dim], Distribution::Normal(0.0, 1.0), device)
            .cast(DType::BF16);
        let t = Tensor::<1>::from_floats([0.5], device).cast(DType::BF16);
        (x, t, cap)
    };
    let params = config.num_params();
    let row = |mode: &str, (median, min): (f64, f64), peak: Option<u64>| {
        let peak = peak.map_or_else(|| "null".to_string(), |p| p.to_string());
        println!(
            "{{\"mode\": \"{mode}\", \"s_per_forward_median\": {median:.6}, \"s_per_forward_min\": {min:.6}, \"steps\": {}, \"size\": {}, \"cap_len\": {}, \"params\": {params}, \"peak\": {peak}}}",
            args.steps, args.size, args.cap_len
        );
    };

    {
        let model = ZImageTransformer2DModel::new(&config, &exec);
        let (x, t, cap) = inputs(&exec);
        let timing = time(&exec, args, || {
            let _ = model.forward(x.clone(), t.clone(), cap.clone());
            Ok(())
        })?;
        row("resident", timing, None);
    }
    exec.memory_cleanup();

    let cap_bytes = parse_size(&args.cap)?;
    let block = GroupLevel::Block { blocks_per_group: 1 };
    for (mode, level, prefetch, pinned) in [
        // The peer's modes first, so a run cut short by its timeout still has them.
        ("group_block1_prefetch", block, 1usize, false),
        ("group_block1_no_prefetch", block, 0, false),
        ("group_block1_prefetch_pinned", block, 1, true),
        ("group_leaf_prefetch", GroupLevel::Leaf, 1, false),
    ] {
        // On a device, a hard cap over its own readings; on the CPU (a dry run), a simulated card.
        let (ledger, memory, peak): (
            Arc<dyn offload_core::DeviceLedger>,
            Arc<dyn DeviceMemory>,
            Arc<dyn DeviceMemory>,
        ) = if DeviceName::parse(&args.device)?.is_cpu() {
            let card =
                SimCard::new(CardSpec::parse(&cap_bytes.to_string())?.with_mode(Mode::Hard).with_context_overhead(0));
            (card.clone(), card.clone(), card)
        } else {
            let total = args.total.as_deref().map(parse_size).transpose()?;
            let readings = readings_of(&exec, &args.device, total)?;
            let capped = CappedDevice::new(readings.clone(), cap_bytes, true, args.cap.clone());
            (capped.clone(), capped, readings)
        };
        let model = ZImageTransformer2DModel::new(&config, &exec);
        let on = OffloadDevice::on_device(
            exec.clone(),
            DeviceName::parse(&args.device)?,
            ledger.clone(),
            Some(memory.clone()),
        );
        let offload = GroupOffloadConfig::new("transformer", on);
        let options = GroupOptions {
            level,
            prefetch: prefetch > 0,
            prefetch_depth: prefetch.max(1),
            // Every streamed group's host copy page-locked through burn's staging.
            pinned_budget: if pinned { u64::MAX } else { 0 },
            ..GroupOptions::default()
        };
        let grouped = GroupedModel::<ZImageTransformer2DModel>::new(model, offload, &options)?;
        let (x, t, cap) = inputs(&exec);
        let timing = time(&exec, args, || {
            grouped.call(|w| w.forward(x.clone(), t.clone(), cap.clone()))?;
            Ok(())
        })?;
        row(mode, timing, Some(peak.peak()));
        let stats = grouped.offload().stats();
        let (pinned_bytes, page_locked) = grouped.offload().pinned_bytes();
        eprintln!("{mode}: {stats:?}; pinned {pinned_bytes} bytes, {page_locked} of them page-locked");
        drop(grouped);
        exec.memory_cleanup();
    }

    Ok(())
}
