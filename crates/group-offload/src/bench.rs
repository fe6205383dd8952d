//! The overlap benchmark: how much of the transfer time prefetching hides behind compute, on the CPU.
//!
//! A model of `groups` blocks, each a `dim × dim` weight multiplied `matmuls_per_group` times (real matmuls on
//! burn's flex backend), is run four ways: resident (compute only), streamed with no compute (transfer only),
//! streamed with prefetch off (serial), and streamed with prefetch on. The link is a ledger whose `transfer`
//! sleeps, by default for the measured compute time of one group, so transfer ≈ compute per group and perfect
//! overlap halves the serial wall time. Efficiency is `max(compute only, transfer only) / wall`: 1.0 means the
//! shorter of the two is completely hidden; the serial run sits near 0.5. Each figure is the median over
//! `forwards` steady forwards (after the capture pass).

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::{Module, Param};
use burn::tensor::activation::tanh;
use burn::tensor::{Device, Distribution, Tensor};
use offload_core::{ComponentError, DeviceLedger, Direction};

use crate::config::GroupOffloadConfig;
use crate::error::Result;
use crate::parts::{BlockOffload, GroupOffload};

/// What [`overlap_benchmark`] runs.
#[derive(Debug, Clone)]
pub struct OverlapConfig {
    /// Number of blocks (one group each).
    pub groups: usize,
    /// Side of each block's square weight.
    pub dim: usize,
    /// Rows of the activation multiplied through each block.
    pub rows: usize,
    /// Matmuls per block: sets the compute time per group (a few ms by default).
    pub matmuls_per_group: usize,
    /// Sleep per group transfer; `None` uses the measured compute time of one group.
    pub transfer: Option<Duration>,
    /// Steady forwards measured per mode (the median is reported).
    pub forwards: usize,
    /// Prefetch depth of the prefetch run: 2 absorbs the jitter of groups whose compute and transfer are equal.
    pub prefetch_depth: usize,
}

impl Default for OverlapConfig {
    fn default() -> Self {
        Self { groups: 8, dim: 256, rows: 256, matmuls_per_group: 4, transfer: None, forwards: 5, prefetch_depth: 2 }
    }
}

/// What [`overlap_benchmark`] measured. Times are per forward.
#[derive(Debug, Clone, PartialEq)]
pub struct OverlapReport {
    /// Compute alone, every block resident.
    pub compute_only: Duration,
    /// Transfers alone: every group streamed through, no compute.
    pub transfer_only: Duration,
    /// Streamed, prefetch on.
    pub prefetch_wall: Duration,
    /// Streamed, prefetch off.
    pub serial_wall: Duration,
    /// `max(compute_only, transfer_only) / prefetch_wall` (goal ≥ 0.95).
    pub prefetch_efficiency: f64,
    /// `max(compute_only, transfer_only) / serial_wall` (about 0.5 when transfer ≈ compute).
    pub serial_efficiency: f64,
    /// Sleep per group transfer that was used.
    pub transfer_per_group: Duration,
    /// Misses in the prefetch run's steady forwards (0 expected).
    pub prefetch_misses: u64,
    /// Prefetches the worker made in the prefetch run's steady forwards: one per group per forward when the
    /// captured order holds (a run with none measured serial streaming under the prefetch name).
    pub prefetches: u64,
    /// Of the groups taken in those forwards, how many were still in flight and waited for.
    pub prefetch_waits: u64,
}

impl std::fmt::Display for OverlapReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "compute only {:.2?}, transfer only {:.2?}; prefetch {:.2?} (efficiency {:.3}), serial {:.2?} (efficiency {:.3}); {} prefetches ({} waited for), {} misses",
            self.compute_only,
            self.transfer_only,
            self.prefetch_wall,
            self.prefetch_efficiency,
            self.serial_wall,
            self.serial_efficiency,
            self.prefetches,
            self.prefetch_waits,
            self.prefetch_misses
        )
    }
}

/// A link that sleeps for a fixed time per transfer and tracks nothing else.
#[derive(Debug)]
struct SleepLink(Duration);

impl DeviceLedger for SleepLink {
    fn allocate(&self, _bytes: u64) -> std::result::Result<(), ComponentError> {
        Ok(())
    }

    fn free(&self, _bytes: u64) {}

    fn transfer(&self, _bytes: u64, _direction: Direction) -> std::result::Result<(), ComponentError> {
        std::thread::sleep(self.0);
        Ok(())
    }
}

/// One benchmark block: a square weight applied several times.
#[derive(Module, Debug)]
struct BenchBlock {
    weight: Param<Tensor<2>>,
    #[module(skip)]
    repeats: usize,
}

