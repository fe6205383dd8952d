//! The file tier's read rate on this machine: a checkpoint of `--mib N` MiB (default 1024) of f32 linear layers is
//! written to `--dir DIR` (a temporary directory by default; an existing file there is reused), bound, registered
//! from its file and streamed at block level with prefetch on the CPU, and the disk meter's rates are printed
//! for the first forward and for the next ones. With `--drop-caches` the kernel's page cache is emptied first
//! (`/proc/sys/vm/drop_caches`, root only), so the first forward reads from the disk (cold) and the next ones
//! from the page cache (warm). Then the same model loaded into memory the usual way (burn-store, the RAM tier)
//! streams the same forwards, and the median forward of each tier is printed with their ratio: `--batch N`
//! (default 64) rows per forward sets how much compute each group's read has to hide behind.
//!
//! `cargo run --release -p group-offload --example file_read_rate -- --mib 1024 --drop-caches`

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use group_offload::prelude::*;
use group_offload::weights::{BindOptions, WeightIndex, bind};
use offload_core::ComponentsManager;
use offload_core::link::DiskMeter;

const WIDTH: usize = 1024;

#[derive(Module, Debug)]
struct Wide {
    fc: Linear,
}

#[derive(Module, Debug, OffloadModel)]
struct WideNet {
    #[offload(blocks)]
    blocks: Vec<Wide>,
}

impl WideNetWeights<'_> {
    fn forward(self, x: Tensor<2>) -> Result<Tensor<2>> {
        self.blocks.fold(x, |block, x| Ok(x.clone() + leaf!(block, fc).forward(x) * 0.001))
    }
}

/// Writes `blocks` linear layers of `WIDTH`² f32 values, one tensor at a time.
fn write_checkpoint(path: &Path, blocks: usize) -> std::io::Result<()> {
    let mut header = String::from("{");
    let mut offset = 0usize;
    for block in 0..blocks {
        for (name, shape) in [("weight", vec![WIDTH, WIDTH]), ("bias", vec![WIDTH])] {
            let bytes = shape.iter().product::<usize>() * 4;
            let dims = shape.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
            let comma = if offset == 0 { "" } else { "," };
            header.push_str(&format!(
                "{comma}\"blocks.{block}.fc.{name}\":{{\"dtype\":\"F32\",\"shape\":[{dims}],\"data_offsets\":[{offset},{}]}}",
                offset + bytes
            ));
            offset += bytes;
        }
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let partial = path.with_extension("partial");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&partial)?);
    file.write_all(&(header.len() as u64).to_le_bytes())?;
    file.write_all(header.as_bytes())?;
    let values: Vec<u8> =
        (0..WIDTH * WIDTH).flat_map(|i| (((i % 2001) as f32 - 1000.0) * 1e-6).to_le_bytes()).collect();
    for _ in 0..blocks {
        file.write_all(&values)?;
        file.write_all(&values[..WIDTH * 4])?;
    }
    file.flush()?;
    drop(file);
    std::fs::rename(partial, path)
}

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.windows(2).find(|w| w[0] == name).map(|w| w[1].as_str())
}

fn report(what: &str, meter: &DiskMeter, since: offload_core::link::DiskTotals, seconds: f64) {
    let totals = meter.totals();
    let (reads, bytes, read_seconds) =
        (totals.reads - since.reads, totals.bytes - since.bytes, totals.seconds - since.seconds);
    println!(
        "{what}: {reads} group reads, {:.0} MiB in {read_seconds:.3} s of reads ({:.2} GB/s over the reads), forward \
         {seconds:.3} s",
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / read_seconds.max(f64::MIN_POSITIVE) / 1e9
    );
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let mib: usize = arg(&args, "--mib").map_or(Ok(1024), str::parse)?;
    let temporary = tempfile::tempdir()?;
    let dir = arg(&args, "--dir").map_or_else(|| temporary.path().to_path_buf(), std::path::PathBuf::from);
    let blocks = (mib << 20) / (WIDTH * WIDTH * 4 + WIDTH * 4);
    let path = dir.join(format!("wide-{blocks}.safetensors"));
    if !path.is_file() {
        std::fs::create_dir_all(&dir)?;
        write_checkpoint(&path, blocks)?;
    }
    if args.iter().any(|a| a == "--drop-caches") {
        // Written data must reach the disk before the cache that holds it can be dropped.
        std::process::Command::new("sync").status()?;
        match std::fs::write("/proc/sys/vm/drop_caches", "3") {
            Ok(()) => println!("page cache dropped: the first forward reads from the disk"),
            Err(error) => println!("the page cache could not be dropped ({error}): every forward reads warm"),
        }
    }
    let device = Device::flex();
    let net =
        WideNet { blocks: (0..blocks).map(|_| Wide { fc: LinearConfig::new(WIDTH, WIDTH).init(&device) }).collect() };
    let index = WeightIndex::open(std::slice::from_ref(&path), str::to_string)?;
    let (model, files, _) = bind(net, &index, &BindOptions::new())?;
    let meter = files.meter().clone();
    let manager = Arc::new(ComponentsManager::new());
    let mut handle = ModelHandle::register_files(&manager, "wide", model, files, OffloadDevice::host_only())?;
    handle.enable_group_offload(&GroupOptions::default())?;
    let batch: usize = arg(&args, "--batch").map_or(Ok(64), str::parse)?;
    let x = Tensor::<2>::ones([batch, WIDTH], &device);
    println!(
        "{} MiB in {blocks} groups of {:.1} MiB, {}",
        index.bytes() >> 20,
        (WIDTH * WIDTH * 4) as f64 / (1 << 20) as f64,
        path.display()
    );
    const FORWARDS: usize = 5;
    let mut file_tier = Vec::new();
    for forward in 0..FORWARDS {
        let since = meter.totals();
        let started = Instant::now();
        handle.run(0, |weights, _| weights.forward(x.clone()))?;
        let seconds = started.elapsed().as_secs_f64();
        report(&format!("file tier, forward {forward}"), &meter, since, seconds);
        file_tier.push(seconds);
    }
    if let Some(rate) = handle.disk_rate() {
        println!("{rate}");
    }
    drop(handle);

    // The RAM tier: the same checkpoint read into memory, streamed the same way.
    use burn::store::{ModuleSnapshot, SafetensorsStore};
    let mut loaded =
        WideNet { blocks: (0..blocks).map(|_| Wide { fc: LinearConfig::new(WIDTH, WIDTH).init(&device) }).collect() };
    loaded.load_from(&mut SafetensorsStore::from_file(&path))?;
    let mut handle = ModelHandle::register(&manager, "wide_ram", loaded, OffloadDevice::host_only())?;
    handle.enable_group_offload(&GroupOptions::default())?;
    let mut ram_tier = Vec::new();
    for forward in 0..FORWARDS {
        let started = Instant::now();
        handle.run(0, |weights, _| weights.forward(x.clone()))?;
        let seconds = started.elapsed().as_secs_f64();
        println!("RAM tier, forward {forward}: {seconds:.3} s");
        ram_tier.push(seconds);
    }
    // The first forward of each is its capture (no prefetch), and the file tier's may read cold: the later ones
    // are the steady state.
    let median = |times: &mut Vec<f64>| {
        let mut later = times.split_off(1);
        later.sort_by(f64::total_cmp);
        later[later.len() / 2]
    };
    let (file, ram) = (median(&mut file_tier), median(&mut ram_tier));
    println!("median later forward: file tier {file:.3} s, RAM tier {ram:.3} s, ratio {:.3}", file / ram);
    Ok(())
}
