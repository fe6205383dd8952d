//! Offload overhead on one runtime, side by side: a mid-size Z-Image-shaped transformer (random weights) run
//! resident, under the `auto` plan on a hard cap 30% under its weights, at block level with and without
//! prefetch, and at leaf level, all in one process, each after a warm-up step.
//!
//! ```sh
//! cargo xtask bench offload                 # the CPU backend, the cap on a simulated card
//! cargo xtask bench offload --device wgpu   # burn's wgpu runtime (lavapipe: pass --device-memory 2GiB)
//! ```
//!
//! Two more routes repeat block level with and without prefetch with no sync and read-back per upload
//! (`GroupOptions::check_uploads` off), to show what the checks cost, and resident runs again last, to show how
//! much the routes' order moves a step on its own.
//!
//! For each route it prints the median step time (a step is one transformer forward, ended by the device's
//! completion), the syncs and read-backs per step on the compute thread and on the prefetch worker (the library's
//! own checks, [`group_offload::device::device_checks`]), and the bytes onloaded per step (from the record). Its
//! last line is `offload_overhead auto=R block_prefetch=R block_serial=R leaf=R`, each the route's median step
//! time divided by the resident one's. It computes in f32.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{DType, Device, Distribution, Tensor};
use group_offload::device::{CappedDevice, DeviceChecks, PagePolicy, PoolReadings, device_checks, open_device_with};
use group_offload::{GroupLevel, GroupOptions, ModelHandle, OffloadDevice};
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::plan::{DeviceFacts, HostMemory, Settings, SettingsLayer, Workload};
use offload_core::{
    Action, ComponentsManager, DeviceLedger, DeviceMemory, DeviceName, NoLedger, format_size, parse_size,
};
use pipeline_zimage::config::TransformerConfig;
use pipeline_zimage::transformer::ZImageTransformer2DModel;

/// The command line: `--device cpu|wgpu`, `--device-memory SIZE`, `--pages exclusive|adaptive` (the pool's page
/// policy; exclusive, as a hard cap wants, by default), `--routes auto,leaf`, `--trace DIR`, `--steps N`,
/// `--dim D`, `--layers L`, and `--latent S` (the latent's side: `S / 2` squared image tokens).
struct Args {
    device: String,
    device_memory: Option<u64>,
    pages: PagePolicy,
    /// The routes to run beside resident (`--routes auto,leaf`); empty: all.
    routes: Vec<String>,
    /// `--trace DIR`: write each route's timeline there as `<route>.json` (Chrome trace events).
    trace: Option<std::path::PathBuf>,
    steps: usize,
    dim: usize,
    layers: usize,
    latent: usize,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        device: "cpu".into(),
        device_memory: None,
        pages: PagePolicy::Exclusive,
        routes: Vec::new(),
        trace: None,
        steps: 5,
        dim: 384,
        layers: 6,
        latent: 32,
    };
    let mut words = std::env::args().skip(1);
    while let Some(word) = words.next() {
        let mut value = || words.next().with_context(|| format!("{word} needs a value"));
        match word.as_str() {
            "--device" => args.device = value()?,
            "--device-memory" => args.device_memory = Some(parse_size(&value()?).context("--device-memory")?),
            "--pages" => {
                args.pages = match value()?.as_str() {
                    "exclusive" => PagePolicy::Exclusive,
                    "adaptive" => PagePolicy::Adaptive,
                    other => bail!("--pages {other}: use exclusive or adaptive"),
                }
            }
            "--routes" => args.routes = value()?.split(',').map(str::to_string).collect(),
            "--trace" => args.trace = Some(value()?.into()),
            "--steps" => args.steps = value()?.parse().context("--steps")?,
            "--dim" => args.dim = value()?.parse().context("--dim")?,
            "--layers" => args.layers = value()?.parse().context("--layers")?,
            "--latent" => args.latent = value()?.parse().context("--latent")?,
            other => bail!("unknown argument {other}; see the example's documentation"),
        }
    }
    if args.steps == 0
        || !args.dim.is_multiple_of(64)
        || args.layers == 0
        || !args.latent.is_multiple_of(2)
        || args.latent == 0
    {
        bail!("--steps and --layers must be positive, --dim a multiple of 64 and --latent a positive even number");
    }
    Ok(args)
}