impl BenchBlock {
    fn new(dim: usize, repeats: usize, device: &Device) -> Self {
        let scale = 1.0 / (dim as f64).sqrt();
        let weight = Tensor::<2>::random([dim, dim], Distribution::Normal(0.0, scale), device);
        Self { weight: Param::from_tensor(weight), repeats }
    }

    fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        let w = self.weight.val();
        for _ in 0..self.repeats {
            x = tanh(x.matmul(w.clone()));
        }
        x
    }
}

fn finish(x: Tensor<2>) {
    // Reading one value waits for every queued kernel, on any backend.
    let _ = x.slice([0..1, 0..1]).into_data();
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

fn blocks(config: &OverlapConfig, device: &Device) -> Vec<BenchBlock> {
    (0..config.groups).map(|_| BenchBlock::new(config.dim, config.matmuls_per_group, device)).collect()
}

fn streamed(
    config: &OverlapConfig,
    link: Duration,
    prefetch: bool,
    device: &Device,
) -> Result<(GroupOffload, BlockOffload<BenchBlock>)> {
    let name = crate::OffloadDevice::from(device.clone()).name().clone();
    let offload = GroupOffload::new(
        GroupOffloadConfig::new(
            "overlap",
            crate::OffloadDevice::on_device(device.clone(), name, Arc::new(SleepLink(link)), None),
        )
        .with_prefetch(prefetch)
        .with_prefetch_depth(config.prefetch_depth.max(1)),
    )?;
    let part = offload.blocks("blocks", blocks(config, device), 1)?;
    Ok((offload, part))
}

/// Times `forwards` steady forwards (after one capture forward) of a streamed model. Each forward is one
/// [`GroupOffload::run`]: the first one's return ends the capture, and only then do takes prefetch (without it the
/// offloader stays capturing and every take loads on the spot, as this bench measured from 995b87a to 2026-12-05).
fn time_streamed(
    offload: &GroupOffload,
    part: &BlockOffload<BenchBlock>,
    x: &Tensor<2>,
    forwards: usize,
    compute: bool,
) -> Result<Duration> {
    let run = || {
        offload.run(|| -> Result<()> {
            let mut h = x.clone();
            for group in part.iter() {
                let group = group?;
                if compute {
                    for block in group.iter() {
                        h = block.forward(h);
                    }
                    finish(h.clone());
                }
            }
            Ok(())
        })
    };
    run()?;
    let mut samples = Vec::with_capacity(forwards);
    for _ in 0..forwards {
        let start = Instant::now();
        run()?;
        samples.push(start.elapsed());
    }
    Ok(median(samples))
}

/// Runs the overlap benchmark on the CPU (see the module documentation).
pub fn overlap_benchmark(config: OverlapConfig) -> Result<OverlapReport> {
    let device = Device::flex();
    let forwards = config.forwards.max(1);
    let x = Tensor::<2>::random([config.rows, config.dim], Distribution::Normal(0.0, 1.0), &device);

    // Compute only: the same blocks, resident.
    let resident = blocks(&config, &device);
    let compute_once = || {
        let mut h = x.clone();
        for block in &resident {
            h = block.forward(h);
            finish(h.clone());
        }
    };
    compute_once();
    let compute_only = median(
        (0..forwards)
            .map(|_| {
                let start = Instant::now();
                compute_once();
                start.elapsed()
            })
            .collect(),
    );
    let link = config.transfer.unwrap_or_else(|| compute_only / config.groups.max(1) as u32);

    let (offload, part) = streamed(&config, link, false, &device)?;
    let transfer_only = time_streamed(&offload, &part, &x, forwards, false)?;
    drop((part, offload));

    let (offload, part) = streamed(&config, link, false, &device)?;
    let serial_wall = time_streamed(&offload, &part, &x, forwards, true)?;
    drop((part, offload));

    let (offload, part) = streamed(&config, link, true, &device)?;
    // The capture forward inside `time_streamed` makes no prefetch and counts no miss; its end sends the first
    // prefetches of the next forward, which count as the steady forwards'.
    let before = offload.stats();
    let prefetch_wall = time_streamed(&offload, &part, &x, forwards, true)?;
    let after = offload.stats();

    let best = compute_only.max(transfer_only).as_secs_f64();
    Ok(OverlapReport {
        compute_only,
        transfer_only,
        prefetch_wall,
        serial_wall,
        prefetch_efficiency: best / prefetch_wall.as_secs_f64().max(f64::MIN_POSITIVE),
        serial_efficiency: best / serial_wall.as_secs_f64().max(f64::MIN_POSITIVE),
        transfer_per_group: link,
        prefetch_misses: after.misses - before.misses,
        prefetches: after.prefetches - before.prefetches,
        prefetch_waits: after.prefetch_waits - before.prefetch_waits,
    })
}
