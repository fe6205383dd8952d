//! Output probes: what a call returns as the device sees it ([`DeviceOutput`]), read back one value a tensor
//! ([`check_outputs`]) after a sync ([`check_device`]), and the count of those checks ([`device_checks`]).

use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{DType, Device, Tensor};
use offload_core::{ComponentError, DeviceMemory, DeviceName};

use super::failure::{catch_device_panic, classify};

/// What a component call returns, as far as the device is concerned: the tensors whose computation must have
/// succeeded before the call reports success. [`check_outputs`] reads one value of each back.
pub trait DeviceOutput {
    /// One-element probes of the output's float tensors (empty for outputs without device tensors).
    fn probes(&self) -> Vec<Tensor<1>>;
}

impl<const D: usize> DeviceOutput for Tensor<D> {
    fn probes(&self) -> Vec<Tensor<1>> {
        let elements = self.shape().num_elements();
        if elements == 0 {
            return Vec::new();
        }
        vec![self.clone().reshape([elements]).narrow(0, 0, 1).cast(DType::F32)]
    }
}

impl<T: DeviceOutput> DeviceOutput for Vec<T> {
    fn probes(&self) -> Vec<Tensor<1>> {
        self.iter().flat_map(DeviceOutput::probes).collect()
    }
}

impl<T: DeviceOutput> DeviceOutput for [T] {
    fn probes(&self) -> Vec<Tensor<1>> {
        self.iter().flat_map(DeviceOutput::probes).collect()
    }
}

impl DeviceOutput for () {
    fn probes(&self) -> Vec<Tensor<1>> {
        Vec::new()
    }
}

impl<A: DeviceOutput, B: DeviceOutput> DeviceOutput for (A, B) {
    fn probes(&self) -> Vec<Tensor<1>> {
        let mut probes = self.0.probes();
        probes.extend(self.1.probes());
        probes
    }
}

/// The syncs and read-backs the library's checks ([`check_device`], [`check_outputs`]) made on devices that
/// defer failures, since the process started, split by the thread that made them: the prefetch workers
/// (threads named `group-offload-<model>`) and every other thread (the compute thread). The CPU backend is
/// never checked, so it counts none. Read it before and after a run to get that run's checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceChecks {
    /// Syncs on compute threads.
    pub compute_syncs: u64,
    /// Read-backs on compute threads.
    pub compute_read_backs: u64,
    /// Syncs on prefetch workers.
    pub worker_syncs: u64,
    /// Read-backs on prefetch workers.
    pub worker_read_backs: u64,
}

impl std::ops::Sub for DeviceChecks {
    type Output = Self;

    fn sub(self, earlier: Self) -> Self {
        Self {
            compute_syncs: self.compute_syncs - earlier.compute_syncs,
            compute_read_backs: self.compute_read_backs - earlier.compute_read_backs,
            worker_syncs: self.worker_syncs - earlier.worker_syncs,
            worker_read_backs: self.worker_read_backs - earlier.worker_read_backs,
        }
    }
}

/// `[compute syncs, compute read-backs, worker syncs, worker read-backs]`.
pub(super) static CHECKS: [AtomicU64; 4] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// The checks made so far ([`DeviceChecks`]).
pub fn device_checks() -> DeviceChecks {
    let read = |i: usize| CHECKS[i].load(Ordering::Relaxed);
    DeviceChecks {
        compute_syncs: read(0),
        compute_read_backs: read(1),
        worker_syncs: read(2),
        worker_read_backs: read(3),
    }
}

/// Counts one check of `kind` (0 a sync, 1 a read-back) on the calling thread.
pub(super) fn count_check(kind: usize) {
    let worker = std::thread::current().name().is_some_and(|name| name.starts_with("group-offload-"));
    CHECKS[kind + if worker { 2 } else { 0 }].fetch_add(1, Ordering::Relaxed);
}

/// Reads back one value of each of `output`'s tensors in one transfer, so that a failure anything they depend on
/// met on the device (an allocation the runtime refused, a kernel that faulted) surfaces now, typed as
/// [`check_device`] types it; `Ok` when every value arrived.
pub fn check_outputs(
    output: &(impl DeviceOutput + ?Sized),
    device: &Device,
    name: &DeviceName,
    operation: &'static str,
    memory: Option<&dyn DeviceMemory>,
) -> std::result::Result<(), ComponentError> {
    if !defers_failures(device) {
        return Ok(());
    }
    let probes = output.probes();
    if probes.is_empty() {
        return Ok(());
    }
    count_check(1);
    match catch_device_panic(|| Tensor::cat(probes, 0).try_into_data()) {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(error)) => Err(classify(name, operation, error.reason(), error.is_device_poisoned(), memory)),
        Err(panic) => Err(panic.with_device(name, operation, memory)),
    }
}

/// Waits for `device`'s queued work (on this thread's stream) and turns a failure into a typed error:
/// [`ComponentError::OutOfMemory`] for the runtime's out-of-memory, with the bytes it asked for and what
/// `memory` reads as available (0 without readings), [`ComponentError::Device`] for anything else.
pub fn check_device(
    device: &Device,
    name: &DeviceName,
    operation: &'static str,
    memory: Option<&dyn DeviceMemory>,
) -> std::result::Result<(), ComponentError> {
    if !defers_failures(device) {
        return Ok(());
    }
    count_check(0);
    match catch_device_panic(|| device.sync()) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(classify(name, operation, error.reason(), error.is_device_poisoned(), memory)),
        Err(error) => Err(error.with_device(name, operation, memory)),
    }
}

/// Whether `device` can fail after the call that asked for the work: every device but burn's CPU backend, which
/// computes eagerly in host memory (so the checks above skip it, keeping the simulated card's hot paths free of
/// a sync and a read-back per call and per group upload).
pub(crate) fn defers_failures(device: &Device) -> bool {
    *device != Device::flex()
}

impl DeviceOutput for crate::uploads::DeviceTensor {
    /// A float tensor's one-value probe; none for a quantized one, which is read back by its own kernels (its
    /// upload is still synced by `check_device` before the group is published).
    fn probes(&self) -> Vec<Tensor<1>> {
        match self {
            crate::uploads::DeviceTensor::Flat(tensor) => tensor.probes(),
            crate::uploads::DeviceTensor::Shaped(_) => Vec::new(),
        }
    }
}