/// Touches every parameter, so the lazy random initialisation happens before anything is measured.
fn materialise<M: Module>(module: &M) -> u64 {
    struct Touch(u64);
    impl ModuleVisitor for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            self.0 += tensor.shape().num_elements() as u64 * tensor.dtype().size() as u64;
        }
    }
    let mut touch = Touch(0);
    module.visit(&mut touch);
    touch.0
}

/// What one route measured.
struct RouteFigures {
    name: &'static str,
    /// `None` when the route failed.
    median: Option<Duration>,
    checks: DeviceChecks,
    onloaded: u64,
    steps: usize,
    note: String,
}

/// The device the routes run on: a real runtime's readings, or a simulated card on the CPU.
struct Target {
    exec: Device,
    name: DeviceName,
    readings: Option<Arc<PoolReadings>>,
}

impl Target {
    /// A placement with `cap` bytes on a hard account (`None`: the device's own size).
    fn placement(&self, cap: Option<u64>, weights: u64) -> anyhow::Result<(OffloadDevice, Arc<dyn DeviceMemory>)> {
        match &self.readings {
            Some(readings) => {
                let memory: Arc<dyn DeviceMemory> = readings.clone();
                let (ledger, memory): (Arc<dyn DeviceLedger>, Arc<dyn DeviceMemory>) = match cap {
                    Some(cap) => {
                        let capped = CappedDevice::new(readings.clone(), cap, true, "bench cap");
                        (capped.clone(), capped)
                    }
                    None => (Arc::new(NoLedger), memory),
                };
                Ok((
                    OffloadDevice::on_device(self.exec.clone(), self.name.clone(), ledger, Some(memory.clone())),
                    memory,
                ))
            }
            None => {
                let size = cap.unwrap_or(4 * weights);
                let card =
                    SimCard::new(CardSpec::parse(&size.to_string())?.with_mode(Mode::Hard).with_context_overhead(0));
                Ok((OffloadDevice::simulated(card.clone()), card))
            }
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let name = DeviceName::parse(&args.device).context("--device")?;
    let exec = open_device_with(&name, args.pages)?;
    let readings =
        if name.is_cpu() { None } else { Some(PoolReadings::open(exec.clone(), name.clone(), args.device_memory)?) };
    let target = Target { exec: exec.clone(), name: name.clone(), readings };

    let heads = args.dim / 64;
    let config = TransformerConfig {
        dim: args.dim,
        n_heads: heads,
        n_kv_heads: heads,
        n_layers: args.layers,
        n_refiner_layers: 1,
        cap_feat_dim: args.dim,
        axes_dims: vec![16, 24, 24],
        axes_lens: vec![256, 128, 128],
        ..TransformerConfig::z_image_turbo()
    };
    let model = ZImageTransformer2DModel::new(&config, &Device::flex());
    let weights = materialise(&model);
    let latent_side = args.latent;
    let caption = 32;
    let tokens = (latent_side / 2) * (latent_side / 2) + caption;
    let activation = config.activation_bytes_for_tokens(tokens, DType::F32, true);
    println!(
        "device {}: transformer dim {} x {} blocks, {} of f32 weights; latent {latent_side}x{latent_side}, {caption} \
         caption tokens; one forward's activations estimated at {}",
        target.name,
        config.dim,
        config.n_layers + 2 * config.n_refiner_layers,
        format_size(weights),
        format_size(activation)
    );
    let host = Device::flex();
    let x = Tensor::<5>::random([1, 16, 1, latent_side, latent_side], Distribution::Normal(0.0, 1.0), &host);
    let cap_feats = Tensor::<3>::random([1, caption, config.cap_feat_dim], Distribution::Normal(0.0, 1.0), &host);
    let t = Tensor::<1>::from_floats([0.5], &host);

    let mut figures = Vec::new();
    // Resident runs first, as the baseline, and again last: the two show how much the order of the routes (a
    // warmer cache, a busier machine) moves a step on its own.
    // The `_unchecked` routes publish each group once its copies are queued, with no sync and read-back per
    // upload: beside their checked twins they show what the upload checks cost.
    let routes = [
        "resident",
        "auto",
        "block_prefetch",
        "block_serial",
        "leaf",
        "block_prefetch_unchecked",
        "block_serial_unchecked",
        "resident_again",
    ];
    for route in routes {
        if !args.routes.is_empty() && route != "resident" && !args.routes.iter().any(|r| r == route) {
            continue;
        }
        let measure = || -> anyhow::Result<RouteFigures> {
            // The route before left its pages in the pool's cache; a cap counts the pool's pages, so they go first.
            let _ = exec.sync();
            exec.memory_cleanup();
            let cap = (route == "auto").then(|| weights * 7 / 10);
            let (placement, memory) = target.placement(cap, weights)?;
            let computes_on = placement.name().clone();
            let manager = Arc::new(ComponentsManager::new());
            let timeline = args.trace.as_ref().map(|_| offload_core::Timeline::enabled());
            if let Some(timeline) = &timeline {
                manager.set_timeline(timeline.clone());
            }
            let mut handle = ModelHandle::register(&manager, "transformer", model.clone(), placement)?;
            let block = |prefetch, check_uploads| GroupOptions {
                level: GroupLevel::Block { blocks_per_group: 1 },
                prefetch,
                check_uploads,
                ..GroupOptions::default()
            };
            let mut note = String::new();
            match route {
                // Onloaded at its first run and kept (nothing evicts on an uncapped device): without auto offload
                // the manager runs a component where it is, and this one was built on the host.
                "resident" | "resident_again" => manager.enable_auto_offload(memory.clone(), 0, true)?,
                "auto" => {
                    let mut explicit = SettingsLayer::default();
                    explicit.set("preset", "auto")?;
                    // The workload's largest activation stays free, as the CLI's exact reserve keeps it.
                    explicit.set("reserve", &activation.to_string())?;
                    let settings = Settings::resolve(&explicit, std::iter::empty::<(String, String)>(), None)?;
                    // A step is one forward of an image's `steps` (what makes a resident part worth its room).
                    let flops = 2.0 * (weights / 4) as f64 * tokens as f64;
                    let spec = group_offload::apply::component_spec(&manager, &handle)?
                        .with_activation(activation)
                        .with_cost(flops, args.steps as u32 + 1);
                    let host_memory = HostMemory::new(64 << 30, 32 << 30);
                    let facts = DeviceFacts::new(memory.clone(), host_memory);
                    let mut components: [&mut dyn group_offload::handle::Component; 1] = [&mut handle];
                    let plan = group_offload::apply::plan_and_apply(
                        &manager,
                        &mut components,
                        &[spec],
                        settings,
                        &facts,
                        Workload::new().with("model", "bench"),
                        "transformer",
                    )?;
                    note = plan
                        .plan
                        .components
                        .first()
                        .map(|c| {
                            format!(
                                "cap {}, route {}, {} resident",
                                format_size(weights * 7 / 10),
                                c.route,
                                format_size(c.resident_bytes)
                            )
                        })
                        .unwrap_or_default();
                }
                "block_prefetch" => handle.enable_group_offload(&block(true, true))?,
                "block_serial" => handle.enable_group_offload(&block(false, true))?,
                "block_prefetch_unchecked" => handle.enable_group_offload(&block(true, false))?,
                "block_serial_unchecked" => handle.enable_group_offload(&block(false, false))?,
                _ => handle.enable_group_offload(&GroupOptions::leaf())?,
            }
            let step = || -> anyhow::Result<Duration> {
                let started = Instant::now();
                let out = handle.try_run(activation, |weights, device| {
                    weights.forward(
                        x.clone().to_device(device),
                        t.clone().to_device(device),
                        cap_feats.clone().to_device(device),
                    )
                })?;
                // Every route ends its step the same way: the output read back, so the device has done the work.
                out.into_data();
                Ok(started.elapsed())
            };
            step()?; // the warm-up: the capture of the call order, the first onloads, the kernels compiled
            if route.starts_with("resident") {
                // The baseline must compute where the routes do: a resident model left on the host would compare
                // the device with the CPU backend (this bench's first version did, on wgpu).
                let at = manager.component_info(handle.id())?.device;
                if at != computes_on {
                    bail!("the resident model ran on {at}, not on {computes_on}: the baseline would not be resident");
                }
            }
            let (checks_before, onloaded_before) = (device_checks(), onloaded(&manager));
            let mut times = (0..args.steps).map(|_| step()).collect::<anyhow::Result<Vec<_>>>()?;
            let checks = device_checks() - checks_before;
            let onloaded = onloaded(&manager) - onloaded_before;
            times.sort();
            if let (Some(timeline), Some(dir)) = (&timeline, &args.trace) {
                // Each route's spans (uploads, computes, releases, on their threads): chrome://tracing or Perfetto.
                std::fs::create_dir_all(dir)?;
                let path = dir.join(format!("{route}.json"));
                let mut file = std::fs::File::create(&path).with_context(|| path.display().to_string())?;
                timeline.write_chrome_trace(&mut file)?;
            }
            if let Some(rate) = handle.group_offload().and_then(|g| g.link_rate()) {
                note = format!("{note}{}link {rate}", if note.is_empty() { "" } else { "; " });
            }
            if let Some(stats) = handle.group_stats() {
                note = format!("{note}; {stats:?}");
            }
            Ok(RouteFigures {
                name: route,
                median: Some(times[times.len() / 2]),
                checks,
                onloaded,
                steps: args.steps,
                note,
            })
        };
        // A route that fails is reported as failed, with its error, and the others still run.
        figures.push(measure().unwrap_or_else(|error| RouteFigures {
            name: route,
            median: None,
            checks: DeviceChecks::default(),
            onloaded: 0,
            steps: args.steps,
            note: format!("failed: {error}"),
        }));
    }

    let secs = |f: &RouteFigures| f.median.map_or(f64::NAN, |m| m.as_secs_f64());
    let resident = secs(&figures[0]);
    println!(
        "route                    median step  ÷ resident  syncs/step (compute, worker)  read-backs/step (compute, worker)  onloaded/step"
    );
    for f in &figures {
        let per = |n: u64| n as f64 / f.steps as f64;
        println!(
            "{:<24} {:>9.3} s  {:>10.3}  {:>12.1}, {:<14.1}  {:>17.1}, {:<14.1}  {:>10}  {}",
            f.name,
            secs(f),
            secs(f) / resident,
            per(f.checks.compute_syncs),
            per(f.checks.worker_syncs),
            per(f.checks.compute_read_backs),
            per(f.checks.worker_read_backs),
            format_size(f.onloaded / f.steps as u64),
            f.note
        );
    }
    let ratio = |name: &str| figures.iter().find(|f| f.name == name).map_or(f64::NAN, |f| secs(f) / resident);
    if figures.iter().any(|f| f.name.ends_with("_unchecked")) {
        println!(
            "upload checks (÷ resident): block_prefetch {:.3} checked, {:.3} unchecked; block_serial {:.3} checked, \
             {:.3} unchecked",
            ratio("block_prefetch"),
            ratio("block_prefetch_unchecked"),
            ratio("block_serial"),
            ratio("block_serial_unchecked")
        );
    }
    if figures.iter().any(|f| f.name == "resident_again") {
        println!("resident again, after the other routes: {:.3} of the first resident step", ratio("resident_again"));
    }
    println!(
        "offload_overhead auto={:.3} block_prefetch={:.3} block_serial={:.3} leaf={:.3}",
        ratio("auto"),
        ratio("block_prefetch"),
        ratio("block_serial"),
        ratio("leaf")
    );
    Ok(())
}

/// Bytes onloaded so far in `manager`'s record (whole components and groups).
fn onloaded(manager: &ComponentsManager) -> u64 {
    manager.offload_record().events().iter().filter(|e| e.action == Action::Onload).map(|e| e.bytes).sum()
}
