//! The file tier's memory bound: a checkpoint four times larger than the bound streams from its file while the
//! process's anonymous memory (`RssAnon`, sampled every millisecond) stays within the bound. The one test of
//! this binary, so that no other test's allocations share the process while it samples.
//!
//! The bound: the anonymous memory may grow, from its reading once the model is bound and registered, by at
//! most a quarter of the file. On `flex` the simulated card's tensors live in host memory, so the bound counts
//! the device copies the window holds (the group computing and the one prefetched behind it, two groups of
//! 8 MiB here, plus the group the worker reads as its tensors are built), the activations and the allocator's
//! slack: 27 MiB measured (5.3% of the 512 MiB file), against the 128 MiB bound. The same checkpoint loaded the
//! usual way (burn-store) holds 519 MiB, which the test shows at its end.
//!
//! Built with `--features wgpu`, the binary's one test streams the same checkpoint onto burn's wgpu runtime instead
//! (Vulkan; lavapipe on a CPU-only machine, whose device memory is host memory too, so the bound counts the
//! runtime's pool pages of the window): `cargo test -p group-offload --features wgpu --test file_tier_memory`.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use group_offload::prelude::*;
use group_offload::weights::{BindOptions, WeightIndex, bind};
use memory_sim::SimCard;
#[cfg(not(feature = "wgpu"))]
use memory_sim::{CardSpec, Mode};
use offload_core::ComponentsManager;

const WIDTH: usize = 1024;
const BLOCKS: usize = 64;

#[derive(Module, Debug)]
struct Wide {
    fc1: Linear,
    fc2: Linear,
}

#[derive(Module, Debug, OffloadModel)]
struct WideNet {
    #[offload(blocks)]
    blocks: Vec<Wide>,
}

impl WideNetWeights<'_> {
    fn forward(self, x: Tensor<2>) -> Result<Tensor<2>> {
        self.blocks.fold(x, |block, x| {
            let h = burn::tensor::activation::relu(leaf!(block, fc1).forward(x.clone()));
            Ok(x + leaf!(block, fc2).forward(h) * 0.01)
        })
    }
}

fn net(device: &Device) -> WideNet {
    let block = || Wide {
        fc1: LinearConfig::new(WIDTH, WIDTH).init(device),
        fc2: LinearConfig::new(WIDTH, WIDTH).init(device),
    };
    WideNet { blocks: (0..BLOCKS).map(|_| block()).collect() }
}

/// Writes the net's checkpoint in f32 one tensor at a time (the test holds at most one tensor's bytes), with
/// small pseudo-random values.
fn write_checkpoint(path: &Path) -> u64 {
    let mut tensors: Vec<(String, Vec<usize>)> = Vec::new();
    for block in 0..BLOCKS {
        for fc in ["fc1", "fc2"] {
            tensors.push((format!("blocks.{block}.{fc}.weight"), vec![WIDTH, WIDTH]));
            tensors.push((format!("blocks.{block}.{fc}.bias"), vec![WIDTH]));
        }
    }
    let mut header = String::from("{");
    let mut offset = 0usize;
    for (i, (name, shape)) in tensors.iter().enumerate() {
        let bytes = shape.iter().product::<usize>() * 4;
        let dims = shape.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
        let comma = if i == 0 { "" } else { "," };
        header.push_str(&format!(
            "{comma}\"{name}\":{{\"dtype\":\"F32\",\"shape\":[{dims}],\"data_offsets\":[{offset},{}]}}",
            offset + bytes
        ));
        offset += bytes;
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).expect("the checkpoint is created"));
    file.write_all(&(header.len() as u64).to_le_bytes()).expect("written");
    file.write_all(header.as_bytes()).expect("written");
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for (_, shape) in &tensors {
        let values: Vec<u8> = (0..shape.iter().product::<usize>())
            .flat_map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (((state % 2001) as f32 - 1000.0) * 3e-5).to_le_bytes()
            })
            .collect();
        file.write_all(&values).expect("written");
    }
    file.flush().expect("flushed");
    (8 + header.len() + offset) as u64
}

/// The process's anonymous resident memory (`RssAnon`), in bytes.
fn anonymous() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("RssAnon:")).expect("an RssAnon line");
    line.trim_start_matches("RssAnon:").trim().trim_end_matches("kB").trim().parse::<u64>().expect("kB") * 1024
}

#[cfg(not(feature = "wgpu"))]
#[test]
fn a_checkpoint_four_times_the_bound_streams_within_it() {
    let card = SimCard::new(CardSpec::parse("64MiB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0));
    stream_within_bound(OffloadDevice::simulated(card.clone()), Some(card));
}

#[cfg(feature = "wgpu")]
#[test]
fn a_checkpoint_four_times_the_bound_streams_within_it_on_wgpu() {
    let name = offload_core::DeviceName::parse("wgpu").expect("a device name");
    let device = group_offload::device::open_device(&name).expect("a wgpu device (Vulkan: mesa-vulkan-drivers)");
    let placement = OffloadDevice::on_device(device, name, Arc::new(offload_core::NoLedger), None);
    stream_within_bound(placement, None);
}

/// Streams the wide checkpoint from its file on `placement`'s device three times and holds the anonymous memory's
/// growth within a quarter of the file; `card` is the simulated card the placement charges, if any.
fn stream_within_bound(placement: OffloadDevice, card: Option<Arc<SimCard>>) {
    let device = placement.exec().clone();
    let host = Device::flex();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("wide.safetensors");
    let file_bytes = write_checkpoint(&path);
    assert!(file_bytes >= 512 << 20, "{file_bytes}");
    let bound = file_bytes / 4;

    let before_bind = anonymous();
    let index = WeightIndex::open(std::slice::from_ref(&path), str::to_string).expect("the index opens");
    let (model, table, report) = bind(net(&host), &index, &BindOptions::new()).expect("it binds");
    assert!(report.is_complete(), "{report:?}");
    let manager = Arc::new(ComponentsManager::new());
    let mut handle = ModelHandle::register_files(&manager, "wide", model, table, placement).expect("it registers");
    handle.enable_group_offload(&GroupOptions::default()).expect("it streams");
    let registered = anonymous();

    let peak = Arc::new(AtomicU64::new(registered));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, stop) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(anonymous(), Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        })
    };
    let x = Tensor::<2>::ones([4, WIDTH], &device);
    let mut outputs = Vec::new();
    for _ in 0..3 {
        let out = handle.run(0, |weights, _| weights.forward(x.clone())).expect("a forward");
        outputs.push(out.into_data());
    }
    stop.store(true, Ordering::Relaxed);
    sampler.join().expect("the sampler ends");
    let peak = peak.load(Ordering::Relaxed).max(anonymous());

    assert_eq!(outputs[0], outputs[1], "a streamed forward changed");
    assert_eq!(outputs[1], outputs[2], "a streamed forward changed");
    let offload = handle.group_offload().expect("grouped");
    assert_eq!(offload.host_memory_bytes(), 0);
    // The last forward's end prefetches the next forward's first group on the worker: wait for its read (CI once
    // read the totals before it ended).
    offload.wait_idle();
    let totals = offload.disk_totals();
    // Every forward read every group once, and the last one's end prefetched the next forward's first group.
    let data = file_bytes - 8 - header_bytes(&path);
    assert_eq!(totals.bytes, 3 * data + offload.largest_group(), "{totals:?}");
    let rate = offload.disk_rate().expect("reads were timed");
    let growth = peak.saturating_sub(registered);
    println!(
        "file {} MiB, bound {} MiB; anonymous: {} MiB before binding, {} MiB once registered, peak {} MiB (+{} MiB, \
         {:.1}% of the file); card peak {} MiB; {rate}",
        file_bytes >> 20,
        bound >> 20,
        before_bind >> 20,
        registered >> 20,
        peak >> 20,
        growth >> 20,
        growth as f64 * 100.0 / file_bytes as f64,
        card.map_or(0, |card| offload_core::DeviceMemory::peak(&*card) >> 20),
    );
    assert!(registered.saturating_sub(before_bind) < 8 << 20, "binding and registering read the model");
    assert!(growth <= bound, "the anonymous memory grew by {growth} B streaming a {file_bytes} B file (bound {bound})");

    // The RAM tier, for contrast: the same checkpoint loaded the usual way (burn-store materialises every tensor)
    // holds the whole file in anonymous memory, four times the bound.
    drop(handle);
    drop(manager);
    let before_load = anonymous();
    let mut loaded = net(&host);
    use burn::store::ModuleSnapshot;
    loaded.load_from(&mut burn::store::SafetensorsStore::from_file(&path)).expect("it loads");
    let held = anonymous().saturating_sub(before_load);
    println!("loaded the usual way: +{} MiB of anonymous memory", held >> 20);
    assert!(held > bound * 3, "the RAM tier held only {held} B");
    drop(loaded);
}

fn header_bytes(path: &Path) -> u64 {
    let mut prefix = [0u8; 8];
    std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::open(path).expect("opens"), &mut prefix, 0)
        .expect("read");
    u64::from_le_bytes(prefix)
}
